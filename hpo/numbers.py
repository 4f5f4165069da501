"""How hpo shows a number or a trial's parameters to a person: four significant digits (0.8734,
3.2e-05), not the 16 digits a float holds. Machine-readable output (--json) keeps every digit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SIGNIFICANT_DIGITS = 4


def number_text(value: Any) -> str:
    """A float with four significant digits (a learning rate reads 3.2e-05, an accuracy
    0.8734); anything else (an integer, a category, None) as it is."""
    if isinstance(value, float):
        return f"{value:.{SIGNIFICANT_DIGITS}g}"
    return str(value)


def params_text(params: Mapping[str, Any]) -> str:
    """`learning_rate=3.2e-05, effective_batch_size=32, warmup_ratio=0.1`."""
    return ", ".join(f"{name}={number_text(value)}" for name, value in params.items())


def metric_text(name: str | None, value: Any) -> str:
    """A metric's value with its name, `accuracy 0.8734`; the bare value when the study names
    no metric (a study plain Optuna made)."""
    shown = number_text(value)
    return f"{name} {shown}" if name else shown
