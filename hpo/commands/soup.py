"""`hpo ensemble --soup uniform|greedy`: the members' weights averaged into one model (one
model's inference cost), when they share one base architecture; LoRA adapters of one base model
have their adapter weights (and the head each trained) averaged, and the soup is an adapter.
The greedy soup is chosen on the evaluation split; each soup is scored on the test split when
there is one, else on the evaluation split (said so: the greedy soup's score there is
optimistic). Whether the soup is saved is decided on the evaluation split, never the test split.
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
    adapter: bool = False  # the state dict is a LoRA adapter's (on `base`'s base model)
    # On the evaluation split, where whether to save the soup is decided (`score` when there
    # is no test split).
    evaluation_score: float | None = None


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
    architecture (or LoRA adapters of other base models, or adapters mixed with whole models)."""
    from hpo.ensemble import EnsembleError, greedy_soup, uniform_soup
    from hpo.ensemble.scoring import direction_of
    from hpo.trainer.device import resolve_device
    from hpo.trainer.inference import Predictor

    measured = "test_split" if test is not None else "evaluation_split"
    refused = _not_souped(members)
    if refused is not None:
        return SoupResult(kind, None, measured, note=refused)
    adapter = _is_adapter(next(iter(members.values())))
    base = next(iter(members.values()))
    predictor = Predictor(base, resolve_device(device, "--device"), batch_size)
    if adapter:  # the adapter kept apart from its base: each candidate's weights load into it
        from hpo.trainer.inference import load_model

        task_name = predictor.settings.task
        predictor.model = load_model(base, task_name, merge=False).to(predictor.device).eval()
    states = {name: _weights(folder, predictor.settings.task) for name, folder in members.items()}

    def scored(state: dict[str, torch.Tensor], split: Rows) -> float:
        return _score(predictor, state, split, task, metric, order)

    on_evaluation = None
    try:
        if kind == "uniform":
            names = list(states)
            soup = uniform_soup([states[n] for n in names], names)
            kept = names
        else:
            found = greedy_soup(states, lambda s: scored(s, evaluation), direction_of(task, metric))
            soup, kept, on_evaluation = found.state_dict, found.kept, found.score
    except EnsembleError as e:
        return SoupResult(kind, None, measured, note=str(e))
    value = scored(soup, test if test is not None else evaluation)
    if test is None:
        on_evaluation = value
    elif on_evaluation is None:  # the uniform soup: one more pass, over the evaluation rows
        on_evaluation = scored(soup, evaluation)
    return SoupResult(
        kind, value, measured, kept, soup, base, adapter=adapter, evaluation_score=on_evaluation
    )


def _is_adapter(folder: Path) -> bool:
    from hpo.trainer.peft_adapters import is_adapter_folder

    return is_adapter_folder(folder)


def _not_souped(members: dict[str, Path]) -> str | None:
    """Why `members` make no soup: adapters mixed with whole models, or adapters of other base
    models; None when they may (their weights' shapes are checked when averaged)."""
    import json

    from hpo.trainer.peft_adapters import ADAPTER_CONFIG

    adapters = [name for name, folder in members.items() if _is_adapter(folder)]
    if not adapters:
        return None
    if len(adapters) < len(members):
        whole = next(name for name in members if name not in adapters)
        return (
            f"soup: member {adapters[0]!r} is a LoRA adapter and {whole!r} a whole model; a "
            "soup averages members of one kind"
        )
    bases = {
        name: str(json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path"))
        for name, folder in members.items()
    }
    first = next(iter(bases))
    other = next((n for n in bases if bases[n] != bases[first]), None)
    if other is not None:
        return (
            f"soup: the LoRA adapters of {first!r} and {other!r} are on other base models "
            f"({bases[first]}, {bases[other]}); a soup needs adapters of one base model"
        )
    return None


def _weights(folder: Path, task: str) -> dict[str, torch.Tensor]:
    """A member's weights to average: its whole state dict, or a LoRA adapter's own weights
    (and its head's), as peft saved them."""
    if _is_adapter(folder):
        from peft.utils import load_peft_weights

        return {k: v.detach().cpu() for k, v in load_peft_weights(str(folder)).items()}
    from hpo.trainer.inference import load_model

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
    from hpo.trainer.peft_adapters import load_trained_state

    load_trained_state(predictor.model, state)  # a peft model: the adapter's weights
    answers = list(predict_rows(predictor, split.rows))
    return score(task, metric, answers_array(answers, task, order), split.labels)


def save_soup(result: SoupResult, out: Path, staging: Path) -> Path:
    """The soup as a plain model folder (an adapter folder for adapters): the first member's
    folder, its weights replaced."""
    from hpo.trainer.inference import load_model, read_settings

    if result.state_dict is None or result.base is None:
        raise HPOError("no soup to save")
    folder = staging / "soup"
    shutil.copytree(result.base, folder)
    if result.adapter:
        from safetensors.torch import save_file

        from hpo.trainer.inference import ADAPTER_WEIGHTS

        for name in ADAPTER_WEIGHTS:
            (folder / name).unlink(missing_ok=True)
        state = {k: v.contiguous() for k, v in result.state_dict.items()}
        save_file(state, folder / ADAPTER_WEIGHTS[0], metadata={"format": "pt"})
        return folder
    for weights in [*folder.glob("*.safetensors"), *folder.glob("*.bin")]:
        weights.unlink()
    model: Any = load_model(result.base, read_settings(result.base).task)
    model.load_state_dict(result.state_dict)
    model.save_pretrained(folder)
    return folder
