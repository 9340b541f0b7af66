"""Micro-batches of an epoch: formed by packing or padding, held as (start, end) ranges.

`form_micro_batches` runs the pack kernels (shuffle within lengths, best-fit decreasing)
or the pad kernel (sort in windows, cut); `form_warmup_micro_batches` does the same
stage by stage for a sequence-length warmup; `compute_costs` prices each micro-batch
with the cost model. The planner (`batchplan.planner`) schedules the result.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig
from batchplan.entries import Entries, index_dtype
from batchplan.kernels.pack import pack_grouped
from batchplan.kernels.pad import cut_padded
from batchplan.kernels.segments import range_sums
from batchplan.kernels.shuffle import shuffle_by_length
from batchplan.warmup import SeqlenWarmup

__all__ = ["MicroBatches", "compute_costs", "form_micro_batches", "form_warmup_micro_batches"]


@dataclasses.dataclass
class MicroBatches:
    """Micro-batches of an epoch: micro-batch ``k`` holds entries ``members[starts[k]:ends[k]]``,
    whose lengths are ``lengths[starts[k]:ends[k]]`` (kept beside the members so that sums
    read memory in order instead of gathering lengths at random).

    Start/end pairs (not offsets) let the last chunk split a micro-batch in place,
    and let the final (rank, step, micro) order be gathered in one pass.
    """

    members: NDArray[np.integer]
    lengths: NDArray[np.int32]
    starts: NDArray[np.int64]
    ends: NDArray[np.int64]

    @property
    def count(self) -> int:
        return int(self.starts.shape[0])

    def range_sums(self, values: NDArray) -> NDArray:
        """Sum of ``values[starts[k]:ends[k]]`` (values aligned with members) for each k:
        exact int64 for integers; floats range by range, so no range carries the rounding
        of the whole epoch."""
        if np.issubdtype(values.dtype, np.floating):
            return range_sums(values.astype(np.float64, copy=False), self.starts, self.ends)
        total = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(values, dtype=np.int64)])
        return total[self.ends] - total[self.starts]

    def tokens(self) -> NDArray[np.int64]:
        return self.range_sums(self.lengths)

    def longest(self) -> NDArray[np.int64]:
        """Pad mode: length of each micro-batch's first entry, its longest (windows are
        cut longest first, and splitting keeps prefixes and suffixes); 0 when empty."""
        first = np.minimum(self.starts, self.lengths.shape[0] - 1)
        return np.where(self.ends > self.starts, self.lengths[first], 0).astype(np.int64)

    def extend(self, pairs: NDArray[np.int64]) -> NDArray[np.int64]:
        """Add micro-batches ``members[start:end]`` for each row of ``pairs``; return their ids."""
        first = self.count
        self.starts = np.concatenate([self.starts, pairs[:, 0]])
        self.ends = np.concatenate([self.ends, pairs[:, 1]])
        return np.arange(first, self.count, dtype=np.int64)


def form_micro_batches(lengths: NDArray[np.int32], config: PlanConfig, rng: np.random.Generator) -> MicroBatches:
    """Micro-batches over entries ``0..len(lengths)-1`` (members index ``lengths``)."""
    count = lengths.shape[0]
    index = np.empty(0, dtype=index_dtype(count))
    if config.mode == "pack":
        # The kernels' memory grows with the capacity; a capacity above all the tokens
        # packs exactly as the total does (one bin holds everything either way).
        capacity = int(min(config.max_tokens, lengths.sum(dtype=np.int64)))
        keys = rng.integers(0, 2**32, size=count, dtype=np.uint32)
        items, start = shuffle_by_length(lengths, keys, capacity, index)
        del keys  # 4 bytes per entry, no longer needed while packing
        offsets, members, batch_lengths = pack_grouped(items, start, capacity)
        del items
    else:
        order = rng.permutation(count).astype(index.dtype)
        offsets, members, batch_lengths = cut_padded(
            lengths, order, config.shuffle_window, config.max_tokens, config.batch_multiple
        )
    return MicroBatches(members, batch_lengths, offsets[:-1].copy(), offsets[1:].copy())


def form_warmup_micro_batches(entries: Entries, config: PlanConfig, warmup: SeqlenWarmup, rng, stage_rng):
    """Epoch 0 with a sequence-length warmup: each stage's pieces form micro-batches on
    their own, stage after stage (shuffled within a stage), then the rest of the epoch.

    Returns the micro-batches and how many come from the stages (their order is kept).
    ``stage_rng`` drives the stages, ``rng`` the rest.
    """
    parts = []
    for stage in range(warmup.num_stages):
        first, end = int(warmup.stage_offsets[stage]), int(warmup.stage_offsets[stage + 1])
        if end > first:
            formed = form_micro_batches(entries.length[first:end], config, stage_rng)
            parts.append((formed, first + np.arange(end - first, dtype=np.int64), stage_rng.permutation(formed.count)))
    ordered = sum(part[0].count for part in parts)
    if warmup.rest.size:
        formed = form_micro_batches(entries.length[warmup.rest], config, rng)
        parts.append((formed, warmup.rest, np.arange(formed.count)))
    return _concatenate(parts, entries.num_entries), ordered


def _concatenate(parts, num_entries: int) -> MicroBatches:
    """One `MicroBatches` of ``(batches, entry_ids, order)`` parts: each part's micro-batches
    in ``order``, their members mapped from part-local positions to ``entry_ids``."""
    members, lengths, starts, ends = [], [], [], []
    base = 0
    for batches, ids, order in parts:
        members.append(ids[batches.members].astype(index_dtype(num_entries)))
        lengths.append(batches.lengths)
        starts.append(base + batches.starts[order])
        ends.append(base + batches.ends[order])
        base += batches.members.shape[0]
    return MicroBatches(np.concatenate(members), np.concatenate(lengths), np.concatenate(starts), np.concatenate(ends))


def compute_costs(batches: MicroBatches, config: PlanConfig) -> NDArray[np.float64]:
    """Predicted compute per micro-batch, in tokens: `batchplan.cost` for the model width."""
    coefficient = config.cost_coefficient
    if config.mode == "pack":
        lengths = batches.lengths.astype(np.float64)
        return batches.range_sums(lengths + coefficient * lengths**2)
    # Pad: count x (longest + c longest^2).
    count = batches.ends - batches.starts
    longest = batches.longest().astype(np.float64)
    return count * (longest + coefficient * longest**2)
