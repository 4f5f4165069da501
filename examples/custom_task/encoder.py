"""A model factory: a small Transformer encoder in plain PyTorch (no transformers class), built
for the labels and tokenizer hpo hands over. Named in config.yaml as `model.factory:
encoder:build`; hpo saves its best weights as a state_dict (see HPO_MODEL.md beside them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hpo import ModelRequest


class Encoder(nn.Module):
    def __init__(self, vocab_size: int, max_length: int, num_labels: int, dropout: float) -> None:
        super().__init__()
        width = 64
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(max_length, width)
        layer = nn.TransformerEncoderLayer(
            width, nhead=2, dim_feedforward=128, dropout=dropout, batch_first=True
        )
        self.layers = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, num_labels)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_: Any
    ) -> dict[str, torch.Tensor]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.tokens(input_ids) + self.positions(positions)
        hidden = self.layers(hidden, src_key_padding_mask=attention_mask == 0)
        mask = attention_mask[..., None].to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)  # the mean of real tokens
        return {"logits": self.head(pooled)}  # hpo's task computes the loss from the logits


def build(request: ModelRequest) -> Encoder:
    """The model for one trial: model.dropout is the trial's (searched in config.yaml)."""
    dropout = request.model.dropout if request.model.dropout is not None else 0.1
    return Encoder(request.vocab_size, request.max_length, request.num_labels, dropout)
