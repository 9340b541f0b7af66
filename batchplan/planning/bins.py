"""Packed micro-batches before their entries are laid out: best-fit decreasing's bins, with
the methods of a `batchplan.planning.epoch_batches` layout.

Best fit decreasing packs the length histogram: it places slots (a length in a bin), and
the k-th slot of length ``s`` takes the k-th entry of length ``s`` in a seeded order (the
entries of each length shuffled with ``keys``). That order is never held: the bins keep
the bin of each slot and the entries' lengths, and laying members out
(`batchplan.kernels.bin_layout`) turns the bins into each slot's place, undoes the
shuffle on the places, and writes every entry to its place in one pass over the entries.
The planner's final layout does the first two in place (`PackedBins.lay_out`): the bins are
overwritten, and the epoch keeps the places (one index per entry), from which a writer lays the
members out a window at a time (`PendingMembers`): the peak holds one index per entry once,
and a window of members.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from batchplan.kernels.bin_layout import bin_lengths, place_slots, scatter_entries
from batchplan.kernels.pack import bin_destinations, bin_length_sums
from batchplan.kernels.segments import range_sums
from batchplan.kernels.shuffle import count_groups
from batchplan.plan import Members, index_dtype
from batchplan.planning.buffers import new_buffer
from batchplan.planning.destinations import Destinations, check_written
from batchplan.planning.randomness import KeyStream, unshuffle_by_group
from batchplan.planning.slot_runs import SlotRuns
from batchplan.planning.threads import run_in_parts

__all__ = [
    "MEMBERS_AT_ONCE",
    "COMPRESS_FROM_ENTRIES",
    "PackedBins",
    "PendingMembers",
    "Placed",
    "bin_destinations_of",
    "count_by_group",
    "left_to_right_sum",
]


class PackedBins:
    """Best-fit decreasing's bins before their members are laid out (`batchplan.kernels.pack`).

    Entry ``i`` (``0..len(lengths) - 1``) has length ``lengths[i]``; ``start`` offsets the
    entries by length (length ``s``: positions ``start[s]:start[s + 1]`` of the length order),
    and ``keys`` shuffles each length's entries (`batchplan.kernels.shuffle.shuffle_groups`).
    Bin ``b`` holds positions ``offsets[b]:offsets[b + 1]`` of the member space (its members
    longest first). `lay_out` uses the bins up; every other method leaves them as they are.
    """

    def __init__(self, lengths, start, keys: KeyStream, slot_bin, offsets, tokens, capacity: int) -> None:
        self.lengths: NDArray[np.integer] = lengths
        self.start: NDArray[np.int64] = start
        self.keys = keys
        self._slot_bin: NDArray[np.integer] | None = slot_bin
        self.offsets: NDArray[np.integer] = offsets
        self.tokens: NDArray[np.integer] = tokens
        self.capacity = capacity
        self._runs: SlotRuns | None = None  # the bin of each slot while compressed (`compress`)

    @property
    def slot_bin(self) -> NDArray[np.integer]:
        """The bin of each slot (decoded again after `compress`)."""
        if self._runs is not None:
            self._slot_bin, self._runs = self._runs.decode(), None
        if self._slot_bin is None:
            raise ValueError("the bins were overwritten")
        return self._slot_bin

    def compress(self, threads: int = 1) -> None:
        """Keep the bin of each slot run-length encoded (`SlotRuns`: 0.7 bytes per slot
        against 4) until it is needed again: large epochs (`COMPRESS_FROM_ENTRIES`) compress it
        while they are scheduled, so the schedule's arrays never share the peak with it.
        A smaller epoch keeps it as it is (encoding and decoding cost two passes)."""
        if self._slot_bin is not None and self.lengths.shape[0] >= COMPRESS_FROM_ENTRIES:
            self._runs, self._slot_bin = SlotRuns.encode(self._slot_bin, threads), None

    @property
    def num_bins(self) -> int:
        return int(self.tokens.shape[0])

    # The micro-batches as formed are the bins; `EpochBatches` hands those added later (pieces
    # of bins, empty ones; ids from ``num_bins`` on) to the methods below as ``extra``.
    num_formed = num_bins

    @property
    def starts(self) -> NDArray[np.integer]:
        return self.offsets[:-1]

    @property
    def ends(self) -> NDArray[np.integer]:
        return self.offsets[1:]

    def members(self, in_place: bool = False) -> tuple[NDArray[np.integer], NDArray[np.int32]]:
        """The whole member space, bin after bin: ``(members, lengths)``; with ``in_place``, the
        places are written over the bins' slots (the bins are not used again)."""
        slot_bin = self.slot_bin
        places = slot_bin if in_place else self._new_places()
        if in_place:
            self._slot_bin = None
        places = self._places(slot_bin, self.offsets[:-1].astype(np.int64), _no_pieces(), places)
        del slot_bin
        members = new_buffer(places.shape[0], places.dtype)
        self._write_entries(places, None, members, 1)
        return members, self.lengths[members].astype(np.int32, copy=False)

    def ranges(self, starts: NDArray[np.int64], ends: NDArray[np.int64]) -> list[tuple[NDArray, NDArray]]:
        """``(members, lengths)`` of a few ranges of member space, each inside one bin."""
        wanted, bins, local = self._wanted_bins(starts, ends)
        members = np.empty(int(local[-1]), dtype=self.slot_bin.dtype)
        if members.shape[0]:
            destination = np.full(self.num_bins, -1, dtype=np.int64)
            destination[wanted] = local[:-1]
            places = self._places(self.slot_bin, destination, _no_pieces(), self._new_places())
            self._write_entries(places, None, members, 1)
        lengths = self.lengths[members].astype(np.int32, copy=False)
        return self._cut(starts, ends, wanted, bins, local, members, lengths)

    def range_members(self, starts: NDArray[np.int64], ends: NDArray[np.int64]) -> list[NDArray]:
        """Members of a few ranges of member space, each inside one bin."""
        return [members for members, _ in self.ranges(starts, ends)]

    def free_lengths(self) -> None:
        """Nothing to free: the lengths read are the entries' own."""

    def range_lengths(self, starts: NDArray[np.int64], ends: NDArray[np.int64]) -> list[NDArray[np.int32]]:
        """Member lengths of a few ranges of member space, each inside one bin (no entry is looked up)."""
        wanted, bins, _ = self._wanted_bins(starts, ends)
        local, lengths = bin_lengths(self.start, self.slot_bin, self.offsets, wanted, self.capacity)
        return [part for _, part in self._cut(starts, ends, wanted, bins, local, lengths, lengths)]

    def _wanted_bins(self, starts, ends):
        """The bins the non-empty ranges lie in: sorted unique ids, each range's bin, and their CSR offsets."""
        bins = np.searchsorted(self.offsets, starts[ends > starts], side="right") - 1
        wanted = np.unique(bins)
        local = np.zeros(wanted.shape[0] + 1, dtype=np.int64)
        np.cumsum(np.diff(self.offsets)[wanted], out=local[1:])
        return wanted, bins, local

    def _cut(self, starts, ends, wanted, bins, local, members, lengths) -> list[tuple[NDArray, NDArray]]:
        out = [(members[:0], lengths[:0])] * starts.shape[0]
        for i, target in zip(np.flatnonzero(ends > starts), bins):
            base = local[np.searchsorted(wanted, target)] - self.offsets[target]
            out[i] = (members[base + starts[i] : base + ends[i]], lengths[base + starts[i] : base + ends[i]])
        return out

    def formed_tokens(self) -> NDArray[np.integer]:
        return self.tokens

    def length_sums(self, value: Callable, extra: NDArray[np.int64]) -> NDArray[np.float64]:
        """Per micro-batch, ``sum(value(length))`` over its entries: per bin from a table of
        ``value`` over 0..capacity, then the pieces the last round split off (``extra``)."""
        table = value(np.arange(self.capacity + 1, dtype=np.float64))
        per_bin = bin_length_sums(table, self.start, self.slot_bin, self.num_bins, self.capacity)
        if not extra.shape[0]:
            return per_bin
        pieces = self.range_lengths(extra[:, 0], extra[:, 1])
        return np.concatenate([per_bin, np.array([left_to_right_sum(table[lengths]) for lengths in pieces])])

    def entry_sums(self, values: NDArray[np.integer], extra: NDArray[np.int64]) -> NDArray[np.int64]:
        """Per micro-batch, ``sum(values[entry])`` over its entries: ``values`` laid out in member
        space (as members would be), then summed range by range."""
        places = self._places(self.slot_bin, self.offsets[:-1].astype(np.int64), _no_pieces(), self._new_places())
        laid = new_buffer(self.slot_bin.shape[0], values.dtype)
        self._write_entries(places, values, laid, 1)
        del places
        starts, ends = self.starts, self.ends
        if extra.shape[0]:
            starts, ends = np.concatenate([starts, extra[:, 0]]), np.concatenate([ends, extra[:, 1]])
        return range_sums(laid, starts, ends, np.zeros(starts.shape[0], dtype=np.int64))

    def gather(self, extra, order, sizes, threads: int, scratch) -> tuple[NDArray[np.int64], NDArray]:
        """`EpochBatches.gather`, leaving the bins as they are."""
        where = self.destinations(extra, order, sizes, threads)
        members = new_buffer(where.count, self.slot_bin.dtype)
        check_written(self.write_members(where, members, threads), members)
        return where.offsets, members

    def write_members(self, where: Destinations, out: NDArray, threads: int, base: int = 0) -> int:
        """Write the members at ``where`` into ``out`` (entry ``i`` as ``base + i``), leaving the
        bins as they are; returns how many were written."""
        places = self._places(self.slot_bin, where.take_destination(), where.ranges, self._new_places())
        return scatter_to_places(self.lengths, self._unshuffle(places, threads), places, None, out, 0, base)

    def destinations(self, extra: NDArray[np.int64], order, sizes, threads: int) -> Destinations:
        """Where micro-batches ``order`` (of ``sizes`` entries) go when laid out one after another
        (`bin_destinations_of`)."""
        return bin_destinations_of(int(self.offsets[-1]), self.num_bins, extra, order, sizes, threads)

    def lay_out(self, where: Destinations, threads: int) -> PendingMembers:
        """The members at ``where``, to be laid out a window at a time (`PendingMembers`),
        overwriting the bins: each slot's place is written over its bin, the bins' arrays (and
        ``where``'s per-bin one) are freed, and the shuffle is undone on the places. The
        micro-batches must hold no view of the bins (`EpochBatches.lay_out` frees them first)."""
        return PendingMembers([self.placed(where, threads)], where.count)

    def placed(self, where: Destinations, threads: int, base: int = 0) -> Placed:
        """Each slot's place at ``where``, the bins overwritten (`lay_out`); entry ``i`` is ``base + i``."""
        slot_bin = self.slot_bin
        self._slot_bin = None
        del self.tokens
        places = self._places(slot_bin, where.take_destination(), where.ranges, slot_bin)
        del slot_bin, self.offsets
        return Placed(self.lengths, places, self._unshuffle(places, threads), base)

    def _new_places(self) -> NDArray:
        return new_buffer(self.slot_bin.shape[0], self.slot_bin.dtype)

    def _places(self, slot_bin, destination, pieces, places) -> NDArray:
        """Each slot's place (`batchplan.kernels.bin_layout.place_slots`), in ``places`` (may be ``slot_bin``);
        ``pieces``: the pieces' ``(starts, ends, destinations)`` (`Destinations.ranges`)."""
        piece_starts, piece_ends, piece_destination = pieces
        place_slots(slot_bin, self.offsets, destination, piece_starts, piece_ends, piece_destination, places)
        return places

    def _write_entries(self, places, values, out, threads: int) -> int:
        """The shuffle undone on ``places``, then each entry (or its value) written to its place."""
        return scatter_to_places(self.lengths, self._unshuffle(places, threads), places, values, out, 0)

    def _unshuffle(self, places, threads: int) -> NDArray[np.int64]:
        """The shuffle undone on ``places``; returns the cursors (per part of the entries, as
        `count_by_group` splits them for ``threads``) that `scatter_to_places` starts from."""
        total = self.start[-1]
        block = total - self.start[1:]  # slots are placed longest first: length s's slots from here
        unshuffle_by_group(self.keys, self.start, block, places, threads=threads)
        counts = count_by_group(self.lengths, self.capacity + 1, threads)
        return block + np.cumsum(counts, axis=0) - counts


