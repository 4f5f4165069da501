"""The YAML config of a study: typed sections, validated up front, every problem reported at once.

Relative paths in the file are resolved against the folder that holds the file.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from hpo.errors import ConfigError
from trainer.config import TUNABLE_FIELDS, DataConfig, ModelConfig, TrainingConfig
from trainer.metrics import METRIC_DIRECTIONS, Direction

DEFAULT_BATCH_CHOICES = [32, 64, 128, 256, 512]


def _doc(text: str, default: Any = None) -> Any:
    return field(default=default, metadata={"help": text})


@dataclass
class SamplerConfig:
    """How Optuna proposes the next trial."""

    type: Literal["tpe", "random"] = _doc(
        "tpe (constant liar, for parallel workers) or random.", "tpe"
    )
    seed: int | None = _doc("Sampler seed, for a reproducible sequence of trials.")
    n_startup_trials: int = _doc("tpe: random trials before the model of good regions is used.", 10)

    def problems(self) -> list[tuple[str, Any, str]]:
        if self.n_startup_trials < 0:
            return [("n_startup_trials", self.n_startup_trials, "must be >= 0")]
        return []


@dataclass
class PrunerConfig:
    """When a weak trial is stopped early, judged at each evaluation."""

    type: Literal["median", "percentile", "successive_halving", "hyperband", "none"] = _doc(
        "median, percentile, successive_halving (ASHA), hyperband or none.", "median"
    )
    n_startup_trials: int = _doc("median/percentile: complete trials before pruning starts.", 3)
    n_warmup_steps: int = _doc(
        "median/percentile: evaluations of a trial before it can be pruned.", 1
    )
    percentile: float = _doc("percentile: prune below this percentile of the other trials.", 25.0)
    min_resource: int | None = _doc("successive_halving/hyperband: evaluations before a rung.")
    reduction_factor: int = _doc("successive_halving/hyperband: keep 1/this at each rung.", 3)

    def problems(self) -> list[tuple[str, Any, str]]:
        found: list[tuple[str, Any, str]] = []
        for key in ("n_startup_trials", "n_warmup_steps"):
            if getattr(self, key) < 0:
                found.append((key, getattr(self, key), "must be >= 0"))
        if not 0 < self.percentile < 100:
            found.append(("percentile", self.percentile, "must be in (0, 100)"))
        if self.min_resource is not None and self.min_resource < 1:
            found.append(("min_resource", self.min_resource, "must be a positive integer or null"))
        if self.reduction_factor < 2:
            found.append(("reduction_factor", self.reduction_factor, "must be >= 2"))
        return found


@dataclass
class StudyConfig:
    """What the study optimises and how long it runs."""

    metric: Literal["accuracy", "macro_f1", "eval_loss"] = _doc(
        "Evaluation metric that is the trial's value (its best evaluation).", "accuracy"
    )
    direction: Literal["maximize", "minimize"] | None = _doc(
        "Optimisation direction; default: the metric's natural one."
    )
    n_trials: int | None = _doc(
        "Trials for the whole study (all workers); null: until timeout.", 20
    )
    timeout: float | None = _doc("Seconds this worker runs before it stops starting trials.")
    storage: str | None = _doc("Database URL; --storage and $HPO_STORAGE take precedence.")
    heartbeat_interval: int = _doc("Seconds between a running trial's heartbeats.", 30)
    grace_period: int | None = _doc(
        "Seconds without a heartbeat before a trial counts as dead; default 3x the interval."
    )
    max_retries: int = _doc(
        "Times a trial whose worker died or was stopped is re-run by a worker.", 2
    )
    trial_isolation: Literal["process", "none"] = _doc(
        "process: each trial trains in a child process, so a crash, a CUDA error or leaked "
        "memory ends with the trial; none: in the worker itself (for debuggers).",
        "process",
    )
    checkpoints: bool = _doc(
        "Checkpoint each trial, so that a retried trial resumes; the best trial's model is kept.",
        True,
    )
    checkpoint_interval: float = _doc(
        "Least seconds between two checkpoints of a trial, written at evaluations (0: at every "
        "evaluation). A stop (SIGTERM, Ctrl-C) always checkpoints; a crash loses at most this "
        "much training.",
        300.0,
    )
    checkpoint_dir: str | None = _doc(
        "Folder for checkpoints (default ./hpo-checkpoints); on a filesystem every worker "
        "shares, a trial retried on another host resumes too."
    )
    database_patience: float = _doc(
        "Seconds a worker rides out an unreachable study database (retrying with backoff) "
        "before it gives up.",
        600.0,
    )
    stop_timeout: float = _doc(
        "Seconds a worker gives its running trial to stop after SIGTERM or Ctrl-C before it "
        "kills it.",
        30.0,
    )
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    pruner: PrunerConfig = field(default_factory=PrunerConfig)

    def problems(self) -> list[tuple[str, Any, str]]:
        found: list[tuple[str, Any, str]] = []
        natural = METRIC_DIRECTIONS[self.metric]
        if self.direction is not None and self.direction != natural:
            found.append(("direction", self.direction, f"metric {self.metric} must be {natural}d"))
        if self.n_trials is not None and self.n_trials < 1:
            found.append(("n_trials", self.n_trials, "must be a positive integer or null"))
        if self.timeout is not None and self.timeout <= 0:
            found.append(("timeout", self.timeout, "must be > 0 seconds or null"))
        if self.heartbeat_interval < 1:
            found.append(("heartbeat_interval", self.heartbeat_interval, "must be >= 1 second"))
        if self.grace_period is not None and self.grace_period <= self.heartbeat_interval:
            found.append(("grace_period", self.grace_period, "must exceed heartbeat_interval"))
        if self.max_retries < 0:
            found.append(("max_retries", self.max_retries, "must be >= 0"))
        if self.database_patience <= 0:
            found.append(("database_patience", self.database_patience, "must be > 0 seconds"))
        if self.stop_timeout <= 0:
            found.append(("stop_timeout", self.stop_timeout, "must be > 0 seconds"))
        if self.checkpoint_interval < 0:
            found.append(("checkpoint_interval", self.checkpoint_interval, "must be >= 0 seconds"))
        if self.n_trials is None and self.timeout is None:
            found.append(("n_trials", None, "give n_trials or timeout, or the study never ends"))
        return found

    @property
    def resolved_direction(self) -> Direction:
        return self.direction or METRIC_DIRECTIONS[self.metric]


@dataclass
class ParamSpec:
    """One dimension of the search space."""

    type: Literal["categorical", "float", "int"] = _doc("categorical, float or int.", "float")
    choices: list[Any] | None = _doc("categorical: the values to choose from.")
    low: float | None = _doc("float/int: lower bound, inclusive.")
    high: float | None = _doc("float/int: upper bound, inclusive.")
    log: bool = _doc("float/int: sample uniformly in log space.", False)
    step: float | None = _doc("float/int: discretisation step.")

    def problems(self) -> list[tuple[str, Any, str]]:
        if self.type == "categorical":
            if not self.choices:
                return [("choices", self.choices, "a categorical parameter needs a non-empty list")]
            return []
        found: list[tuple[str, Any, str]] = []
        if self.low is None or self.high is None:
            return [("low", self.low, f"a {self.type} parameter needs both low and high")]
        if self.low > self.high:
            found.append(("low", self.low, f"must be <= high ({self.high})"))
        if self.log and self.low <= 0:
            found.append(("low", self.low, "must be > 0 for a log-scale parameter"))
        if self.log and self.step is not None:
            found.append(("step", self.step, "cannot be combined with log: true"))
        if self.type == "int" and not all(float(v).is_integer() for v in (self.low, self.high)):
            found.append(("low", (self.low, self.high), "int bounds must be whole numbers"))
        return found

    def values_for_bounds(self) -> list[Any]:
        """Every value the parameter can take at its extremes, for range checks."""
        if self.type == "categorical":
            return list(self.choices or [])
        return [self.low, self.high]


def default_search_space() -> dict[str, ParamSpec]:
    return {
        "effective_batch_size": ParamSpec(type="categorical", choices=list(DEFAULT_BATCH_CHOICES)),
        "learning_rate": ParamSpec(type="float", low=1e-6, high=1e-3, log=True),
    }


@dataclass
class Config:
    """A whole study config file."""

    study: StudyConfig = field(default_factory=StudyConfig)
    search_space: dict[str, ParamSpec] = field(default_factory=default_search_space)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    source: str = "config"


def load_config(path: str | Path) -> Config:
    """Read, type-check and validate a config file; raises ConfigError listing every problem."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            [f"{path}: no such file; pass --config with a YAML file such as configs/demo.yaml"]
        )
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError([f"not valid YAML: {str(e).splitlines()[0]}"], str(path)) from e
    return parse_config(raw if raw is not None else {}, base_dir=path.parent, source=str(path))


