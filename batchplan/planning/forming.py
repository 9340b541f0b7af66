"""Form an epoch's micro-batches: pack (shuffle within lengths, best-fit decreasing) or
pad (shuffle, sort in windows, cut); stage by stage for a sequence-length warmup; and
price them with the cost model."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig
from batchplan.kernels.pack import most_bins
from batchplan.kernels.pad import cut_padded
from batchplan.plan import Entries, PackingBound, index_dtype
from batchplan.planning.bins import PackedBins, count_by_group
from batchplan.planning.buffers import new_buffer
from batchplan.planning.cutting_stock import pack_histogram
from batchplan.planning.epoch_batches import EpochBatches
from batchplan.planning.randomness import KeyStream, permute
from batchplan.planning.warmup import SeqlenWarmup

__all__ = ["compute_costs", "concatenate_parts", "form_micro_batches", "form_warmup_micro_batches"]


def form_micro_batches(
    lengths: NDArray[np.integer], config: PlanConfig, rng: np.random.Generator, threads: int = 1
) -> EpochBatches:
    """Micro-batches over entries ``0..len(lengths)-1`` (members index ``lengths``); the
    shuffles run on ``threads`` threads (the same result for any number). Packing runs on the
    length histogram (`batchplan.planning.cutting_stock.pack_histogram`, near its lower
    bound, recorded as ``packing``); the seeded shuffle within each length decides which
    entry takes each place, so packs differ between epochs. That shuffle is drawn only when
    members are laid out (`batchplan.planning.bins`): forming holds the bin of each slot,
    4 bytes per entry below 2^31 entries."""
    count = lengths.shape[0]
    if config.mode == "pack":
        # The kernels' memory grows with the capacity; a capacity above all the tokens
        # packs exactly as the total does (one bin holds everything either way).
        capacity = int(min(config.max_tokens, lengths.sum(dtype=np.int64)))
        # The seeded order among entries of one length: drawn when members are laid out.
        keys = KeyStream.draw_later(rng, count)
        start = np.zeros(capacity + 2, dtype=np.int64)
        np.cumsum(count_by_group(lengths, capacity + 1, threads).sum(axis=0), out=start[1:])
        histogram = np.diff(start)[: capacity + 1]
        # Best fit's arrays, sized for the most bins it can open (`batchplan.planning.buffers`);
        # the bins' offsets and tokens are int32 where they fit (held until members are laid out).
        bound = most_bins(histogram, capacity)
        index = index_dtype(count)
        buffers = (
            new_buffer(count, index),
            np.zeros(bound + 1, dtype=index),
            new_buffer(bound, index),
            new_buffer(bound, index),
        )
        packed = pack_histogram(histogram, capacity, buffers=buffers)
        del buffers
        bins = PackedBins(lengths, start, keys, packed.slot_bin, packed.offsets, packed.tokens, capacity)
        batches = EpochBatches.of_bins(bins)
        tokens = int(packed.tokens.sum())
        batches.packing = PackingBound(batches.count, tokens, packed.bound.bins, packed.bound.kind)
        return batches
    else:
        # The shuffle carries each entry's length along: the cut then reads them in order.
        members = np.empty(count, dtype=index_dtype(count))
        member_lengths = np.empty(count, dtype=np.int32)
        permute(rng, members, values=lengths, carried=member_lengths, threads=threads)
        offsets = cut_padded(members, member_lengths, config.shuffle_window, config.max_tokens, config.batch_multiple)
    return EpochBatches.of_ranges(members, member_lengths, offsets[:-1], offsets[1:])


def form_warmup_micro_batches(
    entries: Entries, config: PlanConfig, warmup: SeqlenWarmup, rng, stage_rng, threads: int = 1
):
    """Epoch 0 with a sequence-length warmup: each stage's pieces form micro-batches on
    their own, stage after stage (shuffled within a stage), then the rest of the epoch.

    Returns the micro-batches and how many come from the stages (their order is kept).
    ``stage_rng`` drives the stages, ``rng`` the rest.
    """
    parts = []
    for stage in range(warmup.num_stages):
        first, end = int(warmup.stage_offsets[stage]), int(warmup.stage_offsets[stage + 1])
        if end > first:
            formed = form_micro_batches(entries.length[first:end], config, stage_rng, threads)
            parts.append((formed, first + np.arange(end - first, dtype=np.int64), stage_rng.permutation(formed.count)))
    ordered = sum(part[0].count for part in parts)
    if warmup.rest.size:
        formed = form_micro_batches(entries.length[warmup.rest], config, rng, threads)
        parts.append((formed, warmup.rest, np.arange(formed.count)))
    return concatenate_parts(parts, entries.num_entries), ordered


def concatenate_parts(parts, num_entries: int) -> EpochBatches:
    """One `EpochBatches` of ``(batches, entry_ids, order)`` parts: each part's micro-batches
    in ``order``, their members mapped from part-local positions to ``entry_ids``."""
    members, lengths, starts, ends = [], [], [], []
    base = 0
    for batches, ids, order in parts:
        members.append(ids[batches.members].astype(index_dtype(num_entries)))
        lengths.append(batches.lengths)
        starts.append(base + batches.starts[order])
        ends.append(base + batches.ends[order])
        base += batches.members.shape[0]
    joined = EpochBatches.of_ranges(
        np.concatenate(members), np.concatenate(lengths), np.concatenate(starts), np.concatenate(ends)
    )
    packings = [batches.packing for batches, _, _ in parts]
    if packings and None not in packings:
        joined.packing = sum(packings[1:], packings[0])
    return joined


def compute_costs(batches: EpochBatches, mode: str, coefficient: float) -> NDArray[np.float64]:
    """Predicted compute per micro-batch, in tokens: `batchplan.planning.cost` with the model's
    attention ``coefficient`` (`PlanConfig.cost_coefficient`)."""
    if mode == "pack":
        return batches.length_sums(lambda lengths: lengths + coefficient * lengths**2)
    # Pad: count x (longest + c longest^2).
    count = batches.ends - batches.starts
    longest = batches.longest().astype(np.float64)
    return count * (longest + coefficient * longest**2)
