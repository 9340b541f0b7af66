"""Micro-batches packed part by part: a mixture's epoch, whose parts (one pass of one source
each) are packed on their own and never share a micro-batch.

`PartedBins` holds each part's `batchplan.planning.bins.PackedBins` as they are (their members
are never laid out to be scheduled) and has the methods of a
`batchplan.planning.epoch_batches` layout over all of them: micro-batch ids are the parts'
bins one part after another, member space the parts' member spaces one after another, and
entry ids global (part ``p``'s entry ``i`` is ``entry_base[p] + i``).

The final layout writes every part's members into member space, a part at a time, the
largest first, each part's bins overwritten as it goes: a part's writes stay in its own range, so
only what is written is resident beside the bins not yet used (the epoch holds one index per
entry, as one packed dataset holds each slot's place), and rows are read from there
(`RowMembers`: a row is one range of member space, copied out by
`batchplan.kernels.segments.gather_rows`). Each part may write values of its own in place of
its entry ids (``values``: a mixture's samples).

Epochs of at least `batchplan.planning.bins.COMPRESS_FROM_ENTRIES` entries compress every part
(`CompressedBins`: the bin of each slot freed, 4 bytes per entry) while they are composed and
scheduled, and pack a part's histogram again when its bins are needed (the same bins).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numpy.typing import NDArray

from batchplan.kernels.segments import gather_rows
from batchplan.plan import Members, index_dtype
from batchplan.planning.bins import (
    COMPRESS_FROM_ENTRIES,
    PackedBins,
    bin_destinations_of,
    left_to_right_sum,
    scatter_to_places,
)
from batchplan.planning.buffers import new_buffer
from batchplan.planning.cutting_stock import pack_histogram
from batchplan.planning.destinations import Destinations, check_written
from batchplan.planning.threads import threads_for

__all__ = ["CompressedBins", "PartedBins", "RowMembers", "release_free_heap"]

# Rows whose start in member space `PartedBins.destinations` finds at a time (its lookups stay
# a few MiB).
_ROWS_AT_ONCE = 1 << 18


class CompressedBins:
    """A part's packed bins without the bin of each slot (`PackedBins` less one index per
    entry): what packing its histogram again needs (`restore`), and what the epoch reads of
    its bins without their slots (offsets, tokens, lengths)."""

    def __init__(self, packed: PackedBins) -> None:
        self.lengths, self.start, self.keys = packed.lengths, packed.start, packed.keys
        self.offsets, self.tokens, self.capacity = packed.offsets, packed.tokens, packed.capacity

    @property
    def num_bins(self) -> int:
        return int(self.tokens.shape[0])

    num_formed = num_bins

    def restore(self) -> PackedBins:
        """The bins again: `batchplan.planning.cutting_stock.pack_histogram` on the same
        histogram makes the same bins (best fit's, or the patterns it chose)."""
        histogram = np.diff(self.start)[: self.capacity + 1]
        packed = pack_histogram(histogram, self.capacity)
        if not (np.array_equal(packed.offsets, self.offsets) and np.array_equal(packed.tokens, self.tokens)):
            raise AssertionError("packing a part's histogram again made other bins")
        slot_bin = packed.slot_bin
        return PackedBins(self.lengths, self.start, self.keys, slot_bin, self.offsets, self.tokens, self.capacity)


class PartedBins:
    """Parts' packed bins as one layout (the module docstring).

    Args:
        parts: each part's bins over its own entries ``0..n_p - 1`` (compressed or not).
        entry_base: the global id of each part's first entry.
        num_entries: the global entries' count (sets the dtype of member ids).
        values: per part, what its members are laid out as in place of their entry ids
            (called with the threads when the part is laid out; one value per entry of the
            part), or None: entry ids.
        dtype: the members' dtype (default: `index_dtype` of ``num_entries``).
    """

    def __init__(
        self,
        parts: list[PackedBins | CompressedBins],
        entry_base: list[int],
        num_entries: int,
        *,
        values: list[Callable[[int], NDArray]] | None = None,
        dtype: np.dtype | None = None,
    ) -> None:
        if len(parts) != len(entry_base) or not parts or (values is not None and len(values) != len(parts)):
            raise ValueError(f"{len(parts)} parts with {len(entry_base)} entry bases")
        self.parts = parts
        self.entry_base = [int(base) for base in entry_base]
        self.values = values
        self.bin_base = _bases([part.num_bins for part in parts])
        self.member_base = _bases([int(part.offsets[-1]) for part in parts])
        # The bins' bounds in member space (and their tokens): int32 where they fit, as one packing's.
        places = index_dtype(int(self.member_base[-1]) + 1)
        self.offsets = np.concatenate(
            [np.add(part.offsets[:-1], base, dtype=places) for part, base in zip(parts, self.member_base[:-1])]
            + [self.member_base[-1:].astype(places)]
        )
        self._dtype = np.dtype(dtype or index_dtype(num_entries))
        if self.member_base[-1] >= 2**31 and any(part.offsets.dtype == np.int32 for part in parts):
            raise ValueError(f"an epoch of {int(self.member_base[-1]):,} entries packed in parts of int32 places")

    @property
    def num_formed(self) -> int:
        return int(self.bin_base[-1])

    @property
    def starts(self) -> NDArray[np.integer]:
        return self.offsets[:-1]

    @property
    def ends(self) -> NDArray[np.integer]:
        return self.offsets[1:]

    def _live(self, index: int) -> PackedBins:
        """Part ``index``'s bins, packed again if compressed (then not kept: compressed it stays)."""
        part = self.parts[index]
        return part.restore() if isinstance(part, CompressedBins) else part

    def formed_tokens(self) -> NDArray[np.integer]:
        dtype = np.result_type(*[part.tokens.dtype for part in self.parts])
        return np.concatenate([part.tokens for part in self.parts], dtype=dtype)

    def members(self, in_place: bool = False) -> tuple[NDArray[np.integer], NDArray[np.int32]]:
        """The whole member space, part after part: ``(members, lengths)``."""
        members, lengths = [], []
        for index, base in enumerate(self.entry_base):
            part_members, part_lengths = self._live(index).members(in_place=in_place)
            members.append(np.add(part_members, base, dtype=self._dtype))
            lengths.append(part_lengths)
        if in_place:
            self.parts = []
        return np.concatenate(members), np.concatenate(lengths)

    def ranges(self, starts: NDArray[np.int64], ends: NDArray[np.int64]) -> list[tuple[NDArray, NDArray]]:
        """``(members, lengths)`` of a few ranges of member space, each inside one bin."""
        none = (np.zeros(0, dtype=self._dtype), np.zeros(0, dtype=np.int32))
        out: list[tuple[NDArray, NDArray]] = [none] * len(starts)
        for index, which, local_starts, local_ends in self._by_part(starts, ends):
            found = self._live(index).ranges(local_starts, local_ends)
            for at, (members, lengths) in zip(which, found):
                out[at] = (np.add(members, self.entry_base[index], dtype=self._dtype), lengths)
        return out

    def range_members(self, starts: NDArray[np.int64], ends: NDArray[np.int64]) -> list[NDArray]:
        return [members for members, _ in self.ranges(starts, ends)]

    def range_lengths(self, starts: NDArray[np.int64], ends: NDArray[np.int64]) -> list[NDArray[np.int32]]:
        out: list[NDArray[np.int32]] = [np.zeros(0, dtype=np.int32)] * len(starts)
        for index, which, local_starts, local_ends in self._by_part(starts, ends):
            for at, lengths in zip(which, self._live(index).range_lengths(local_starts, local_ends)):
                out[at] = lengths
        return out

    def _by_part(self, starts, ends):
        """The non-empty ranges grouped by the part they lie in: ``(part, positions, local
        starts, local ends)`` for each part that holds one."""
        starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        present = np.flatnonzero(ends > starts)
        part_of = np.searchsorted(self.member_base, starts[present], side="right") - 1
        for index in np.unique(part_of):
            which = present[part_of == index]
            base = self.member_base[index]
            yield int(index), which, starts[which] - base, ends[which] - base

    def free_lengths(self) -> None:
        """Nothing to free: the lengths read are the entries' own."""

    def compress(self, threads: int = 1) -> None:
        """Epochs of at least `COMPRESS_FROM_ENTRIES` entries compress every part (`CompressedBins`); what
        forming the parts freed goes back (`release_free_heap`) before the epoch is scheduled."""
        if self.member_base[-1] >= COMPRESS_FROM_ENTRIES:
            self.parts = [part if isinstance(part, CompressedBins) else CompressedBins(part) for part in self.parts]
        release_free_heap()

    def length_sums(self, value: Callable, extra: NDArray[np.int64]) -> NDArray[np.float64]:
        """Per micro-batch, ``sum(value(length))`` over its entries (as `PackedBins.length_sums`)."""
        none = np.zeros((0, 2), dtype=np.int64)
        per_bin = [self._live(index).length_sums(value, none) for index in range(len(self.parts))]
        table = value(np.arange(max(part.capacity for part in self.parts) + 1, dtype=np.float64))
        pieces = self.range_lengths(extra[:, 0], extra[:, 1]) if extra.shape[0] else []
        return np.concatenate(per_bin + [np.array([left_to_right_sum(table[lengths]) for lengths in pieces])])

    def entry_sums(self, values: NDArray[np.integer], extra: NDArray[np.int64]) -> NDArray[np.int64]:
        """Per micro-batch, ``sum(values[entry])`` over its entries (int64)."""
        none = np.zeros((0, 2), dtype=np.int64)
        per_bin = []
        for index, base in enumerate(self.entry_base):
            part = self._live(index)
            per_bin.append(part.entry_sums(values[base : base + part.lengths.shape[0]], none))
        members = self.range_members(extra[:, 0], extra[:, 1]) if extra.shape[0] else []
        pieces = np.array([int(values[part].sum(dtype=np.int64)) for part in members], dtype=np.int64)
        return np.concatenate(per_bin + [pieces])

    def destinations(self, extra: NDArray[np.int64], order, sizes, threads: int) -> RowDestinations:
        """Where micro-batches ``order`` (of ``sizes`` entries) go when laid out one after another
        (their offsets, as `PackedBins.destinations`' over every part's bins), and where each
        begins in member space (`_ROWS_AT_ONCE` at a time): what `lay_out` reads (it writes
        the members in member space: no bin has a destination of its own)."""
        members = int(self.member_base[-1])
        index = index_dtype(members + 3)  # `bin_destinations_of`'s
        offsets = np.zeros(np.shape(order)[0] + 1, dtype=index)
        np.cumsum(sizes, out=offsets[1:])
        where = Destinations(offsets, np.zeros(0, dtype=index), _no_pieces())
        order = np.asarray(order)
        row_starts = np.empty(order.shape[0], dtype=index_dtype(members + 1))
        for first in range(0, order.shape[0], _ROWS_AT_ONCE):
            rows, starts = order[first : first + _ROWS_AT_ONCE], row_starts[first : first + _ROWS_AT_ONCE]
            formed = rows < self.num_formed
            starts[formed] = self.offsets[rows[formed]]
            starts[~formed] = extra[rows[~formed] - self.num_formed, 0]
        return RowDestinations(where, row_starts)

    def _part_destinations(self, where: Destinations) -> list[Destinations]:
        """``where`` cut per part: each part's bins' destinations (views) and its pieces in its
        own member space."""
        destination = where.take_destination()
        piece_starts, piece_ends, piece_places = where.ranges
        cuts = np.searchsorted(piece_starts, self.member_base)
        out = []
        for index in range(len(self.parts)):
            first, last = int(cuts[index]), int(cuts[index + 1])
            base = self.member_base[index]
            pieces = (piece_starts[first:last] - base, piece_ends[first:last] - base, piece_places[first:last])
            bins = destination[self.bin_base[index] : self.bin_base[index + 1]]
            out.append(Destinations(where.offsets, bins, pieces))
        return out

    def gather(self, extra, order, sizes, threads: int, scratch) -> tuple[NDArray[np.int64], NDArray]:
        """`EpochBatches.gather`, leaving the bins as they are."""
        where = bin_destinations_of(int(self.member_base[-1]), self.num_formed, extra, order, sizes, threads)
        members = new_buffer(where.count, self._dtype)
        written = 0
        for index, (part_where, base) in enumerate(zip(self._part_destinations(where), self.entry_base)):
            part = self._live(index)
            written += part.write_members(part_where, members, threads_for(part.lengths.shape[0], threads), base)
        check_written(written, members)
        return where.offsets, members

    def lay_out(self, where: Destinations, threads: int) -> Members:
        """The members at ``where`` (`destinations`): every part's members (or ``values``)
        written into member space, largest part first, each part's bins overwritten as it goes, and
        read in row order from there (`RowMembers`: while member space is filled, it holds the
        bins not yet used and the values of the parts being written besides what is written).
        Parts write ranges of their own: kept bins are written on ``threads`` threads, a part
        each; compressed ones a part at a time (each is packed again: one part's bins at once)."""
        assert isinstance(where, RowDestinations)  # what `destinations` makes
        where.take_destination()  # the rows read member space: the per-bin destinations go
        bases = self.member_base
        space = new_buffer(int(bases[-1]), self._dtype)
        largest = sorted(range(len(self.parts)), key=lambda index: -int(self.parts[index].lengths.shape[0]))
        side_by_side = threads > 1 and not any(isinstance(part, CompressedBins) for part in self.parts)
        parts: list[PackedBins | CompressedBins | None] = list(self.parts)
        self.parts = []
        del self.offsets

        def write(index: int, part_threads: int) -> int:
            return self._write_part(parts, index, space[int(bases[index]) : int(bases[index + 1])], part_threads)

        if side_by_side:
            with ThreadPoolExecutor(max_workers=threads) as pool:
                written = sum(pool.map(write, largest, [1] * len(largest)))
        else:
            written = sum(write(index, threads) for index in largest)
        release_free_heap()
        check_written(written, space)
        return RowMembers(space, where.offsets, where.row_starts)

    def _write_part(self, parts, index: int, out: NDArray, threads: int) -> int:
        """Part ``index``'s members (or values) written into ``out`` where its bins lie (its range
        of member space), its bins overwritten and freed; how many were written."""
        release_free_heap()  # what the part before freed: heaps keep what is below mmap's threshold
        part, parts[index] = parts[index], None
        live = part.restore() if isinstance(part, CompressedBins) else part
        del part
        part_threads = threads_for(live.lengths.shape[0], threads)
        local = Destinations(np.zeros(1, dtype=np.int64), live.offsets[:-1].astype(np.int64), _no_pieces())
        placed = live.placed(local, part_threads, self.entry_base[index])
        del live, local
        values = None if self.values is None else self.values[index](part_threads)
        return scatter_to_places(placed.lengths, placed.cursors, placed.places, values, out, 0, placed.base)


class RowDestinations(Destinations):
    """`Destinations` over parts' bins, with ``row_starts``: where each micro-batch of the
    order begins in member space (a micro-batch is one range of it)."""

    def __init__(self, where: Destinations, row_starts: NDArray[np.integer]) -> None:
        super().__init__(where.offsets, where.take_destination(), where.ranges)
        self.row_starts = row_starts


class RowMembers(Members):
    """An epoch's members in row order, read from member space: row ``r`` holds members
    ``offsets[r]:offsets[r + 1]``, which are ``space[row_starts[r]:]`` (as many). `between`
    gathers a range of them (a rank's rows: O(its members)); `all` gathers every member once,
    keeps them, and lets member space go."""

    def __init__(self, space: NDArray, offsets: NDArray[np.integer], row_starts: NDArray[np.integer]) -> None:
        # Members' methods are all overridden: the array is gathered only when `all` asks.
        self._all: NDArray | None = None
        self._space, self._offsets, self._row_starts = space, offsets, row_starts

    @property
    def count(self) -> int:
        return int(self._offsets[-1])

    def between(self, start: int, stop: int) -> NDArray:
        if self._all is not None:
            return self._all[start:stop]
        start, stop = min(start, self.count), min(stop, self.count)  # as a slice of the array would
        if not 0 <= start <= stop:
            raise ValueError(f"members {start:,}:{stop:,} asked of {self.count:,}")
        out = np.empty(stop - start, dtype=self._space.dtype)
        if stop == start:
            return out
        # In the offsets' own dtype: a Python int would have numpy convert every offset first.
        at = np.array([start, stop], dtype=self._offsets.dtype)
        first = int(np.searchsorted(self._offsets, at[0], side="right")) - 1  # the row holding member start
        last = int(np.searchsorted(self._offsets, at[1], side="left"))  # rows first..last - 1 hold start..stop - 1
        gather_rows(self._space, self._offsets, self._row_starts, first, last, start, out)
        return out

    def all(self) -> NDArray:
        if self._all is None:
            self._all = self.between(0, self.count)
            del self._space, self._row_starts
        return self._all


def release_free_heap() -> None:
    """Have the C library give back the free memory its heaps keep (glibc's ``malloc_trim``;
    elsewhere nothing). Arrays below its mmap threshold (up to 32 MiB, raised as larger ones
    are freed) come from heaps, one per thread that allocates; what they free inside a heap
    stays resident: after scheduling a 10^9-use epoch, about a gigabyte."""
    trim = getattr(_C_LIBRARY, "malloc_trim", None)
    if trim is not None:
        trim(0)


def _c_library():
    """The process's own C library (None where ctypes cannot name it)."""
    try:
        return ctypes.CDLL(None)
    except (OSError, TypeError):
        return None


_C_LIBRARY = _c_library()


def _no_pieces() -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    none = np.zeros(0, dtype=np.int64)
    return none, none, none


def _bases(counts: list[int]) -> NDArray[np.int64]:
    bases = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=bases[1:])
    return bases
