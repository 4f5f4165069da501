"""`study.budget_device_hours`, `study.price_per_device_hour` and `study.warm_start`: how much
device time a study may spend, what an hour of it costs, and which earlier studies' best
configurations it starts from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MAX_WARM_START_TOP = 100  # configurations queued per source study
DEFAULT_WIDEN = 1.5  # narrow: the top K's span widened by this factor (docs/guides/budgets.md)


def budget_problems(value: object) -> list[tuple[str, Any, str]]:
    """study.budget_device_hours (and --budget-device-hours): a finite number of hours > 0."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if value is None or (number and math.isfinite(value) and value > 0):  # type: ignore[arg-type,operator]
        return []
    return [("budget_device_hours", value, "must be a finite number of hours > 0, or null")]


def spend_problems(
    budget: object, price: object, warm_start: object, sampler: str
) -> list[tuple[str, Any, str]]:
    """The study's budget, its price per device-hour and its warm start, as study.problems
    reports them."""
    found = budget_problems(budget)
    if warm_start is not None and sampler == "grid":
        rule = "the grid sampler tries every grid point itself: leave warm_start out"
        found.append(("warm_start", "{...}", rule))
    if isinstance(price, float) and not price > 0:
        found.append(("price_per_device_hour", price, "must be > 0"))
    return found


@dataclass
class DevicePrice:
    """What one device-hour costs, for the cost `hpo status` and `hpo report` show."""

    amount: float = field(default=0.0, metadata={"help": "The price of one device-hour."})
    currency: str = field(
        default="USD", metadata={"help": "Its currency, a label shown beside every cost."}
    )

    def problems(self) -> list[tuple[str, Any, str]]:
        found: list[tuple[str, Any, str]] = []
        if not (math.isfinite(self.amount) and self.amount > 0):
            found.append(("amount", self.amount, "must be a finite number > 0"))
        if not self.currency.strip() or len(self.currency) > 12:
            found.append(("currency", self.currency, "give a short label, e.g. USD or EUR"))
        return found


@dataclass
class WarmStartSource:
    """An earlier study whose best configurations this one tries first."""

    study: str = field(default="", metadata={"help": "The earlier study's name."})
    storage: str | None = field(
        default=None,
        repr=False,  # a password in the URL must not reach a traceback
        metadata={"help": "Its database URL; default: this study's storage."},
    )

    def problems(self) -> list[tuple[str, Any, str]]:
        return [] if self.study.strip() else [("study", self.study, "give the study's name")]


@dataclass
class WarmStartConfig:
    """Start from earlier studies: their best configurations are queued first (mapped onto this
    study's search space), once per study whichever worker starts first."""

    sources: list[str | WarmStartSource] = field(
        default_factory=list,
        metadata={
            "key": "from",  # the YAML key: `from` is a Python keyword
            "help": "The earlier studies: names in this study's storage, or mappings "
            "{study: NAME, storage: URL} for a study in another database.",
        },
    )
    top: int = field(
        default=5,
        metadata={"help": "How many of each earlier study's best completed trials are queued."},
    )
    narrow: bool = field(
        default=False,
        metadata={
            "help": "Narrow each float and int range around those configurations: the span of "
            f"their values widened {DEFAULT_WIDEN}x about its middle, inside the original bounds."
        },
    )

    def problems(self) -> list[tuple[str, Any, str]]:
        found: list[tuple[str, Any, str]] = []
        if not self.sources:
            found.append(("from", self.sources, "name at least one earlier study"))
        if not 1 <= self.top <= MAX_WARM_START_TOP:
            found.append(("top", self.top, f"must be an integer from 1 to {MAX_WARM_START_TOP}"))
        return found

    def source_list(self) -> list[WarmStartSource]:
        """Every source as a WarmStartSource (a bare name: this study's storage)."""
        return [s if isinstance(s, WarmStartSource) else WarmStartSource(s) for s in self.sources]


def price_record(price: float | DevicePrice | None) -> dict[str, Any] | None:
    """study.price_per_device_hour as a study records it (a bare number is in USD)."""
    if price is None:
        return None
    if isinstance(price, DevicePrice):
        return {"amount": price.amount, "currency": price.currency.strip()}
    return {"amount": float(price), "currency": "USD"}
