"""The search space's types: one dimension (ParamSpec), the default space, and the rules on a
space as a whole (which parameters apply, in which order they are sampled, what a study records).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

DEFAULT_BATCH_CHOICES = [32, 64, 128, 256, 512]


def _doc(text: str, default: Any = None) -> Any:
    return field(default=default, metadata={"help": text})


@dataclass
class ParamSpec:
    """One dimension of the search space."""

    type: Literal["categorical", "float", "int"] = _doc("categorical, float or int.", "float")
    choices: list[Any] | None = _doc("categorical: the values to choose from.")
    low: float | None = _doc("float/int: lower bound, inclusive.")
    high: float | None = _doc("float/int: upper bound, inclusive.")
    log: bool = _doc("float/int: sample uniformly in log space.", False)
    step: float | None = _doc("float/int: discretisation step.")
    when: dict[str, Any] | None = _doc(
        "When the parameter applies: searched categorical or int parameters and the value (or "
        "list of values) each must have, e.g. {model.name_or_path: ./bert-small}; a trial where "
        "one does not hold neither samples nor shows it. null: always."
    )

    def problems(self) -> list[tuple[str, Any, str]]:
        if self.type == "categorical":
            return self._categorical_problems()
        if self.choices is not None:
            return [("choices", self.choices, f"only for type: categorical, not {self.type}")]
        if self.low is None or self.high is None:
            return [("low", self.low, f"a {self.type} parameter needs both low and high")]
        found: list[tuple[str, Any, str]] = []
        if self.low > self.high:
            found.append(("low", self.low, f"must be <= high ({self.high})"))
        if self.log and self.low <= 0:
            found.append(("low", self.low, "must be > 0 for a log-scale parameter"))
        if self.type == "int" and not all(float(v).is_integer() for v in (self.low, self.high)):
            found.append(("low", (self.low, self.high), "int bounds must be whole numbers"))
        return found + self._step_problems(self.low, self.high)

    def _categorical_problems(self) -> list[tuple[str, Any, str]]:
        if not self.choices:
            return [("choices", self.choices, "a categorical parameter needs a non-empty list")]
        ranged = {"low": self.low, "high": self.high, "step": self.step, "log": self.log or None}
        given = [key for key, value in ranged.items() if value is not None]
        if given:
            return [(given[0], ranged[given[0]], "only for type: float or int; use choices")]
        return []

    def _step_problems(self, low: float, high: float) -> list[tuple[str, Any, str]]:
        """A step Optuna cannot use fails every trial at once; refuse it before the study."""
        step = self.step
        if step is None:
            return []
        if self.log:
            return [("step", step, "cannot be combined with log: true")]
        if self.type == "int" and not (step >= 1 and float(step).is_integer()):
            return [("step", step, "must be a positive whole number for an int parameter")]
        if step <= 0:
            return [("step", step, "must be > 0")]
        if high > low and step > high - low:
            return [("step", step, f"must be <= high - low ({high - low:g}), or only low is tried")]
        ratio = (high - low) / step
        if abs(ratio - round(ratio)) > 1e-9 * max(1.0, ratio):
            # Optuna would lower high to the last step silently (with a warning per trial).
            last = low + math.floor(ratio) * step
            return [
                (
                    "step",
                    step,
                    f"high - low ({high - low:g}) is not a multiple of it, so "
                    f"high is never tried; set high: {last:g} or another step",
                )
            ]
        return []

    def values_for_bounds(self) -> list[Any]:
        """Every value the parameter can take at its extremes, for range checks."""
        if self.type == "categorical":
            return list(self.choices or [])
        return [self.low, self.high]


def space_record(space: dict[str, ParamSpec]) -> dict[str, Any]:
    """The search space as a study records it (plain JSON values), to compare with a config. A
    parameter without `when` is recorded as before conditions existed: older studies match."""
    record = {}
    for name, spec in space.items():
        fields = dataclasses.asdict(spec)
        if fields["when"] is None:
            del fields["when"]
        record[name] = fields
    return json.loads(json.dumps(record))


def has_conditions(space: dict[str, ParamSpec]) -> bool:
    """Whether some parameter of the space applies only when others have given values."""
    return any(spec.when for spec in space.values())


def applies(spec: ParamSpec, values: dict[str, Any]) -> bool:
    """Whether a parameter applies given the `values` already decided (sampled or enqueued):
    each parameter its `when` names has one of the values listed (the loader makes each a
    list); one that was not decided (itself conditional and off) does not hold."""
    return all(
        name in values and values[name] in allowed for name, allowed in (spec.when or {}).items()
    )


def sampling_order(space: dict[str, ParamSpec]) -> list[str]:
    """The parameters in an order where each comes after those its `when` names (otherwise in
    the space's order): define-by-run sampling decides the conditions first. Raises
    ValueError naming the parameters of a cycle."""
    order: list[str] = []
    visiting: list[str] = []

    def visit(name: str) -> None:
        if name in order or name not in space:
            return
        if name in visiting:
            cycle = visiting[visiting.index(name) :]
            raise ValueError(" -> ".join([*cycle, name]))
        visiting.append(name)
        for condition in space[name].when or {}:
            visit(condition)
        visiting.pop()
        order.append(name)

    for name in space:
        visit(name)
    return order


def default_search_space() -> dict[str, ParamSpec]:
    return {
        "effective_batch_size": ParamSpec(type="categorical", choices=list(DEFAULT_BATCH_CHOICES)),
        "learning_rate": ParamSpec(type="float", low=1e-6, high=1e-3, log=True),
    }
