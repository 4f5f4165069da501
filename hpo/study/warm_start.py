"""study.warm_start: the best configurations of earlier studies, mapped onto this study's search
space and queued before the sampler's own, once per study whichever worker starts first; with
`narrow`, the float and int ranges narrowed around them (the same ranges in every worker).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from hpo.config.budget import DEFAULT_WIDEN, WarmStartConfig, WarmStartSource
from hpo.config.schema import Config, ParamSpec, applies
from hpo.errors import ConfigError
from hpo.storage.engine import StudyStorage, open_storage
from hpo.storage.url import StorageURL

log = logging.getLogger(__name__)

# A study system attribute, set under the study's lock by the worker that queues the warm
# start: the narrowed ranges ({name: [low, high]}), which every later worker applies.
WARM_START_ATTR = "hpo:warm_start"
# A narrowed range is at least this share of the original one: the top K may all agree.
MIN_SHARE = 0.1


@dataclass
class Mapped:
    """One source study's configurations, mapped onto this space, and what did not fit."""

    study: str
    configurations: list[dict[str, Any]] = field(default_factory=list)
    notes: dict[str, set[str]] = field(default_factory=dict)  # parameter -> what happened

    def note(self, name: str, what: str) -> None:
        self.notes.setdefault(name, set()).add(what)

    def line(self, queued: int) -> str:
        """The one log line of this source."""
        said = "; ".join(
            f"{name}: {', '.join(sorted(w))}" for name, w in sorted(self.notes.items())
        )
        return (
            f"warm start from study {self.study!r}: {queued} of its best "
            f"{len(self.configurations)} configurations queued"
            + (f"; {said}" if said else "; every value fits this search space")
        )


def plan(storage: StudyStorage, config: Config) -> list[Mapped]:
    """Each source study's best configurations mapped onto the config's space. Raises
    ConfigError (one line) for a source study that does not exist, naming the ones that do."""
    warm = config.study.warm_start
    if warm is None:
        return []
    return [_mapped(source, storage, config, warm) for source in warm.source_list()]


def _mapped(
    source: WarmStartSource, storage: StudyStorage, config: Config, warm: WarmStartConfig
) -> Mapped:
    trials, direction = _source_trials(source, storage, config.source)
    mapped = Mapped(source.study)
    for params in best_params(trials, direction, warm.top):
        configuration = map_onto(params, config.search_space, mapped)
        if configuration:
            mapped.configurations.append(configuration)
    return mapped


def _source_trials(
    source: WarmStartSource, storage: StudyStorage, where: str
) -> tuple[list[FrozenTrial], StudyDirection]:
    """The source study's completed trials and its (first) direction."""
    other = storage
    if source.storage is not None:
        url = StorageURL(source.storage, "config", "study.warm_start.from[].storage")
        other = open_storage(url, read_only=True, must_exist=True)
    try:
        study_id = other.get_study_id_from_name(source.study)
    except KeyError:
        names = sorted(s.study_name for s in other.get_all_studies())
        raise ConfigError(
            [
                f"study.warm_start.from: no study {source.study!r} in that storage; its "
                f"studies: {', '.join(names) if names else 'none'}"
            ],
            where,
        ) from None
    trials = other.get_all_trials(study_id, deepcopy=False, states=(TrialState.COMPLETE,))
    return trials, other.get_study_directions(study_id)[0]


def best_params(
    trials: list[FrozenTrial], direction: StudyDirection, top: int
) -> list[dict[str, Any]]:
    """The parameters of the `top` best completed trials (by the first objective), best first,
    each configuration once."""
    scored = [t for t in trials if t.values and math.isfinite(t.values[0])]
    scored.sort(key=lambda t: t.values[0], reverse=direction == StudyDirection.MAXIMIZE)
    chosen: list[dict[str, Any]] = []
    for trial in scored:
        if trial.params not in chosen:
            chosen.append(dict(trial.params))
        if len(chosen) == top:
            break
    return chosen


def map_onto(params: dict[str, Any], space: dict[str, ParamSpec], mapped: Mapped) -> dict[str, Any]:
    """A source configuration in this space: a parameter this space lacks is dropped, a value
    outside a range clipped to it (onto its step), one outside the choices dropped (sampled
    instead), a parameter the source lacks left out (sampled); each noted in `mapped`."""
    configuration: dict[str, Any] = {}
    for name, value in params.items():
        spec = space.get(name)
        if spec is None:
            mapped.note(name, "dropped (not in this search space)")
        elif spec.type == "categorical":
            if value in (spec.choices or []):
                configuration[name] = value
            else:
                mapped.note(name, f"{value!r} dropped (not among this space's choices)")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            configuration[name] = _fitted(name, float(value), spec, mapped)
        else:
            mapped.note(name, f"{value!r} dropped (not a number)")
    for name in space:
        if name not in params:
            mapped.note(name, "sampled (not in the earlier study)")
    for name in [n for n in configuration if not applies(space[n], configuration)]:
        del configuration[name]  # its `when` does not hold here: it does not apply
        mapped.note(name, "dropped where its `when` does not hold")
    return configuration


