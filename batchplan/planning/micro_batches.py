"""Micro-batches of an epoch: formed by packing or padding, held as (start, end) ranges.

`form_micro_batches` runs the pack kernels (shuffle within lengths, best-fit decreasing)
or the pad kernel (sort in windows, cut); `form_warmup_micro_batches` does the same
stage by stage for a sequence-length warmup; `compute_costs` prices each micro-batch
with the cost model. The planner (`batchplan.planning.epochs`) schedules the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig
from batchplan.plan import Entries, index_dtype
from batchplan.kernels.pack import (
    bin_destinations,
    bin_item_sums,
    bin_length_sums,
    bin_members,
    fill_bins,
    most_bins,
    pack_bins,
    scatter_bins,
)
from batchplan.kernels.pad import cut_padded
from batchplan.kernels.segments import lay_out_segments, range_sums
from batchplan.kernels.shuffle import count_groups, scatter_groups, shuffle_groups
from batchplan.planning.threads import run_in_parts
from batchplan.planning.warmup import SeqlenWarmup

__all__ = [
    "MicroBatches", "PackedBins", "compute_costs", "form_micro_batches", "form_warmup_micro_batches", "permute",
    "shuffle_by_group",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PackedBins:
    """Best-fit decreasing's bins before their members are laid out (`batchplan.kernels.pack`).

    Bin ``b`` holds positions ``offsets[b]:offsets[b + 1]`` of the member space (its members
    longest first). Members are only materialised in bin order when something needs them
    all (`members`); a plan lays them out straight in row order (`MicroBatches.gather`,
    with `scatter_bins`), one pass instead of filling the bins and then gathering them.
    """

    items: NDArray[np.integer]
    start: NDArray[np.int64]
    slot_bin: NDArray[np.integer]
    offsets: NDArray[np.int64]
    tokens: NDArray[np.int64]
    capacity: int

    @property
    def num_bins(self) -> int:
        return int(self.tokens.shape[0])

    def members(self) -> tuple[NDArray[np.integer], NDArray[np.int32]]:
        """The whole member space: ``(members, lengths)``."""
        return fill_bins(self.items, self.start, self.slot_bin, self.offsets, self.capacity)

    def ranges(self, starts: NDArray[np.int64], ends: NDArray[np.int64]) -> list[tuple[NDArray, NDArray]]:
        """``(members, lengths)`` of a few ranges of member space, each inside one bin."""
        nonempty = ends > starts
        bins = np.searchsorted(self.offsets, starts[nonempty], side="right") - 1
        wanted = np.unique(bins)
        local, members, lengths = bin_members(
            self.items, self.start, self.slot_bin, self.offsets, wanted, self.capacity
        )
        out = [(members[:0], lengths[:0])] * starts.shape[0]
        for i, target in zip(np.flatnonzero(nonempty), bins):
            base = local[np.searchsorted(wanted, target)] - self.offsets[target]
            out[i] = (members[base + starts[i] : base + ends[i]], lengths[base + starts[i] : base + ends[i]])
        return out

    def length_sums(self, table: NDArray[np.float64]) -> NDArray[np.float64]:
        """Per bin, ``sum(table[length])`` over its members."""
        return bin_length_sums(table, self.start, self.slot_bin, self.num_bins, self.capacity)

    def item_sums(self, values: NDArray[np.integer]) -> NDArray[np.int64]:
        """Per bin, ``sum(values[member])``."""
        return bin_item_sums(values, self.items, self.start, self.slot_bin, self.num_bins, self.capacity)


class MicroBatches:
    """Micro-batches of an epoch: micro-batch ``k`` holds entries ``members[starts[k]:ends[k]]``,
    whose lengths are ``lengths[starts[k]:ends[k]]`` (kept beside the members so that sums
    read memory in order instead of gathering lengths at random).

    Start/end pairs (not offsets) let the last chunk split a micro-batch in place,
    and let the final (rank, step, micro) order be gathered in one pass.

    Packed micro-batches come as `PackedBins` (micro-batch ``k < num_bins`` is bin ``k``;
    later ones are pieces of bins, or empty), and ``members``/``lengths`` are made only
    when asked for: the hot path (`tokens`, `entry_sums`, `length_sums`, `gather`) never
    needs them.
    """

    def __init__(
        self,
        members: NDArray[np.integer] | None,
        lengths: NDArray[np.int32] | None,
        starts: NDArray[np.int64],
        ends: NDArray[np.int64],
        *,
        packed: PackedBins | None = None,
    ) -> None:
        if (members is None) != (packed is not None):
            raise ValueError("give either members and lengths, or packed bins")
        self._members, self._lengths = members, lengths
        self.packed = packed
        # The micro-batches as formed, then the few `extend` adds (kept apart: no copy of the many).
        self._base = (starts, ends)
        self._base_tokens = None if packed is None else packed.tokens
        self._extra = np.zeros((0, 3), dtype=np.int64)  # rows (start, end, tokens)
        self._joined_cache: tuple[NDArray[np.int64], NDArray[np.int64]] | None = None

    @classmethod
    def of_bins(cls, packed: PackedBins) -> MicroBatches:
        """Micro-batch ``k`` = bin ``k``."""
        return cls(None, None, packed.offsets[:-1], packed.offsets[1:], packed=packed)

    @property
    def starts(self) -> NDArray[np.int64]:
        return self._joined_bounds()[0]

    @property
    def ends(self) -> NDArray[np.int64]:
        return self._joined_bounds()[1]

    def _joined_bounds(self) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Starts and ends of all micro-batches, joined once per `extend`."""
        if self._joined_cache is None:
            self._joined_cache = (
                self._joined(self._base[0], self._extra[:, 0]), self._joined(self._base[1], self._extra[:, 1])
            )
        return self._joined_cache

    def bounds(self, which: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """``(starts, ends)`` of a few micro-batches (without joining all of them)."""
        which = np.asarray(which, dtype=np.int64)
        formed = which < self._base[0].shape[0]
        starts, ends = np.empty(which.shape, dtype=np.int64), np.empty(which.shape, dtype=np.int64)
        starts[formed], ends[formed] = self._base[0][which[formed]], self._base[1][which[formed]]
        added = which[~formed] - self._base[0].shape[0]
        starts[~formed], ends[~formed] = self._extra[added, 0], self._extra[added, 1]
        return starts, ends

    @staticmethod
    def _joined(base: NDArray[np.int64], extra: NDArray[np.int64]) -> NDArray[np.int64]:
        return np.concatenate([base, extra]) if extra.shape[0] else base

    @property
    def members(self) -> NDArray[np.integer]:
        self._materialise()
        return self._members

    @property
    def lengths(self) -> NDArray[np.int32]:
        self._materialise()
        return self._lengths

    def _materialise(self) -> None:
        if self._members is None:
            self._members, self._lengths = self.packed.members()

    @property
    def count(self) -> int:
        return int(self._base[0].shape[0] + self._extra.shape[0])

    @property
    def _lazy(self) -> bool:
        return self._members is None

    def range_sums(self, values: NDArray) -> NDArray:
        """Sum of ``values[starts[k]:ends[k]]`` (values aligned with members) for each k:
        exact int64 for integers; floats range by range, so no range carries the rounding
        of the whole epoch."""
        total = np.zeros(self.count, dtype=np.float64 if np.issubdtype(values.dtype, np.floating) else np.int64)
        return range_sums(values, self.starts, self.ends, total)

    def tokens(self) -> NDArray[np.int64]:
        """Tokens of each micro-batch."""
        return self._joined(self._formed_tokens(), self._extra[:, 2])

    def _formed_tokens(self) -> NDArray[np.int64]:
        """Tokens of the micro-batches as formed (before `extend`), summed once."""
        if self._base_tokens is None:
            starts, ends = self._base
            self._base_tokens = range_sums(self.lengths, starts, ends, np.zeros(starts.shape[0], dtype=np.int64))
        return self._base_tokens

    def token_table(self) -> NDArray[np.int64]:
        """Shape (count, 2): tokens and entries of each micro-batch, side by side (one cache
        line per micro-batch for kernels that read them at random)."""
        (starts, ends), formed = self._base, self._base[0].shape[0]
        table = np.empty((self.count, 2), dtype=np.int64)
        table[:formed, 0] = self._formed_tokens()
        np.subtract(ends, starts, out=table[:formed, 1])
        table[formed:, 0] = self._extra[:, 2]
        table[formed:, 1] = self._extra[:, 1] - self._extra[:, 0]
        return table

    def length_sums(self, value: Callable[[NDArray[np.float64]], NDArray[np.float64]]) -> NDArray[np.float64]:
        """``sum(value(length))`` over each micro-batch's entries (float64, range by range);
        ``value`` works elementwise on float64 lengths."""
        if self._lazy:
            table = value(np.arange(self.packed.capacity + 1, dtype=np.float64))
            return self._with_pieces(self.packed.length_sums(table), lambda _, lengths: _float_sum(table[lengths]))
        return self.range_sums(value(self.lengths.astype(np.float64)))

    def entry_sums(self, values: NDArray[np.integer]) -> NDArray[np.int64]:
        """``sum(values[entry])`` over each micro-batch's entries (int64)."""
        if self._lazy:
            per_bin = self.packed.item_sums(values)
            return self._with_pieces(per_bin, lambda members, _: values[members].sum(dtype=np.int64))
        return self.range_sums(values[self.members])

    def _with_pieces(self, per_bin: NDArray, reduce: Callable[[NDArray, NDArray], float | int]) -> NDArray:
        """Per-bin values for the bins, then ``reduce(members, lengths)`` for the later pieces."""
        bins = self.packed.num_bins
        if self.count == bins:
            return per_bin
        pieces = self.ranges(np.arange(bins, self.count))
        return np.concatenate([per_bin, np.array([reduce(*piece) for piece in pieces], dtype=per_bin.dtype)])

    def ranges(self, which: NDArray[np.int64]) -> list[tuple[NDArray, NDArray]]:
        """``(members, lengths)`` of a few micro-batches."""
        starts, ends = self.bounds(which)
        if self._lazy:
            return self.packed.ranges(starts, ends)
        return [(self.members[s:e], self.lengths[s:e]) for s, e in zip(starts, ends)]

    def members_of(self, which: NDArray[np.int64]) -> NDArray[np.int64]:
        """The entries of the given micro-batches, concatenated (int64)."""
        parts = [members for members, _ in self.ranges(which)]
        return np.concatenate([np.zeros(0, dtype=np.int64), *parts]).astype(np.int64)

    def longest(self) -> NDArray[np.int64]:
        """Pad mode: length of each micro-batch's first entry, its longest (windows are
        cut longest first, and splitting keeps prefixes and suffixes); 0 when empty."""
        first = np.minimum(self.starts, self.lengths.shape[0] - 1)
        return np.where(self.ends > self.starts, self.lengths[first], 0).astype(np.int64)

    def extend(self, pairs: NDArray[np.int64], tokens: NDArray[np.int64]) -> NDArray[np.int64]:
        """Add micro-batches ``members[start:end]`` for each row of ``pairs``, of ``tokens``
        tokens each; return their ids."""
        first = self.count
        rows = np.column_stack([pairs.reshape(-1, 2), tokens]).astype(np.int64)
        self._extra = np.concatenate([self._extra, rows])
        self._joined_cache = None
        return np.arange(first, self.count, dtype=np.int64)

    def gather(
        self, order: NDArray[np.integer], sizes: NDArray[np.int64], threads: int = 1, scratch: NDArray | None = None
    ) -> tuple[NDArray[np.int64], NDArray]:
        """Members of micro-batches ``order`` one after another, in CSR form ``(offsets, members)``;
        ``sizes`` are their entry counts. ``order`` names each micro-batch at most once, and
        no bin both whole and in pieces (what the planner makes: pieces only replace bins).
        Packed bins are laid out on ``threads`` threads (the same result for any number).
        ``scratch``: an int64 array free to overwrite, used for the per-micro-batch
        destinations when long enough (memory already faulted in costs less than new)."""
        if not self._lazy:
            destination = _scratch_or_new(scratch, self.count)
            members = np.empty(int(sizes.sum()), dtype=self.members.dtype)
            offsets, written = lay_out_segments(self.members, self.starts, self.ends, order, destination, members)
            _check_written(written, members)
            return offsets, members
        packed = self.packed
        offsets = np.empty(order.shape[0] + 1, dtype=np.int64)
        destination = _scratch_or_new(scratch, packed.num_bins)
        destination.fill(-1)
        run_in_parts(bin_destinations, threads, order, sizes, offsets, destination)
        pieces = np.flatnonzero(order >= packed.num_bins)
        pieces = pieces[sizes[pieces] > 0]
        piece_starts, piece_ends = self.bounds(order[pieces])
        by_start = np.argsort(piece_starts, kind="stable")
        members = np.empty(offsets[-1], dtype=packed.items.dtype)  # numpy: huge pages for the scattered writes
        written = run_in_parts(
            scatter_bins, threads,
            packed.items, packed.start, packed.slot_bin, packed.offsets, destination, piece_starts[by_start],
            piece_ends[by_start], offsets[pieces][by_start], packed.capacity, members,
        )  # fmt: skip
        _check_written(sum(written), members)
        return offsets, members


def _scratch_or_new(scratch: NDArray | None, count: int) -> NDArray[np.int64]:
    """``count`` int64 of ``scratch`` if it has them, else a new array (numpy: huge pages for
    the scattered writes)."""
    if scratch is not None and scratch.dtype == np.int64 and scratch.shape[0] >= count:
        return scratch[:count]
    return np.empty(count, dtype=np.int64)


def _check_written(written: int, members: NDArray) -> None:
    if written != members.shape[0]:
        raise AssertionError(f"laid out {written:,} of {members.shape[0]:,} members: overlapping micro-batches")


def _float_sum(values: NDArray[np.float64]) -> float:
    """Left-to-right float sum, as the kernels add."""
    total = 0.0
    for value in values.tolist():
        total += value
    return total


def form_micro_batches(
    lengths: NDArray[np.int32], config: PlanConfig, rng: np.random.Generator, threads: int = 1
) -> MicroBatches:
    """Micro-batches over entries ``0..len(lengths)-1`` (members index ``lengths``); the
    shuffles run on ``threads`` threads (the same result for any number)."""
    count = lengths.shape[0]
    if config.mode == "pack":
        # The kernels' memory grows with the capacity; a capacity above all the tokens
        # packs exactly as the total does (one bin holds everything either way).
        capacity = int(min(config.max_tokens, lengths.sum(dtype=np.int64)))
        keys = rng.integers(0, 2**32, size=count, dtype=np.uint32)
        items = np.empty(count, dtype=index_dtype(count))
        start = shuffle_by_group(lengths, capacity + 1, keys, items, threads=threads)
        del keys  # 4 bytes per entry, no longer needed while packing
        # numpy makes best fit's big arrays: huge pages, fewer faults than numba's own (pages
        # past the bins actually opened are never touched, so never resident).
        bound = most_bins(np.diff(start)[: capacity + 1], capacity)
        buffers = (np.empty(count, dtype=items.dtype), np.zeros(bound + 1, dtype=np.int64),
                   np.empty(bound, dtype=items.dtype), np.empty(bound, dtype=np.int64))  # fmt: skip
        slot_bin, offsets, tokens = pack_bins(items, start, capacity, *buffers)
        return MicroBatches.of_bins(PackedBins(items, start, slot_bin, offsets, tokens, capacity))
    else:
        # The shuffle carries each entry's length along: the cut then reads them in order.
        members = np.empty(count, dtype=index_dtype(count))
        member_lengths = np.empty(count, dtype=np.int32)
        permute(rng, members, values=lengths, carried=member_lengths, threads=threads)
        offsets = cut_padded(members, member_lengths, config.shuffle_window, config.max_tokens, config.batch_multiple)
    return MicroBatches(members, member_lengths, offsets[:-1], offsets[1:])


def permute(
    rng: np.random.Generator, out: NDArray[np.integer], first: int = 0, *, values=None, carried=None, threads: int = 1
) -> None:
    """Fill ``out`` with ``first +`` a uniformly random permutation of ``0..len(out) - 1``;
    with ``values``, fill ``carried`` with ``values[out - first]`` along the way.

    Items go to random groups of ~16,000, then are shuffled inside each group
    (`shuffle_by_group`): every swap stays in cache, ~4x faster than ``rng.permutation``
    at 10^7 items, and 6 bytes of random draws per item. The same result on any number
    of ``threads``.
    """
    count = out.shape[0]
    num_groups = 1 << min(max(count >> 14, 1).bit_length() - 1, 16)  # a power of two, <= 2^16
    groups = rng.integers(0, num_groups, size=count, dtype=np.uint16)
    keys = rng.integers(0, 2**32, size=count, dtype=np.uint32)
    shuffle_by_group(groups, num_groups, keys, out, first, values, carried, threads=threads)


def shuffle_by_group(
    groups: NDArray[np.integer],
    num_groups: int,
    keys: NDArray[np.uint32],
    items: NDArray[np.integer],
    first: int = 0,
    values: NDArray | None = None,
    carried: NDArray | None = None,
    *,
    threads: int = 1,
) -> NDArray[np.int64]:
    """Items ordered by group (group 0 first), randomly ordered within each group
    (`batchplan.kernels.shuffle`), on ``threads`` threads with the same result.

    Args:
        groups: group of each item, each in ``0..num_groups - 1`` (any integer dtype).
        num_groups: the number of groups.
        keys: uint32 random bits, one per position.
        items: int32 or int64, one per item, filled with ``first +`` the item indices.
        first: added to every item index written.
        values, carried: optional; ``carried[i]`` is filled with ``values[item]`` of the
            item at position ``i``.

    Returns:
        ``start``: the items of group ``g`` are at ``items[start[g]:start[g + 1]]``.
    """
    count = groups.shape[0]
    # The kernels do not check bounds: a wrong size or dtype here writes outside the arrays.
    if keys.shape[0] != count or items.shape[0] != count or (carried is not None and carried.shape[0] != count):
        raise ValueError(f"groups, keys, items (and carried) must have one entry per item: {count:,} groups, "
                         f"{keys.shape[0]:,} keys, {items.shape[0]:,} items")  # fmt: skip
    if (values is None) != (carried is None) or (values is not None and values.shape[0] != count):
        raise ValueError("give values and carried together, one value per item")
    # Per-part counts cost parts x num_groups: split only when the items far outnumber the
    # groups (so those arrays stay small), and run any threads < 1 as one part, as
    # run_in_parts does. One part (groups up to the capacity in pack mode, which may be
    # large) needs only the counts, turned into cursors in place, and the offsets.
    threads = max(1, threads)
    parts = threads if count >= 16 * num_groups * threads else 1
    counts = np.zeros((parts, num_groups), dtype=np.int64)
    run_in_parts(count_groups, parts, groups, counts)
    start = np.zeros(num_groups + 1, dtype=np.int64)
    np.cumsum(counts[0] if parts == 1 else counts.sum(axis=0), out=start[1:])
    if parts == 1:
        cursors = counts
        cursors[0] = start[:-1]
    else:  # each part writes a group's items after those of the parts before it: the one-part order
        cursors = start[:-1] + np.cumsum(counts, axis=0) - counts
    run_in_parts(scatter_groups, parts, groups, cursors, items, first, values, carried)
    run_in_parts(shuffle_groups, parts, start, keys, items, carried)
    return start


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
    """Predicted compute per micro-batch, in tokens: `batchplan.planning.cost` for the model width."""
    coefficient = config.cost_coefficient
    if config.mode == "pack":
        return batches.length_sums(lambda lengths: lengths + coefficient * lengths**2)
    # Pad: count x (longest + c longest^2).
    count = batches.ends - batches.starts
    longest = batches.longest().astype(np.float64)
    return count * (longest + coefficient * longest**2)
