"""`--features embedding`: a member's mean-pooled last hidden state per row (the EnStack way),
what the meta-learner reads instead of the members' probabilities; for `hpo ensemble` and for
a saved ensemble that was built on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


def member_embeddings(
    predictor: Any, rows: Sequence[dict[str, Any]], first_row: int = 1
) -> np.ndarray:
    """[rows, hidden]: the mean of the last hidden state over each row's tokens, in row order."""
    import numpy as np
    import torch

    from trainer.batching import collate, eval_batches

    split = predictor._encode(rows, first_row)
    split.labels = np.zeros(len(split), dtype=np.int64)  # collate carries a label column
    out: list[np.ndarray] = [np.empty(0)] * len(split)
    with torch.inference_mode():
        for indices in eval_batches(split.lengths, predictor.batch_size):
            batch = collate(split, indices, predictor.pad_id)
            batch.pop("labels")
            inputs = {k: v.to(predictor.device) for k, v in batch.items()}
            hidden = predictor.model(**inputs, output_hidden_states=True).hidden_states[-1]
            mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
            for position, index in enumerate(indices):
                out[int(index)] = pooled[position].float().cpu().numpy()
    return np.stack(out) if out else np.zeros((0, 0))


def stacked_embeddings(embeddings: dict[str, np.ndarray], members: Sequence[str]) -> np.ndarray:
    """The members' embeddings side by side, in `members`' order."""
    import numpy as np

    return np.concatenate([np.asarray(embeddings[name]) for name in members], axis=1)
