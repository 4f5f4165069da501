"""Create or load a study and run trials on it until the study's own trial budget is spent.

The budget (`n_trials`) counts the study's trials in storage, not this process's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

import optuna

from hpo.config import Config, PrunerConfig, SamplerConfig
from hpo.errors import ConfigError
from hpo.objective import Objective
from storage.batch_cache import BatchSizeCache
from storage.budget import TrialBudgetSpent
from trainer.data import PreparedData

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
    if not study.user_attrs:
        study.set_user_attr("metric", config.study.metric)
        study.set_user_attr("search_space", {k: asdict(v) for k, v in config.search_space.items()})
    return study


def run_trials(
    study: optuna.Study,
    config: Config,
    data: PreparedData,
    batch_cache: BatchSizeCache,
) -> int:
    """Run trials until the study holds n_trials or this worker's timeout passes; returns how
    many this worker ran. A failing trial is recorded as FAIL and never stops the worker."""
    objective = Objective(config, data, batch_cache)
    budget, timeout = config.study.n_trials, config.study.timeout
    deadline = time.monotonic() + timeout if timeout is not None else None
    ran = 0
    while True:
        if deadline is not None and time.monotonic() >= deadline:
            log.info("timeout of %.0f s reached; stopping", timeout)
            break
        try:
            study.optimize(objective, n_trials=1, catch=(Exception,), gc_after_trial=True)
        except TrialBudgetSpent:
            log.info("study %r holds %d trials, its budget; stopping", study.study_name, budget)
            break
        ran += 1
    return ran


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