def parse_config(raw: Any, base_dir: Path, source: str = "config") -> Config:
    """Build a Config from parsed YAML; raises ConfigError listing every problem."""
    problems: list[str] = []
    if not isinstance(raw, dict):
        raise ConfigError(
            [f"the file must hold a mapping of sections, got {type(raw).__name__}"], source
        )
    raw = dict(raw)
    space_raw = raw.pop("search_space", None)
    config = _build(Config, raw, "", problems, skip={"search_space", "source"})
    config.source = source
    config.search_space = _build_search_space(space_raw, problems)
    if not problems:  # needs well-typed sections; its findings would be noise otherwise
        _check_search_space(config, problems)
    _resolve_paths(config, base_dir, problems)
    if problems:
        raise ConfigError(problems, source)
    return config


def _build_search_space(raw: Any, problems: list[str]) -> dict[str, ParamSpec]:
    space = default_search_space()
    if raw is None:
        return space
    if not isinstance(raw, dict):
        problems.append(f"search_space: got {raw!r}; must be a mapping of parameter name to spec")
        return space
    for name, spec in raw.items():
        key = f"search_space.{name}"
        if name not in TUNABLE_FIELDS:
            problems.append(
                f"{key}: unknown parameter{_did_you_mean(name, TUNABLE_FIELDS)}; "
                f"tunable: {', '.join(TUNABLE_FIELDS)}"
            )
            continue
        space[name] = _build(ParamSpec, spec, key + ".", problems)
    return space