class PendingMembers(Members):
    """An epoch's members in row order, laid out a window at a time from each slot's place
    (`PackedBins.lay_out`): a window of `members_at_once` (or the range asked, if
    longer) is laid out by one pass over the entries and kept until a range outside it, or
    the last member, is asked for. A writer asking for ranks in order makes one pass per
    window; the peak holds the places and one window, not every member. `all` lays every
    member out once, keeps them, and lets the places go.

    The entries come as one or more `Placed` streams (the parts of an epoch packed part by
    part, `batchplan.planning.parted_bins`), each writing its entries' ids to their places."""

    def __init__(self, streams: list[Placed], count: int, dtype: np.dtype | None = None) -> None:
        # Members' methods are all overridden: the array is laid out only when `all` asks.
        self._all: NDArray | None = None
        self._streams, self._count = streams, count
        self._dtype = np.dtype(dtype or streams[0].places.dtype)
        self._window = (0, np.zeros(0, dtype=self._dtype))  # (first, members)

    @property
    def count(self) -> int:
        return self._count

    def between(self, start: int, stop: int) -> NDArray:
        if self._all is not None:
            return self._all[start:stop]
        start, stop = min(start, self._count), min(stop, self._count)  # as a slice of the array would
        if not 0 <= start <= stop:
            raise ValueError(f"members {start:,}:{stop:,} asked of {self._count:,}")
        first, window = self._window
        if not (first <= start and stop <= first + window.shape[0]):
            self._window = first, window = start, self._lay_out(start, max(stop, start + members_at_once(self._count)))
        if stop == self._count:  # read to the end: the window is freed (a reader may hold this view)
            self._window = (0, window[:0])
        return window[start - first : stop - first]

    def all(self) -> NDArray:
        if self._all is None:
            self._window = (0, self._window[1][:0])
            self._all = self._lay_out(0, self._count)
            self._streams = []
        return self._all

    def _lay_out(self, start: int, stop: int) -> NDArray:
        """Members ``start:min(stop, count)``, by one pass over each stream's entries."""
        stop = min(stop, self._count)
        members = new_buffer(stop - start, self._dtype)
        written = sum(
            scatter_to_places(stream.lengths, stream.cursors, stream.places, None, members, start, stream.base)
            for stream in self._streams
        )
        check_written(written, members)
        return members


