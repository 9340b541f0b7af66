"""Token-level loss: sum here, divide once by the plan's step normaliser.

The mean token loss of a step is ``sum of token losses / step_loss_tokens`` over
all micro-batches of all ranks. Averaging per micro-batch (or per rank) instead
weights short micro-batches up; ``token_loss_sum(...) * mb.loss_scale(world_size)``
backpropagated on every micro-batch gives the exact step mean once DDP averages
gradients over ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from batchplan.runtime.collate import IGNORE_INDEX

__all__ = ["count_loss_tokens", "token_loss_sum"]


def token_loss_sum(
    logits: torch.Tensor | Any, labels: torch.Tensor | Mapping[str, Any], *, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Sum of next-token cross-entropy over the labelled tokens (Hugging Face shift).

    Args:
        logits: (batch, T, vocab) logits, or a model output that has them as
            ``.logits`` (a Hugging Face ``ModelOutput``); position ``t`` predicts
            ``labels[:, t + 1]``.
        labels: (batch, T) labels, or the collator's batch (its ``"labels"``).
        ignore_index: label value that carries no loss.

    Returns:
        A scalar: 0 (still connected to the graph) when no token has a label.

    Raises:
        TypeError: ``logits`` is neither a tensor nor has a ``.logits`` tensor.
    """
    logits = _logits_of(logits)
    tensor = labels["labels"] if isinstance(labels, Mapping) else labels
    shifted = logits[..., :-1, :]
    if shifted.dtype in (torch.float16, torch.bfloat16):
        shifted = shifted.float()
    targets = tensor[..., 1:].to(shifted.device)
    return F.cross_entropy(
        shifted.reshape(-1, shifted.shape[-1]), targets.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )


def count_loss_tokens(labels: torch.Tensor | Mapping[str, Any], *, ignore_index: int = IGNORE_INDEX) -> int:
    """Labelled tokens after the shift: equals the record's ``loss_tokens`` for a matching batch."""
    tensor = labels["labels"] if isinstance(labels, Mapping) else labels
    return int((tensor[..., 1:] != ignore_index).sum())


def _logits_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(
        f"token_loss_sum needs logits (a tensor) or a model output with .logits, got {type(output).__name__}; "
        "for a model that returns a tuple pass its logits element"
    )