def _check_search_space(config: Config, problems: list[str]) -> None:
    """Every value a parameter can take must itself be a valid training setting."""
    hints = typing.get_type_hints(TrainingConfig)
    for name, spec in config.search_space.items():
        if spec.type == "float" and hints[name] is int:
            problems.append(
                f"search_space.{name}: got type float; {name} is a whole number, "
                "use type: int or categorical"
            )
            continue
        for value in spec.values_for_bounds():
            ok, _, rule = _convert(value, hints[name], f"search_space.{name}.", [])
            if not ok:
                problems.append(f"search_space.{name}: value {value!r} must be {rule}")
                break
            trial_training = dataclasses.replace(config.training, **{name: value})
            for key, _, rule in trial_training.problems():
                if key == name:
                    problems.append(f"search_space.{name}: value {value!r} {rule}")
                    break


def _resolve_paths(config: Config, base_dir: Path, problems: list[str]) -> None:
    data = config.data
    for key in ("train_file", "eval_file"):
        if not getattr(data, key):
            continue  # reported as required by DataConfig.problems
        resolved = (base_dir / getattr(data, key)).expanduser()
        if not resolved.exists():
            problems.append(
                f"data.{key}: {getattr(data, key)!r} not found (looked for {resolved}); "
                "paths are relative to the config file"
            )
        setattr(data, key, str(resolved))
    if config.study.checkpoint_dir is not None:
        config.study.checkpoint_dir = str((base_dir / config.study.checkpoint_dir).expanduser())
    model = config.model
    for key in ("name_or_path", "tokenizer"):
        value = getattr(model, key)
        if value is not None and _looks_local(value):
            resolved = (base_dir / value).expanduser()
            if not resolved.exists():
                problems.append(
                    f"model.{key}: {value!r} not found (looked for {resolved}); "
                    "paths are relative to the config file"
                )
            setattr(model, key, str(resolved))


