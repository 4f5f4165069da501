"""A task plug-in: hpo's sequence classification with the focal loss (Lin et al. 2017) in place
of cross-entropy. Everything else (how rows become tensors, the head, the metrics and their
directions) is inherited. Named in config.yaml as `task: focal:FocalLoss`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpo import SequenceClassification


class FocalLoss(SequenceClassification):
    """Cross-entropy down-weighted by (1 - p)^gamma on examples the model already gets right,
    so that training dwells on the hard ones."""

    gamma = 2.0

    def loss_sum(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        class_weights: torch.Tensor | None = None,
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        # Summed over the batch's examples, as every task's loss_sum: hpo divides by the
        # examples of the whole optimizer step, so accumulated micro-batches stay exact.
        log_p = F.log_softmax(logits.float(), dim=-1).gather(1, labels[:, None])[:, 0]
        focal = -((1 - log_p.exp()) ** self.gamma) * log_p
        if class_weights is not None:
            focal = focal * class_weights[labels]
        return focal.sum()
