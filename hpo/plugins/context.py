"""What a user's own training function (`training.entrypoint`) receives in each trial: the sampled
parameters, the device and batch split, and the calls that report, stop, save and resume.
"""

from __future__ import annotations

import io
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import optuna
import torch

from hpo.plugins.protocols import TrialLike
from hpo.trainer.batch_finder import BatchSearch, search_step
from hpo.trainer.checkpoint import CheckpointStore
from hpo.trainer.config import TrainingConfig
from hpo.trainer.loop import grad_accum_steps_for

log = logging.getLogger(__name__)

# Keys hpo adds around the user's state in a checkpoint, so that a resumed trial gets back
# exactly what it saved, and never another configuration's state.
_FINGERPRINT, _USER_STATE = "fingerprint", "user_state"


class ReportError(ValueError):
    """ctx.report was called with metrics that cannot be the trial's value."""


@dataclass
class TrainingContext:
    """Everything hpo gives a training function in one trial.

    Example::

        def train(ctx: TrainingContext) -> dict[str, float]:
            state = ctx.restore() or {"epoch": 0}
            for epoch in range(state["epoch"], 10):
                ...  # ctx.physical_batch_size examples per pass, ctx.grad_accum_steps per step
                ctx.report({"val_loss": loss}, step=epoch)  # may raise optuna.TrialPruned
                if ctx.should_stop:  # SIGTERM or the trial timeout: save and return
                    ctx.save({"epoch": epoch + 1, "model": model.state_dict()})
                    return None
            return {"val_loss": loss}
    """

    params: dict[str, Any]
    """The trial's sampled parameters, by their search-space names."""
    device: torch.device
    """Where to train: training.device resolved (auto: cuda when there is one)."""
    effective_batch_size: int
    """Examples per optimizer step: the sampled effective_batch_size, else training's."""
    trial_number: int
    """The Optuna trial's number, as in the log and `hpo status`."""
    metric: str
    """study.metric's first name: ctx.report must include it."""
    _trial: TrialLike
    _training: TrainingConfig
    _should_stop: Callable[[], bool]
    _store: CheckpointStore | None = None
    _fingerprint: str = ""
    _prunes: bool = True  # several objectives: only with study.pruner.objective
    _pruned_metric: str = ""  # the metric the pruner judges (default: `metric`)
    _physical: int | None = None
    last_metrics: dict[str, float] | None = None
    """The metrics of the latest ctx.report (the trial's value if the function returns None)."""
    batch_search: BatchSearch | None = field(default=None, repr=False)

    @property
    def physical_batch_size(self) -> int:
        """Examples per forward/backward pass: training.physical_batch_size when it is a number,
        what ctx.find_batch_size found, else the whole effective batch; never more than it."""
        configured = self._training.physical_batch_size
        size = self._physical or (configured if isinstance(configured, int) else None)
        return min(size or self.effective_batch_size, self.effective_batch_size)

    @property
    def grad_accum_steps(self) -> int:
        """Passes per optimizer step: ceil(effective / physical). The last pass of a step may be
        smaller; divide each pass's summed loss by the effective batch for exact gradients."""
        return grad_accum_steps_for(self.effective_batch_size, self.physical_batch_size)

    @property
    def should_stop(self) -> bool:
        """True once the worker asked this trial to stop (SIGTERM, Ctrl-C) or its training time
        passed study.trial_timeout: ctx.save your state and return."""
        return self._should_stop()

    def find_batch_size(self, step: Callable[[int], Any]) -> int:
        """Probe `step(batch_size)` (one full training step at that size: forward, backward,
        optimizer step) with hpo's batch finder: the largest size without an out-of-memory
        error, times training.batch_safety_margin, becomes ctx.physical_batch_size. Only an
        OOM counts as "does not fit"; any other error propagates. Raises optuna.TrialPruned
        when not even one example fits."""
        training = self._training
        upper = min(training.batch_search_max, self.effective_batch_size)
        start = min(training.batch_search_start, upper)
        search = search_step(step, self.device, start, upper, training.batch_safety_margin)
        self.batch_search = search
        if search.chosen == 0:
            reason = "oom: not even a batch of 1 fits in memory (ctx.find_batch_size)"
            self._trial.set_user_attr("prune_reason", reason)
            raise optuna.TrialPruned(reason)
        self._physical = search.chosen
        self._trial.set_user_attr("physical_batch_size", self.physical_batch_size)
        self._trial.set_user_attr("grad_accum_steps", self.grad_accum_steps)
        self._trial.set_user_attr("batch_search", [[p.size, p.fits] for p in search.probes])
        return self.physical_batch_size

    def use_physical_batch_size(self, size: int) -> None:
        """Train with `size` examples per pass (1 <= size <= the effective batch), e.g. a divisor
        of the effective batch for a loop whose passes must all be the same size (transformers'
        Trainer); ctx.grad_accum_steps follows, and both are recorded with the trial."""
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"use_physical_batch_size: size must be an integer, got {size!r}")
        if not 1 <= size <= self.effective_batch_size:
            most = self.effective_batch_size
            raise ValueError(
                f"use_physical_batch_size: size must be in [1, {most}] (the "
                f"effective batch), got {size}"
            )
        self._physical = size
        self._trial.set_user_attr("physical_batch_size", self.physical_batch_size)
        self._trial.set_user_attr("grad_accum_steps", self.grad_accum_steps)

    def report(self, metrics: dict[str, float], step: int) -> None:
        """Report an evaluation: the study.metric value goes to the study (the pruner compares
        trials at the same `step`). Raises optuna.TrialPruned when the pruner stops this trial:
        let it propagate."""
        self.last_metrics = checked_metrics(metrics, self.metric, "ctx.report")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ReportError(f"ctx.report: step must be an integer >= 0, got {step!r}")
        value = self.last_metrics[self.metric]
        send = getattr(self._trial, "send_progress", None)
        if send is not None:
            send({"step": step, "metric": (self.metric, value)})
        if not self._prunes:  # several objectives, none named to prune on
            log.info(
                "trial %d step %d: %s",
                self.trial_number,
                step,
                ", ".join(f"{k}={v:.4g}" for k, v in self.last_metrics.items()),
            )
            return
        pruned_metric = self._pruned_metric or self.metric
        if pruned_metric not in self.last_metrics:
            raise ReportError(
                f"ctx.report: no {pruned_metric!r} among the metrics given; "
                f"study.pruner.objective names it"
            )
        value = self.last_metrics[pruned_metric]
        self._trial.report(value, step)
        if self._trial.should_prune():
            reason = f"pruner: {pruned_metric}={value:.4f} at step {step}"
            self._trial.set_user_attr("prune_reason", reason)
            raise optuna.TrialPruned(reason)

    def save(self, state: dict[str, Any]) -> bool:
        """Checkpoint `state` (tensors, state_dicts, numpy arrays and scalars, numbers, strings,
        lists, tuples and dicts of them) where a retry of this trial finds it, on this host and
        (with study.artifact_store) any other; ctx.restore gives it back with the same types.
        False when the study keeps no checkpoints or the write failed (the trial goes on; trial
        attribute checkpoint_error says why). What a resume could not read back raises
        TypeError naming its key, at every call: at the first, not only at a stop."""
        storable = _storable(state, "state")
        if self._store is None:
            return False
        return self._store.save_state({_FINGERPRINT: self._fingerprint, _USER_STATE: storable})

    def restore(self) -> dict[str, Any] | None:
        """The state the last ctx.save of this trial wrote, when the trial is a retry (its
        worker was stopped or died); None on a first attempt."""
        if self._store is None:
            return None
        saved = self._store.load_state(self._fingerprint)
        if saved is None:
            return None
        state: dict[str, Any] = _from_storable(saved[_USER_STATE])
        return state


