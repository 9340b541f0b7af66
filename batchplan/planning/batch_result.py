"""What `batchplan.plan_batch` returns: one batch's micro-batches on every rank, with their sums.

`BatchPlan` holds every rank's micro-batches as one CSR array of sample indices (``samples``,
``offsets``) and their tokens, loss tokens and costs; `RankMicroBatches` is the
``ranks[r][m]`` view of it that training code reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = ["BatchPlan", "RankMicroBatches"]


class RankMicroBatches(Sequence):
    """``view[r][m]``: rank ``r``'s micro-batch ``m``, a view of ``values`` (rank after rank,
    micro-batch after micro-batch, bounded by ``offsets``); a rank's list is made when asked
    for, so a process that reads its own rank pays for ``num_micro`` views, not the batch's."""

    def __init__(self, values: NDArray, offsets: NDArray[np.int64], world_size: int, num_micro: int) -> None:
        self._values = values
        self._offsets = offsets
        self._world_size = world_size
        self._num_micro = num_micro

    def __len__(self) -> int:
        return self._world_size

    def __getitem__(self, rank):
        if isinstance(rank, slice):
            return [self[r] for r in range(*rank.indices(len(self)))]
        count = len(self)
        if not -count <= rank < count:
            raise IndexError(f"rank {rank} is outside 0..{count - 1}")
        first = (rank % count) * self._num_micro
        bounds = self._offsets[first : first + self._num_micro + 1].tolist()
        return [self._values[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """One batch's micro-batches on every rank.

    Attributes:
        samples: int64 sample indices of every micro-batch, rank after rank, micro-batch
            after micro-batch, in the order to concatenate them.
        offsets: int64, ``world_size x num_micro + 1``: rank ``r``'s micro-batch ``m`` is
            ``samples[offsets[r * num_micro + m]:offsets[r * num_micro + m + 1]]``.
        spans: with ``oversize="split"``, an (entries, 2) int64 array beside ``samples``:
            each entry's ``(start, length)`` within its sample (whether or not a sample was
            split); None otherwise.
        tokens, loss_tokens: int64, shape (world_size, num_micro): per micro-batch.
        costs: float64, shape (world_size, num_micro): predicted compute per micro-batch.
        rank_costs: float64, shape (world_size,): each rank's predicted compute.
        step_tokens: tokens of the whole batch.
        step_loss_tokens: loss tokens of the whole batch, all ranks: the exact normaliser of
            a token-mean loss (each rank divides its loss sum by it; gradients are summed).
        num_micro: micro-batches per rank.
        balance: the busiest rank's cost / the ranks' mean (1.0 for an empty batch).
        balance_bound: no plan of these samples and groups has a lower ``balance``.
    """

    samples: NDArray[np.int64]
    offsets: NDArray[np.int64]
    spans: NDArray[np.int64] | None
    tokens: NDArray[np.int64]
    loss_tokens: NDArray[np.int64]
    costs: NDArray[np.float64]
    rank_costs: NDArray[np.float64]
    step_tokens: int
    step_loss_tokens: int
    num_micro: int
    balance: float
    balance_bound: float

    @property
    def world_size(self) -> int:
        return self.tokens.shape[0]

    def loss_scale(self) -> float:
        """Factor turning a micro-batch's loss *sum* into its share of the batch's token mean
        once DDP/FSDP average gradients over the ranks: ``world_size / step_loss_tokens``
        (``world_size`` when the batch has no loss tokens, so a zero loss stays finite)."""
        return self.world_size / max(self.step_loss_tokens, 1)

    @property
    def ranks(self) -> RankMicroBatches:
        """``ranks[r]``: rank ``r``'s micro-batches in order, each a 1-D int64 array of samples."""
        return RankMicroBatches(self.samples, self.offsets, self.world_size, self.num_micro)

    @property
    def rank_spans(self) -> RankMicroBatches | None:
        """``rank_spans[r][m]``: the ``(start, length)`` rows of ``ranks[r][m]`` (None without split)."""
        return (
            None if self.spans is None else RankMicroBatches(self.spans, self.offsets, self.world_size, self.num_micro)
        )
