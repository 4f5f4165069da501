"""Model soups (Wortsman et al. 2022): members fine-tuned from one base model averaged into one
model, one model's inference cost. The uniform soup averages all; the greedy soup adds members in
order of their score and keeps one only if the held-out score does not drop. LoRA adapters of
one base are averaged the same way (their adapter state dicts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpo.ensemble.errors import EnsembleError
from hpo.ensemble.scoring import is_better
from hpo.trainer.metrics import Direction

if TYPE_CHECKING:  # torch loads on first use: `hpo ensemble` from its cache runs no model
    import torch

StateDict = Mapping[str, "torch.Tensor"]


@dataclass
class GreedySoup:
    """The greedy soup: its weights, the members kept (in the order tried), and its score."""

    state_dict: dict[str, torch.Tensor]
    kept: list[str]
    score: float
    tried: dict[str, float]  # each member tried, the soup's score with it added


def check_same_shapes(state_dicts: Sequence[StateDict], names: Sequence[str]) -> None:
    """Refuse, in one line, members that are not one architecture: other keys or shapes."""
    if not state_dicts:
        raise EnsembleError("no members: a soup needs at least one member's weights")
    first = state_dicts[0]
    for name, other in zip(names[1:], state_dicts[1:], strict=True):
        missing = sorted(set(first) ^ set(other))
        if missing:
            raise EnsembleError(
                f"soup: member {name!r} and {names[0]!r} differ in the weight {missing[0]!r} "
                "(other architectures); a soup needs members fine-tuned from one base model"
            )
        for key, tensor in first.items():
            if tuple(other[key].shape) != tuple(tensor.shape):
                raise EnsembleError(
                    f"soup: weight {key!r} is {tuple(other[key].shape)} in member {name!r} and "
                    f"{tuple(tensor.shape)} in {names[0]!r}; a soup needs members fine-tuned "
                    "from one base model"
                )


def uniform_soup(
    state_dicts: Sequence[StateDict], names: Sequence[str] | None = None
) -> dict[str, torch.Tensor]:
    """The mean of the members' weights (floating tensors averaged in float32, then cast back;
    integer buffers, such as position ids, taken from the first member)."""
    import torch

    names = list(names) if names is not None else [str(i) for i in range(len(state_dicts))]
    check_same_shapes(state_dicts, names)
    soup: dict[str, torch.Tensor] = {}
    for key, tensor in state_dicts[0].items():
        if not torch.is_floating_point(tensor):
            soup[key] = tensor.detach().clone()
            continue
        total = torch.zeros_like(tensor, dtype=torch.float32, device="cpu")
        for member in state_dicts:
            total += member[key].detach().to("cpu", torch.float32)
        soup[key] = (total / len(state_dicts)).to(tensor.dtype)
    return soup


def greedy_soup(
    members: Mapping[str, StateDict],
    score: Callable[[dict[str, torch.Tensor]], float],
    direction: Direction = "maximize",
    member_scores: Mapping[str, float] | None = None,
) -> GreedySoup:
    """Wortsman's greedy soup: members in order of their own held-out score (`member_scores`,
    or `score` of each), the best first; each next one kept only if the soup's held-out score
    (`score` of the averaged weights) does not drop."""
    names = list(members)
    check_same_shapes([members[n] for n in names], names)
    own = dict(member_scores) if member_scores is not None else {}
    for name in names:
        if name not in own:
            own[name] = score(dict(members[name]))
    reverse = direction == "maximize"
    order = sorted(names, key=lambda n: own[n], reverse=reverse)
    kept = [order[0]]
    current = own[order[0]]
    soup = uniform_soup([members[order[0]]], kept)
    tried: dict[str, float] = {}
    for name in order[1:]:
        candidate = uniform_soup([members[n] for n in [*kept, name]], [*kept, name])
        value = score(candidate)
        tried[name] = value
        if value == current or is_better(value, current, direction):
            kept.append(name)
            current, soup = value, candidate
    return GreedySoup(soup, kept, current, tried)


def adapter_soup(
    adapters: Sequence[StateDict], names: Sequence[str] | None = None
) -> dict[str, torch.Tensor]:
    """LoRA adapters of one base model (same rank and target modules) averaged weight by weight:
    the uniform soup of their adapter state dicts. Averaging A and B separately is what the
    greedy soup of adapters does too (`greedy_soup` on adapter state dicts)."""
    return uniform_soup(adapters, names)