def _looks_local(location: str) -> bool:
    """A filesystem path rather than `pkg://...` or a hub name such as `org/model`."""
    if "://" in location:
        return False
    return location.startswith((".", "/", "~")) or location.count("/") > 1


# -- generic typed loading -------------------------------------------------------------------


def _build(
    cls: Any,
    raw: Any,
    prefix: str,
    problems: list[str],
    skip: frozenset[str] | set[str] = frozenset(),
) -> Any:
    """Instantiate dataclass `cls` from a mapping, appending every problem found to `problems`."""
    section = prefix.rstrip(".") or "the file"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{section}: got {raw!r}; must be a mapping")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in names:
            problems.append(
                f"{prefix}{key}: unknown key{_did_you_mean(str(key), names)}; "
                f"known: {', '.join(names)}"
            )
            continue
        ok, converted, rule = _convert(value, hints[key], f"{prefix}{key}.", problems)
        if ok:
            values[key] = converted
        elif rule:
            problems.append(f"{prefix}{key}: got {value!r}; must be {rule}")
    instance = cls(**values)
    # Fields that failed conversion hold their defaults here, so these rules never re-report them.
    for key, value, rule in getattr(instance, "problems", list)():
        problems.append(f"{prefix}{key}: got {value!r}; {rule}")
    return instance


def _convert(value: Any, hint: Any, prefix: str, problems: list[str]) -> tuple[bool, Any, str]:
    """Coerce `value` to the annotation `hint`; returns (ok, value, rule it broke)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return True, None, ""
        rules = []
        for option in options:
            if option is type(None):
                continue
            ok, converted, rule = _convert(value, option, prefix, problems)
            if ok:
                return True, converted, ""
            rules.append(rule)
        if type(None) in options:
            rules.append("null")
        return False, None, " or ".join(r for r in rules if r)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value in allowed:
            return True, value, ""
        return False, None, "one of " + ", ".join(str(a) for a in allowed)
    if origin is list:
        if not isinstance(value, list):
            return False, None, "a list"
        (item_hint,) = typing.get_args(hint) or (Any,)
        items = [_convert(v, item_hint, prefix, problems) for v in value]
        if all(ok for ok, _, _ in items):
            return True, [v for _, v, _ in items], ""
        return False, None, f"a list of {items[0][2] if items else 'values'}"
    if origin is dict:
        return (True, value, "") if isinstance(value, dict) else (False, None, "a mapping")
    if dataclasses.is_dataclass(hint):
        return True, _build(hint, value, prefix, problems), ""
    return _convert_scalar(value, hint)


def _convert_scalar(value: Any, hint: Any) -> tuple[bool, Any, str]:
    if hint is Any:
        return True, value, ""
    if hint is bool:
        return (True, value, "") if isinstance(value, bool) else (False, None, "true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value, ""
        if isinstance(value, float) and value.is_integer():
            return True, int(value), ""
        return False, None, "an integer"
    if hint is float:
        number = _as_float(value)
        if number is None:
            return False, None, "a number"
        return True, number, ""
    if hint is str:
        return (True, value, "") if isinstance(value, str) else (False, None, "a string")
    raise TypeError(f"unsupported config annotation {hint!r}")


def _as_float(value: Any) -> float | None:
    """Numbers and numeric strings: YAML 1.1 reads `1e-6` (no dot) as a string."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return None
    else:
        return None
    return number if math.isfinite(number) else None


def _did_you_mean(word: str, candidates: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