def _fitted(name: str, value: float, spec: ParamSpec, mapped: Mapped) -> float | int:
    low, high = float(spec.low or 0.0), float(spec.high or 0.0)
    fitted = min(max(value, low), high)
    if spec.step is not None:
        fitted = min(low + round((fitted - low) / spec.step) * spec.step, high)
    if spec.type == "int":
        fitted = float(round(fitted))
    if not math.isclose(fitted, value, rel_tol=1e-9, abs_tol=1e-12):
        mapped.note(name, f"clipped into [{low:g}, {high:g}]")
    return int(fitted) if spec.type == "int" else fitted


def narrowed(
    space: dict[str, ParamSpec], configurations: list[dict[str, Any]], widen: float = DEFAULT_WIDEN
) -> dict[str, list[float]]:
    """Each float or int parameter's narrowed range: the span of its values in
    `configurations` widened `widen` times about its middle (in log space for a log
    parameter), at least MIN_SHARE of the original range, inside the original bounds; an int
    range widened outwards to whole numbers (onto its step, as a float's with a step)."""
    ranges: dict[str, list[float]] = {}
    for name, spec in space.items():
        values = [float(c[name]) for c in configurations if name in c]
        if spec.type == "categorical" or not values or spec.low is None or spec.high is None:
            continue
        scale = (math.log, math.exp) if spec.log else (lambda v: v, lambda v: v)
        low, high = scale[0](spec.low), scale[0](spec.high)
        lo, hi = scale[0](min(values)), scale[0](max(values))
        half = max((hi - lo) * widen, MIN_SHARE * (high - low)) / 2
        middle = (lo + hi) / 2
        new_low = scale[1](max(low, middle - half))
        new_high = scale[1](min(high, middle + half))
        ranges[name] = _on_grid(spec, max(new_low, spec.low), min(new_high, spec.high))
    return ranges


def _on_grid(spec: ParamSpec, low: float, high: float) -> list[float]:
    """[low, high] widened outwards onto the parameter's step (1 for an int)."""
    step = spec.step if spec.step is not None else (1.0 if spec.type == "int" else None)
    if step is None:
        return [low, high]
    base = float(spec.low or 0.0)
    on_low = base + math.floor((low - base) / step + 1e-9) * step
    on_high = base + math.ceil((high - base) / step - 1e-9) * step
    return [max(on_low, float(spec.low or 0.0)), min(on_high, float(spec.high or 0.0))]


def apply(
    study: optuna.Study,
    storage: StudyStorage,
    config: Config,
    mapped: list[Mapped],
    enqueue: Callable[[optuna.Study, dict[str, Any], str], bool],
) -> None:
    """Queue the planned configurations (with `enqueue`: hpo.study.join's, which skips one the
    study holds already) and record the narrowed ranges, once per study: the first worker
    here, under the study's lock. Then narrow this worker's space as recorded."""
    warm = config.study.warm_start
    if warm is None:
        return
    study_id = storage.get_study_id_from_name(study.study_name)
    with storage.lock(study_id):
        record = storage.get_study_system_attrs(study_id).get(WARM_START_ATTR)
        if record is None:
            configurations = [c for m in mapped for c in m.configurations]
            ranges = narrowed(config.search_space, configurations) if warm.narrow else {}
            for source in mapped:
                queued = sum(
                    enqueue(study, c, f"warm start from {source.study!r}")
                    for c in source.configurations
                )
                log.info("%s", source.line(queued))
            record = {"narrowed": ranges}
            storage.set_study_system_attr(study_id, WARM_START_ATTR, record)
        else:
            log.info("warm start: queued by the study's first worker already")
    _narrow(config.search_space, record.get("narrowed", {}))


def _narrow(space: dict[str, ParamSpec], ranges: dict[str, list[float]]) -> None:
    for name, (low, high) in sorted(ranges.items()):
        spec = space.get(name)
        if spec is None:
            continue
        log.info(
            "warm start narrows %s from [%g, %g] to [%g, %g]", name, spec.low, spec.high, low, high
        )
        spec.low, spec.high = (int(low), int(high)) if spec.type == "int" else (low, high)
