"""A define-by-run search space (`search_space: space:space`): Optuna's trial in, the trial's
parameters out, by the names a YAML search space takes. Conditions are plain Python."""

import optuna


def space(trial: optuna.Trial) -> dict[str, object]:
    params: dict[str, object] = {
        "learning_rate": trial.suggest_float("learning_rate", 3e-5, 5e-3, log=True),
        "effective_batch_size": trial.suggest_categorical("effective_batch_size", [16, 32, 64]),
        "lr_schedule": trial.suggest_categorical("lr_schedule", ["linear", "cosine"]),
    }
    if params["lr_schedule"] == "linear":  # warmup is searched for the linear schedule only
        params["warmup_ratio"] = trial.suggest_float("warmup_ratio", 0.0, 0.2)
    return params