_PLAIN = (
    torch.Tensor,
    int,
    float,
    bool,
    str,
    bytes,
    type(None),
    torch.dtype,
    torch.device,
    torch.Size,
)
# A checkpoint is read with torch.load(weights_only=True), which refuses numpy's pickled
# objects: a numpy array or scalar is saved as the bytes of its own .npy format instead, in a
# dict under this key, and turned back into what was saved by ctx.restore.
_NUMPY_ARRAY, _NUMPY_SCALAR = "__hpo_numpy_array__", "__hpo_numpy_scalar__"
_MAX_DEPTH = 50


def _storable(value: Any, where: str, depth: int = 0) -> Any:
    """`value` with every numpy array and scalar in it replaced by its .npy bytes (containers
    without one are returned as they are: a state_dict keeps its metadata); raises TypeError
    naming the path in the state (state['rng']) of anything a resume could not read."""
    if depth > _MAX_DEPTH:
        raise _refused(f"{where} is nested more than {_MAX_DEPTH} levels deep")
    if isinstance(value, dict):
        return _storable_dict(value, where, depth)
    if type(value) in (list, tuple):  # a namedtuple's class would be refused on resume
        items = [_storable(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]
        same = all(new is old for new, old in zip(items, value, strict=True))
        return value if same else type(value)(items)
    if isinstance(value, (np.ndarray, np.generic)):  # first: np.float64 is a float too
        key = _NUMPY_SCALAR if isinstance(value, np.generic) else _NUMPY_ARRAY
        return {key: _npy_bytes(np.asarray(value), where)}
    if isinstance(value, _PLAIN):
        return value
    kind = type(value)
    raise _refused(
        f"{where} is {kind.__module__}.{kind.__qualname__}, which a resume could not read"
    )


def _storable_dict(value: dict[Any, Any], where: str, depth: int) -> dict[Any, Any]:
    changed = {}
    for key, item in value.items():
        if not isinstance(key, (str, int)):
            raise _refused(
                f"{where} has the key {key!r} ({type(key).__name__}); keys are str or int"
            )
        if key in (_NUMPY_ARRAY, _NUMPY_SCALAR):
            raise _refused(f"{where} has the key {key!r}, which hpo keeps for numpy values")
        stored = _storable(item, f"{where}[{key!r}]", depth + 1)
        if stored is not item:
            changed[key] = stored
    if not changed:
        return value
    rebuilt = {key: changed.get(key, item) for key, item in value.items()}
    return OrderedDict(rebuilt) if isinstance(value, OrderedDict) else rebuilt


def _npy_bytes(array: np.ndarray, where: str) -> bytes:
    buffer = io.BytesIO()
    try:
        np.save(buffer, array, allow_pickle=False)
    except ValueError as e:  # an object array: Python objects, not numbers
        raise _refused(
            f"{where} is a numpy array of dtype {array.dtype}, which a resume could not read"
        ) from e
    return buffer.getvalue()


def _refused(what: str) -> TypeError:
    return TypeError(
        f"ctx.save: {what}; save tensors, numpy arrays of numbers, numbers, strings, "
        "and lists, tuples and dicts of them"
    )


def _from_storable(value: Any) -> Any:
    """What _storable saved, with the numpy arrays and scalars back."""
    if isinstance(value, dict):
        if len(value) == 1 and _NUMPY_ARRAY in value:
            return np.load(io.BytesIO(value[_NUMPY_ARRAY]), allow_pickle=False)
        if len(value) == 1 and _NUMPY_SCALAR in value:
            return np.load(io.BytesIO(value[_NUMPY_SCALAR]), allow_pickle=False)[()]
        restored = {key: _from_storable(item) for key, item in value.items()}
        if all(restored[key] is item for key, item in value.items()):
            return value
        return type(value)(restored) if type(value) in (dict, OrderedDict) else restored
    if type(value) in (list, tuple):
        items = [_from_storable(item) for item in value]
        same = all(new is old for new, old in zip(items, value, strict=True))
        return value if same else type(value)(items)
    return value


def checked_metrics(metrics: Any, metric: str, where: str) -> dict[str, float]:
    """`metrics` as names to finite-or-not floats; raises ReportError naming what was given
    when it is no dict of numbers or lacks study.metric."""
    if not isinstance(metrics, dict):
        raise ReportError(
            f"{where}: expected a dict of metric names to numbers (with "
            f"{metric!r}), got {type(metrics).__name__}"
        )
    if metric not in metrics:
        given = ", ".join(map(str, metrics)) or "none"
        raise ReportError(
            f"{where}: no {metric!r} among the metrics given ({given}); "
            f"study.metric names {metric!r}"
        )
    checked: dict[str, float] = {}
    for name, value in metrics.items():
        number = number_of(value)
        if number is None:
            raise ReportError(
                f"{where}: metric {name!r} is {type(value).__name__} {value!r}; expected a number"
            )
        checked[str(name)] = number
    return checked


def number_of(value: Any) -> float | None:
    """A float of a Python number, a numpy scalar or a one-element tensor or array; None
    for anything else (a bool, text, a numpy string)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, (int, float)):
        return float(value)
    numeric = getattr(getattr(value, "dtype", None), "kind", "") in ("i", "u", "f")
    if numeric and getattr(value, "size", None) == 1:  # a numpy scalar or one-element array
        return float(value)
    return None
