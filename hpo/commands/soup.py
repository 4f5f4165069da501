"""`hpo ensemble --soup uniform|greedy`: the members' weights averaged into one model (one
model's inference cost), when they share one base architecture. The greedy soup is chosen on the
evaluation split; each soup is scored on the test split when there is one, else on the
evaluation split (said so: the greedy soup's score there is optimistic).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpo.errors import HPOError

if TYPE_CHECKING:
    import numpy as np
    import torch


@dataclass
class SoupResult:
    """The soup built (None when the members cannot be souped), its score and how measured."""

    kind: str
    score: float | None
    measured_on: str
    kept: list[str] = field(default_factory=list)
    state_dict: dict[str, torch.Tensor] | None = None
    base: Path | None = None
    note: str | None = None


@dataclass
class Rows:
    """A split's rows and labels, as the members read them."""

    rows: Sequence[dict[str, Any]]
    labels: np.ndarray


def build_soup(
    kind: str,
    members: dict[str, Path],
    task: str,
    metric: str,
    order: list[str],
    evaluation: Rows,
    test: Rows | None,
    device: str,
    batch_size: int,
) -> SoupResult:
    """The uniform or greedy soup of `members`; a note instead when they are not one
    architecture (or are LoRA adapters, not souped here yet)."""
    from hpo.ensemble import EnsembleError, greedy_soup, uniform_soup
    from hpo.ensemble.scoring import direction_of
    from trainer.device import resolve_device
    from trainer.inference import Predictor
    from trainer.peft_adapters import is_adapter_folder

    measured = "test_split" if test is not None else "evaluation_split"
    if any(is_adapter_folder(f) for f in members.values()):
        return SoupResult(
            kind, None, measured, note="soup: LoRA adapter members are not souped yet"
        )
    base = next(iter(members.values()))
    predictor = Predictor(base, resolve_device(device, "--device"), batch_size)
    states = {
        name: _state_dict(folder, predictor.settings.task) for name, folder in members.items()
    }

    def scored(state: dict[str, torch.Tensor], split: Rows) -> float:
        return _score(predictor, state, split, task, metric, order)

    try:
        if kind == "uniform":
            names = list(states)
            soup = uniform_soup([states[n] for n in names], names)
            kept = names
        else:
            found = greedy_soup(states, lambda s: scored(s, evaluation), direction_of(task, metric))
            soup, kept = found.state_dict, found.kept
    except EnsembleError as e:
        return SoupResult(kind, None, measured, note=str(e))
    value = scored(soup, test if test is not None else evaluation)
    return SoupResult(kind, value, measured, kept, soup, base)


def _state_dict(folder: Path, task: str) -> dict[str, torch.Tensor]:
    from trainer.inference import load_model

    return {k: v.detach().cpu() for k, v in load_model(folder, task).state_dict().items()}


def _score(
    predictor: Any,
    state: dict[str, torch.Tensor],
    split: Rows,
    task: str,
    metric: str,
    order: list[str],
) -> float:
    from hpo.commands.predict import answers_array, predict_rows
    from hpo.ensemble.scoring import score

    predictor.model.load_state_dict(state)
    answers = list(predict_rows(predictor, split.rows))
    return score(task, metric, answers_array(answers, task, order), split.labels)


def save_soup(result: SoupResult, out: Path, staging: Path) -> Path:
    """The soup as a plain model folder: the first member's folder, its weights replaced."""
    from trainer.inference import load_model, read_settings

    if result.state_dict is None or result.base is None:
        raise HPOError("no soup to save")
    folder = staging / "soup"
    shutil.copytree(result.base, folder)
    for weights in [*folder.glob("*.safetensors"), *folder.glob("*.bin")]:
        weights.unlink()
    model: Any = load_model(result.base, read_settings(result.base).task)
    model.load_state_dict(result.state_dict)
    model.save_pretrained(folder)
    return folder