class Placed:
    """Entries ``base..base + len(lengths) - 1`` with each slot's place (`PackedBins.lay_out`):
    ``cursors`` start each part of the entries in ``places`` (`scatter_to_places`)."""

    def __init__(
        self, lengths: NDArray[np.integer], places: NDArray, cursors: NDArray[np.int64], base: int = 0
    ) -> None:
        self.lengths, self.places, self.cursors, self.base = lengths, places, cursors, base


# Epochs of at least this many entries compress the bin of each slot while they are scheduled
# (`PackedBins.compress`): 2^27 (512 MiB of int32), where memory, not the two passes that encode
# and decode it, is what runs out.
COMPRESS_FROM_ENTRIES = 1 << 27

# Members laid out per pass of `PendingMembers`: at least 2^26 (256 MiB of int32; 10^7 members in
# one pass, as fast as all at once; 10^8 in 2), and a tenth of the epoch's members where that is
# more (10^9 in 10 passes, not 15): each pass reads every length and place, so passes are what
# writing an epoch of 10^9 costs. The window is the peak of writing, 0.4 bytes per member at
# 10^9 (10^9 builds in 7.43 GiB with an eighth, 7.2 with 2^26).
MEMBERS_AT_ONCE = 1 << 26
MAX_PASSES = 10


