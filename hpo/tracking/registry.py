"""`hpo retrain --register NAME`: the retrain's winner as a version of a model in MLflow's model
registry, with its model card as the version's description and tags. Unlike the trials' logging
this is the user's explicit request: it runs on the command's own thread and a failure is said."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpo.config.schema import Config
from hpo.errors import HPOError
from hpo.storage.url import mask_text
from hpo.tracking.mlflow_runs import (
    ATTEMPT_TAG,
    KIND_TAG,
    RUN_NAME_TAG,
    STUDY_TAG,
    client_for,
    quoted,
)

MODEL_ARTIFACT = "final_model"  # the final model's folder in its run's artifacts
# The scheme of a store URI MLflow's server takes as a version's source as it is (it refuses
# local paths outside the run's artifacts: those are uploaded).
REMOTE_SCHEMES = ("s3", "gs", "wasbs", "abfss", "hdfs")


def check_register(config: Config, name: str) -> None:
    """Before any training: what registering needs (MLflow tracking, a model hpo saves)."""
    if not name.strip():
        raise HPOError("--register: got an empty name; give the registered model's name")
    if config.tracking.mlflow is None:
        raise HPOError(
            "--register: the model registry is MLflow's and no MLflow tracking is configured; "
            "add tracking.mlflow to the config or pass --tracking URI"
        )
    if config.training.entrypoint is not None:
        raise HPOError(
            "--register: a training function keeps its own model, hpo saves none to "
            "register; leave --register out"
        )


def register_winner(
    config: Config,
    name: str,
    study: str,
    trial: Any,
    out: Path,
    card: dict[str, Any],
    description: str,
) -> str:
    """Register the final model saved in `out` (from `trial` of retrain study `study`) as a new
    version of `name`, described by its model card (`card`, and `description`: its Markdown);
    returns "NAME version N". The version's run is the trial's MLflow run
    (or a run made for it when the tracker missed the trial); its source is the artifact
    store's copy of the model where that is remote, else `out` uploaded to the run."""
    from mlflow.exceptions import MlflowException

    mlflow = config.tracking.mlflow
    if mlflow is None or not mlflow.uri:  # check_register and tracking.resolve ran before
        raise HPOError(f"--register {name}: no MLflow tracking URI")
    client = client_for(mlflow.uri, config.tracking.patience)
    where = mask_text(mlflow.uri)
    try:
        run_id = _winner_run(client, mlflow.experiment or f"hpo-{study}", study, trial)
        source = _source(client, run_id, trial.user_attrs.get("best_model_uri"), out, card)
        try:
            client.create_registered_model(name, tags={"hpo.study": str(card["study"])})
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        version = client.create_model_version(
            name, source, run_id=run_id, tags=version_tags(card, out), description=description
        )
    except (MlflowException, OSError) as e:
        said = mask_text(" ".join(str(e).split()))[:300]
        raise HPOError(
            f"--register {name}: MLflow at {where} refused: {said}; the final model is saved "
            f"in {out}: run the same hpo retrain again to register it"
        ) from e
    return f"{name} version {version.version}"


def version_tags(card: dict[str, Any], out: Path) -> dict[str, str]:
    """The model card's essentials as tags (searchable in the registry)."""
    winner = card["winner"]
    tags = {
        "hpo.study": card["study"],
        "hpo.retrain_study": card["retrain_study"],
        "hpo.metric": card["metric"],
        "hpo.mean": winner["mean"],
        "hpo.std": winner["std"],
        "hpo.seeds": winner["seeds"],
        "hpo.params": json.dumps(winner["params"], sort_keys=True, default=str),
        "hpo.trial": card["saved_run"]["trial"],
        "hpo.full_data": card["saved_run"]["full_data"],
        "hpo.final_model": str(out.resolve()),
    }
    return {key: str(value)[:5000] for key, value in tags.items() if value is not None}


def _winner_run(client: Any, experiment: str, study: str, trial: Any) -> str:
    """The winning run's MLflow run, found by its study and first attempt as the tracker tagged
    it; a run made for it in the same experiment when the tracker missed it."""
    first = trial.user_attrs.get("first_attempt", trial.number)
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found is not None else None
    if experiment_id is not None:
        runs = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{STUDY_TAG}` = '{quoted(study)}' "
            f"and tags.`{ATTEMPT_TAG}` = '{first}'",
            max_results=1,
        )
        if runs:
            return str(runs[0].info.run_id)
    else:
        experiment_id = client.create_experiment(experiment)
    tags = {
        STUDY_TAG: study,
        KIND_TAG: "final_model",
        ATTEMPT_TAG: str(first),
        RUN_NAME_TAG: f"final model (trial {trial.number})",
    }
    run_id = str(client.create_run(experiment_id, tags=tags).info.run_id)
    client.set_terminated(run_id, status="FINISHED")
    return run_id


def _source(
    client: Any, run_id: str, store_uri: str | None, out: Path, card: dict[str, Any]
) -> str:
    """The store's copy when MLflow can point at it (not a second copy); else `out` uploaded
    into the run's artifacts. The card goes with the run either way."""
    if store_uri and store_uri.split("://", 1)[0] in REMOTE_SCHEMES:
        client.log_dict(run_id, card, "hpo_model_card.json")
        return store_uri
    client.log_artifacts(run_id, str(out), MODEL_ARTIFACT)
    return f"runs:/{run_id}/{MODEL_ARTIFACT}"
