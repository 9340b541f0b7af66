"""Predicted compute of a micro-batch, in token units: linear term + attention term.

A decoder layer of width ``h`` costs about ``24 h^2`` FLOPs per token in its matrix
products (QKV 6h^2, output 2h^2, a 4h MLP 16h^2; 2 FLOPs per multiply-add) and
``4 h L^2`` FLOPs for the attention scores and values of a sequence of length ``L``,
half of which a causal kernel skips. Dividing by ``24 h^2``:

    cost(sample of length L) = L + L^2 / (12 h)        (causal attention)

so ``attention_coefficient(h) = 1 / (12 h)``: at h = 4096 a sample of 8,192 tokens
costs 1.17x its length, 32 samples of 256 tokens cost 1.005x. A packed micro-batch
costs the sum over its samples (varlen attention stays within each sample); a
padded one computes ``count x longest`` tokens and ``count x longest^2`` attention.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from batchplan.reduce import segment_max, segment_sum

__all__ = ["attention_coefficient", "micro_batch_costs"]


def attention_coefficient(hidden_size: int) -> float:
    """Attention term per squared token, relative to one token's linear cost (causal)."""
    if hidden_size < 1:
        raise ValueError(f"hidden_size must be >= 1, got {hidden_size}")
    return 1.0 / (12.0 * hidden_size)


def micro_batch_costs(
    entry_lengths: NDArray[np.integer],
    offsets: NDArray[np.integer],
    mode: str,
    coefficient: float,
) -> NDArray[np.float64]:
    """Cost of each micro-batch ``entry_lengths[offsets[k]:offsets[k + 1]]``.

    Args:
        entry_lengths: tokens of each entry, micro-batch after micro-batch.
        offsets: CSR offsets into ``entry_lengths``.
        mode: ``"pack"`` (sum over samples) or ``"pad"`` (count x longest).
        coefficient: `attention_coefficient` of the model.
    """
    lengths = np.asarray(entry_lengths, dtype=np.float64)
    if mode == "pad":
        longest = segment_max(lengths, offsets)
        return np.diff(offsets) * (longest + coefficient * longest**2)
    return segment_sum(lengths + coefficient * lengths**2, offsets)
