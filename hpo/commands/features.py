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

    from hpo.trainer.batching import collate, eval_batches

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


def row_words(row: dict[str, Any], column: str) -> list[str]:
    """A tagger's row as words: a JSONL list, or a CSV text split at spaces."""
    value = row.get(column)
    return value.split() if isinstance(value, str) else list(value or [])


def word_probabilities(
    predictor: Any, rows: Sequence[dict[str, Any]], order: Sequence[str], first_row: int = 1
) -> np.ndarray:
    """A tagger's tag probabilities per word ([all rows' words, tags], tags in `order`): each
    word's first sub-token's, as training scored it; uniform for the words max_length cut off."""
    import numpy as np

    from hpo.trainer.data import flat_split

    words = predictor._words(rows, first_row)
    encoded = predictor.tokenizer(
        words, is_split_into_words=True, truncation=True, max_length=predictor.max_length
    )
    split = flat_split(encoded["input_ids"], encoded.get("token_type_ids"))
    index = [predictor.labels.index(name) for name in order]
    column = predictor.settings.text_column
    out = []
    for i, logits in enumerate(predictor._logits(split)):
        probabilities = np.full((len(row_words(rows[i], column)), len(order)), 1.0 / len(order))
        previous = None
        for position, word in enumerate(encoded.word_ids(i)):
            if word is not None and word != previous:
                shifted = np.exp(logits[position] - np.max(logits[position]))
                probabilities[word] = (shifted / shifted.sum())[index]
            previous = word
        out.append(probabilities)
    return np.concatenate(out) if out else np.zeros((0, len(order)))
