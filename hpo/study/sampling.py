"""How the study proposes and prunes: its sampler (with a seed of each worker's own) and its
pruner, built from the config.
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from collections.abc import Iterator
from typing import Any

import optuna

from hpo.config.schema import (
    ParamSpec,
    PrunerConfig,
    SamplerConfig,
    has_conditions,
)
from hpo.config.space_checks import grid_points
from hpo.study.pruners import MarginPruner


def build_sampler(
    cfg: SamplerConfig, worker_index: int = 0, space: dict[str, ParamSpec] | None = None
) -> optuna.samplers.BaseSampler:
    """The study's sampler for the `worker_index`-th worker to join the study; the grid
    sampler needs the search `space`."""
    seed = worker_seed(cfg.seed, worker_index)
    if cfg.type == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if cfg.type == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=cfg.n_startup_trials)
    if cfg.type == "cmaes":
        return optuna.samplers.CmaEsSampler(
            seed=seed, n_startup_trials=cfg.n_startup_trials, warn_independent_sampling=False
        )
    if cfg.type == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    if cfg.type == "qmc":
        return optuna.samplers.QMCSampler(seed=seed, warn_independent_sampling=False)
    if cfg.type == "grid":
        grid = {name: grid_points(spec) for name, spec in (space or {}).items()}
        if not grid or any(points is None for points in grid.values()):
            raise ValueError("the grid sampler needs a finite search space")  # config checks it
        return optuna.samplers.GridSampler(grid, seed=seed)  # type: ignore[arg-type]
    with experimental_features():
        return optuna.samplers.TPESampler(
            seed=seed,
            n_startup_trials=cfg.n_startup_trials,
            multivariate=cfg.multivariate is not False,
            group=tpe_group(cfg, space or {}),
            constant_liar=cfg.constant_liar,
        )


def tpe_group(cfg: SamplerConfig, space: dict[str, ParamSpec]) -> bool:
    """TPE's `group`: as set, or on for a multivariate TPE over a space with conditions. Without
    it, multivariate TPE models only the parameters every trial has, and samples a conditional
    one independently; with it, each set of parameters that appear together is modelled
    jointly (Optuna's advice for conditional spaces, TPESampler's docs)."""
    if cfg.group is not None:
        return cfg.group
    return cfg.type == "tpe" and cfg.multivariate is not False and has_conditions(space)


def worker_seed(seed: int | None, worker_index: int) -> int | None:
    """Workers that share a sampler seed draw the same random trials: each worker of a study
    gets its own seed, derived from the configured one and the order it joined the study in.
    The first worker uses the configured seed itself, so a single worker stays reproducible."""
    if seed is None or worker_index == 0:
        return seed
    digest = hashlib.sha256(f"hpo-worker-seed/{seed}/{worker_index}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def build_pruner(cfg: PrunerConfig) -> optuna.pruners.BasePruner:
    pruner = _base_pruner(cfg)
    if cfg.patience is None:
        return pruner
    wrapped = None if isinstance(pruner, optuna.pruners.NopPruner) else pruner
    with experimental_features():
        return optuna.pruners.PatientPruner(wrapped, patience=cfg.patience, min_delta=cfg.min_delta)


@contextlib.contextmanager
def experimental_features() -> Iterator[None]:
    """TPE's multivariate, group and constant_liar, the PatientPruner and metric names are
    "experimental" in Optuna (for years now): one warning per worker that tells a user of hpo
    nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


# The settings each pruner type reads (_base_pruner); patience and min_delta wrap any of them.
_PRUNER_FIELDS = {
    "median": ("n_startup_trials", "n_warmup_steps", "margin"),
    "percentile": ("percentile", "n_startup_trials", "n_warmup_steps", "margin"),
    "successive_halving": ("min_resource", "reduction_factor"),
    "hyperband": ("min_resource", "reduction_factor"),
    "none": (),
}


def pruner_settings(cfg: PrunerConfig) -> dict[str, Any]:
    """What decides which trials the pruner stops: its type and the settings that type reads
    (a median pruner's reduction_factor is no setting of it)."""
    settings: dict[str, Any] = {"type": cfg.type}
    settings.update((name, getattr(cfg, name)) for name in _PRUNER_FIELDS[cfg.type])
    if cfg.patience is not None:
        settings.update(patience=cfg.patience, min_delta=cfg.min_delta)
    if cfg.objective is not None:  # several objectives: which one it judges
        settings["objective"] = cfg.objective
    return settings


def _base_pruner(cfg: PrunerConfig) -> optuna.pruners.BasePruner:
    if cfg.type in ("median", "percentile") and cfg.margin > 0:
        percentile = 50.0 if cfg.type == "median" else cfg.percentile
        return MarginPruner(percentile, cfg.n_startup_trials, cfg.n_warmup_steps, cfg.margin)
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