def members_at_once(count: int) -> int:
    """Members `PendingMembers` lays out per pass, for an epoch of ``count`` members."""
    return max(MEMBERS_AT_ONCE, -(-count // MAX_PASSES))


def scatter_to_places(lengths, cursors, places, values, out, first: int, base: int = 0) -> int:
    """`scatter_entries` of every entry whose place is in ``first:first + len(out)``, in the
    parts ``cursors`` holds a row for (on as many threads); ``cursors`` is left as it is.
    Entry ``i`` is written as ``base + i``."""
    cursors = cursors.copy()
    return sum(run_in_parts(scatter_entries, cursors.shape[0], lengths, cursors, places, values, out, first, base))


def bin_destinations_of(members: int, num_bins: int, extra: NDArray[np.int64], order, sizes, threads: int):
    """Where micro-batches ``order`` (of ``sizes`` entries) go when laid out one after another:
    micro-batch ``k < num_bins`` is bin ``k`` whole, later ones are ``extra``'s ranges of the
    member space (``members`` long). Offsets and destinations are int32 when the member space
    fits (with `place_slots`'s negative marks, down to ``-2 - entries``)."""
    index = index_dtype(members + 3)
    offsets = np.empty(order.shape[0] + 1, dtype=index)
    destination = new_buffer(num_bins, index)
    destination.fill(-1)
    run_in_parts(bin_destinations, threads, order, sizes, offsets, destination)
    pieces = np.flatnonzero(order >= num_bins)
    pieces = pieces[sizes[pieces] > 0]
    piece_starts, piece_ends = extra[order[pieces] - num_bins].T
    by_start = np.argsort(piece_starts, kind="stable")
    ranges = (piece_starts[by_start], piece_ends[by_start], offsets[pieces][by_start])
    return Destinations(offsets, destination, ranges)


def count_by_group(groups: NDArray[np.integer], num_groups: int, threads: int) -> NDArray[np.int64]:
    """Shape (parts, num_groups): items of each group in each part's share of ``groups``,
    in parts for ``threads`` threads when the items far outnumber the groups (else one)."""
    threads = max(1, threads)
    parts = threads if groups.shape[0] >= 16 * num_groups * threads else 1
    counts = np.zeros((parts, num_groups), dtype=np.int64)
    run_in_parts(count_groups, parts, groups, counts)
    return counts


def _no_pieces() -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    none = np.zeros(0, dtype=np.int64)
    return none, none, none


def left_to_right_sum(values: NDArray[np.float64]) -> float:
    """Left-to-right float sum, as the kernels add."""
    total = 0.0
    for value in values.tolist():
        total += value
    return total
