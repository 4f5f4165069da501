"""Create or load a study and run trials on it until the study's own trial budget is spent.

The budget (`n_trials`) counts the study's trials in storage, not this process's.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict

import optuna

from hpo.checkpoints import checkpoint_root, remove_stale_checkpoints
from hpo.config import Config, PrunerConfig, SamplerConfig
from hpo.errors import ConfigError
from hpo.objective import Objective
from hpo.stopping import Interrupted, StopRequest
from storage.budget import TrialBudgetSpent
from storage.retry import retry_trial

log = logging.getLogger(__name__)


def build_sampler(cfg: SamplerConfig) -> optuna.samplers.BaseSampler:
    if cfg.type == "random":
        return optuna.samplers.RandomSampler(seed=cfg.seed)
    # Constant liar keeps parallel workers from proposing the same configuration in a row.
    return optuna.samplers.TPESampler(
        seed=cfg.seed, constant_liar=True, n_startup_trials=cfg.n_startup_trials
    )


def build_pruner(cfg: PrunerConfig) -> optuna.pruners.BasePruner:
    if cfg.type == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=cfg.n_startup_trials, n_warmup_steps=cfg.n_warmup_steps
        )
    if cfg.type == "percentile":
        return optuna.pruners.PercentilePruner(
            cfg.percentile, n_startup_trials=cfg.n_startup_trials, n_warmup_steps=cfg.n_warmup_steps
        )
    min_resource = cfg.min_resource if cfg.min_resource is not None else "auto"
    if cfg.type == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=min_resource, reduction_factor=cfg.reduction_factor
        )
    if cfg.type == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=cfg.min_resource or 1, reduction_factor=cfg.reduction_factor
        )
    return optuna.pruners.NopPruner()


def open_study(storage: optuna.storages.BaseStorage, name: str, config: Config) -> optuna.Study:
    """Create the study, or join it if it exists with the same direction."""
    direction = config.study.resolved_direction
    study = optuna.create_study(
        storage=storage,
        study_name=name,
        direction=direction,
        sampler=build_sampler(config.study.sampler),
        pruner=build_pruner(config.study.pruner),
        load_if_exists=True,
    )
    existing = study.direction.name.lower()
    if existing != direction:
        raise ConfigError(
            [
                f"study.direction: study {name!r} already exists and is {existing}d, but this "
                f"config "
                f"says {direction}; use another --study name or the same metric"
            ],
            config.source,
        )
    space = json.loads(json.dumps({k: asdict(v) for k, v in config.search_space.items()}))
    if not study.user_attrs:
        study.set_user_attr("metric", config.study.metric)
        study.set_user_attr("search_space", space)
    else:
        stored = study.user_attrs.get("search_space", space)
        differ = sorted(k for k in stored.keys() | space.keys() if stored.get(k) != space.get(k))
        if differ:
            raise ConfigError(
                [
                    f"search_space: study {name!r} was created with another search space "
                    f"(it differs in {', '.join(differ)}); every worker of a study needs the "
                    "same search space: use the study's config or another --study name"
                ],
                config.source,
            )
    return study


def run_trials(study: optuna.Study, objective: Objective, stop: StopRequest) -> int:
    """Run trials until the study holds n_trials, this worker's timeout passes or it is asked
    to stop; returns how many this worker ran. A failing trial is recorded as FAIL and never
    stops the worker; an interrupted one is handed back to the study for another attempt."""
    study_config = objective.task.config.study
    timeout = study_config.timeout
    deadline = time.monotonic() + timeout if timeout is not None else None
    # A trial process takes its garbage with it; in the worker itself a collection frees the
    # trial's memory, at about 150 ms a trial with torch loaded.
    collect = study_config.trial_isolation == "none"
    checkpoints = checkpoint_root(objective.task.config, study.study_name)
    ran = 0
    while not stop.requested:
        if deadline is not None and time.monotonic() >= deadline:
            log.info("timeout of %.0f s reached; stopping", timeout)
            break
        try:
            study.optimize(objective, n_trials=1, catch=(Exception,), gc_after_trial=collect)
        except TrialBudgetSpent:
            log.info(
                "study %r holds %d trials, its budget; stopping",
                study.study_name,
                study_config.n_trials,
            )
            break
        except Interrupted:
            hand_back(study, objective.trial_number, study_config.max_retries)
            break
        finally:
            if study_config.checkpoints:
                remove_stale_checkpoints(study, checkpoints)
        ran += 1
    return ran


def hand_back(study: optuna.Study, trial_number: int | None, max_retries: int) -> None:
    """The interrupted trial is FAIL now; queue it again so that the study does not lose it."""
    interrupted = [t for t in study.get_trials(deepcopy=False) if t.number == trial_number]
    if not interrupted or interrupted[0].state != optuna.trial.TrialState.FAIL:
        return
    retry = retry_trial(study, interrupted[0], max_retries)
    if retry is not None:
        log.warning("trial %d was interrupted; handed back as trial %d", trial_number, retry)


def summary_lines(study: optuna.Study, metric: str) -> list[str]:
    """What the user wants at the end: counts by state and the best trial."""
    trials = study.get_trials(deepcopy=False)
    counts: dict[str, int] = {}
    for trial in trials:
        counts[trial.state.name] = counts.get(trial.state.name, 0) + 1
    state_text = ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items())) or "no trials"
    lines = [f"study {study.study_name!r}: {len(trials)} trials ({state_text})"]
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not complete:
        lines.append("no completed trial yet, so no best trial")
        return lines
    best = study.best_trial
    lines.append(f"best trial #{best.number}: {metric}={best.value:.4f}")
    for key, value in best.params.items():
        lines.append(f"  {key}: {value:.3g}" if isinstance(value, float) else f"  {key}: {value}")
    attrs = best.user_attrs
    if "physical_batch_size" in attrs:
        lines.append(
            f"  physical batch {attrs['physical_batch_size']} x {attrs.get('grad_accum_steps')} "
            f"accumulation steps, {attrs.get('samples_per_s', 0):.1f} samples/s "
            f"on {attrs.get('device_name', '?')}"
        )
    return lines
