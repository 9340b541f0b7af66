"""An epoch's micro-batches, held as (start, end) ranges over their entries.

The entries themselves have one of two layouts with the same methods: `LaidOut` (members
and lengths in memory: pad mode, a warmup, a reshard) or `batchplan.planning.bins.PackedBins`
(best fit's bins, members laid out only when needed; `batchplan.planning.parted_bins.PartedBins`:
a mixture's parts, each packed on its own). Formed by
`batchplan.planning.forming`, scheduled by `batchplan.planning.schedule`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from batchplan.kernels.segments import lay_out_segments, range_sums, scatter_segments, segment_destinations
from batchplan.plan import Members, PackingBound, index_dtype
from batchplan.planning.bins import PackedBins
from batchplan.planning.buffers import new_buffer, scratch_or_new
from batchplan.planning.destinations import Destinations, check_written
from batchplan.planning.parted_bins import PartedBins

__all__ = ["LaidOut", "EpochBatches"]


class LaidOut:
    """Entries in memory: ``members`` (entry ids) and their ``lengths``, micro-batch after
    micro-batch; formed micro-batch ``k`` is the range ``starts[k]:ends[k]`` of them.

    Methods take the micro-batches added after forming as ``extra`` (shape (k, 2): start,
    end), which follow the formed ones."""

    def __init__(self, members: NDArray[np.integer], lengths: NDArray[np.int32], starts, ends) -> None:
        self.members = members
        self._lengths: NDArray[np.int32] | None = lengths  # None once freed
        self.starts, self.ends = starts, ends

    @property
    def lengths(self) -> NDArray[np.int32]:
        """The members' lengths, until `free_lengths`."""
        if self._lengths is None:
            raise ValueError("the lengths were freed")
        return self._lengths

    @property
    def num_formed(self) -> int:
        return int(self.starts.shape[0])

    def formed_tokens(self) -> NDArray[np.integer]:
        return range_sums(self.lengths, self.starts, self.ends, np.zeros(self.num_formed, dtype=np.int64))

    def ranges(self, starts: NDArray[np.int64], ends: NDArray[np.int64]) -> list[tuple[NDArray, NDArray]]:
        return [(self.members[s:e], self.lengths[s:e]) for s, e in zip(starts, ends)]

    def range_lengths(self, starts: NDArray[np.int64], ends: NDArray[np.int64]) -> list[NDArray[np.int32]]:
        return [self.lengths[s:e] for s, e in zip(starts, ends)]

    def range_members(self, starts: NDArray[np.int64], ends: NDArray[np.int64]) -> list[NDArray]:
        return [self.members[s:e] for s, e in zip(starts, ends)]

    def free_lengths(self) -> None:
        self._lengths = None

    def bounds(self, extra: NDArray[np.int64]) -> tuple[NDArray[np.integer], NDArray[np.integer]]:
        """Starts and ends of every micro-batch: the formed ones, then ``extra``."""
        return joined(self.starts, extra[:, 0]), joined(self.ends, extra[:, 1])

    def length_sums(self, value: Callable, extra: NDArray[np.int64]) -> NDArray[np.float64]:
        starts, ends = self.bounds(extra)
        values = value(self.lengths.astype(np.float64))
        return range_sums(values, starts, ends, np.zeros(starts.shape[0], dtype=np.float64))

    def entry_sums(self, values: NDArray[np.integer], extra: NDArray[np.int64]) -> NDArray[np.int64]:
        starts, ends = self.bounds(extra)
        return range_sums(values[self.members], starts, ends, np.zeros(starts.shape[0], dtype=np.int64))

    def gather(self, extra, order, sizes, threads: int, scratch) -> tuple[NDArray[np.int64], NDArray]:
        starts, ends = self.bounds(extra)
        destination = scratch_or_new(scratch, starts.shape[0])
        members = np.empty(int(sizes.sum()), dtype=self.members.dtype)
        offsets, written = lay_out_segments(self.members, starts, ends, order, destination, members)
        check_written(written, members)
        return offsets, members

    def destinations(self, extra, order, sizes, threads: int) -> Destinations:
        starts, ends = self.bounds(extra)
        destination = new_buffer(starts.shape[0], np.int64)
        offsets = segment_destinations(starts, ends, order, destination)
        return Destinations(offsets, destination, (starts, ends))

    def lay_out(self, where: Destinations, threads: int) -> Members:
        """The members laid out at ``where``; this layout is empty afterwards (the lengths are freed first)."""
        members = self.members
        del self.members
        self._lengths = self.starts = self.ends = None
        out = new_buffer(where.count, members.dtype)
        starts, ends = where.ranges
        check_written(scatter_segments(members, starts, ends, where.take_destination(), out), out)
        return Members(out)


def joined(formed: NDArray[np.integer], added: NDArray[np.int64]) -> NDArray[np.integer]:
    """``formed`` then ``added`` (``formed`` itself when nothing was added: no copy of the many)."""
    return np.concatenate([formed, added]) if added.shape[0] else formed


class EpochBatches:
    """Micro-batches of an epoch: micro-batch ``k`` holds entries ``members[starts[k]:ends[k]]``,
    whose lengths are ``lengths[starts[k]:ends[k]]`` (kept beside the members so that sums
    read memory in order instead of gathering lengths at random).

    Start/end pairs (not offsets) let the last round split a micro-batch in place,
    and let the final (rank, step, micro) order be gathered in one pass.

    The layout holds the micro-batches as formed; the few that `extend` adds (split halves,
    empty micro-batches) are kept here, apart (no copy of the many), and handed to the
    layout's methods as an array. Packed micro-batches come as `PackedBins` (micro-batch
    ``k < num_bins`` is bin ``k``): the hot path (`tokens`, `length_sums`, `range_lengths`,
    `destinations` and `lay_out`) never lays their members out bin by bin (`entry_sums` lays
    the summed values out once); asking for ``members`` or ``lengths`` does, once, and the
    micro-batches continue on that layout.

    An epoch's plan lays the members out once, with `lay_out`, which uses the micro-batches
    up; `free_lengths` lets laid-out lengths go once what is needed of them is known.
    """

    def __init__(self, layout: LaidOut | PackedBins | PartedBins) -> None:
        self.layout: LaidOut | PackedBins | PartedBins = layout
        self._base_tokens = layout.tokens if isinstance(layout, PackedBins) else None
        self._extra = np.zeros((0, 3), dtype=np.int64)  # rows (start, end, tokens)
        self._joined_cache: tuple[NDArray[np.integer], NDArray[np.integer]] | None = None
        self.packing: PackingBound | None = None  # pack mode: as packed, and the bound

    @classmethod
    def of_ranges(cls, members: NDArray[np.integer], lengths: NDArray[np.int32], starts, ends) -> EpochBatches:
        """Micro-batch ``k`` = ``members[starts[k]:ends[k]]`` (of ``lengths``)."""
        return cls(LaidOut(members, lengths, starts, ends))

    @classmethod
    def of_bins(cls, packed: PackedBins | PartedBins) -> EpochBatches:
        """Micro-batch ``k`` = bin ``k`` (of every part, one part after another)."""
        return cls(packed)

    @property
    def starts(self) -> NDArray[np.integer]:
        return self._joined_bounds()[0]

    @property
    def ends(self) -> NDArray[np.integer]:
        return self._joined_bounds()[1]

    @property
    def _added(self) -> NDArray[np.int64]:
        """Shape (k, 2): start and end of each micro-batch `extend` added."""
        return self._extra[:, :2]

    def _joined_bounds(self) -> tuple[NDArray[np.integer], NDArray[np.integer]]:
        """Starts and ends of all micro-batches, joined once per `extend`."""
        if self._joined_cache is None:
            formed_starts, formed_ends = self.layout.starts, self.layout.ends
            self._joined_cache = (joined(formed_starts, self._extra[:, 0]), joined(formed_ends, self._extra[:, 1]))
        return self._joined_cache

    def bounds(self, which: NDArray[np.integer]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """``(starts, ends)`` of a few micro-batches (without joining all of them)."""
        which = np.asarray(which, dtype=np.int64)
        formed = which < self.layout.num_formed
        starts, ends = np.empty(which.shape, dtype=np.int64), np.empty(which.shape, dtype=np.int64)
        starts[formed], ends[formed] = self.layout.starts[which[formed]], self.layout.ends[which[formed]]
        added = which[~formed] - self.layout.num_formed
        starts[~formed], ends[~formed] = self._extra[added, 0], self._extra[added, 1]
        return starts, ends

    @property
    def members(self) -> NDArray[np.integer]:
        return self._laid_out().members

    @property
    def lengths(self) -> NDArray[np.int32]:
        return self._laid_out().lengths

    def _laid_out(self) -> LaidOut:
        if not isinstance(self.layout, LaidOut):
            starts, ends = self.layout.starts, self.layout.ends
            self.layout = LaidOut(*self.layout.members(in_place=True), starts, ends)
        return self.layout

    @property
    def count(self) -> int:
        return self.layout.num_formed + int(self._extra.shape[0])

    def range_sums(self, values: NDArray) -> NDArray:
        """Sum of ``values[starts[k]:ends[k]]`` (values aligned with members) for each k:
        exact int64 for integers; floats range by range, so no range carries the rounding
        of the whole epoch."""
        total = np.zeros(self.count, dtype=np.float64 if np.issubdtype(values.dtype, np.floating) else np.int64)
        return range_sums(values, self.starts, self.ends, total)

    def tokens(self) -> NDArray[np.integer]:
        """Tokens of each micro-batch."""
        if self._base_tokens is None:  # the micro-batches as formed (before `extend`), summed once
            self._base_tokens = self.layout.formed_tokens()
        return joined(self._base_tokens, self._extra[:, 2])

    def token_table(self) -> NDArray[np.integer]:
        """Shape (count, 2): tokens and entries of each micro-batch, side by side (one cache
        line per micro-batch for kernels that read them at random); int32 when they fit."""
        starts, ends, formed = self.layout.starts, self.layout.ends, self.layout.num_formed
        tokens = self.tokens()
        most = max(int(tokens.max(initial=0)), int(ends.max(initial=0)))  # entries <= the last end
        table = np.empty((self.count, 2), dtype=index_dtype(most + 1))
        table[:, 0] = tokens
        np.subtract(ends, starts, out=table[:formed, 1])
        table[formed:, 1] = self._extra[:, 1] - self._extra[:, 0]
        return table

    def length_sums(self, value: Callable[[NDArray[np.float64]], NDArray[np.float64]]) -> NDArray[np.float64]:
        """``sum(value(length))`` over each micro-batch's entries (float64, range by range);
        ``value`` works elementwise on float64 lengths."""
        return self.layout.length_sums(value, self._added)

    def entry_sums(self, values: NDArray[np.integer]) -> NDArray[np.int64]:
        """``sum(values[entry])`` over each micro-batch's entries (int64)."""
        return self.layout.entry_sums(values, self._added)

    def ranges(self, which: NDArray[np.int64]) -> list[tuple[NDArray, NDArray]]:
        """``(members, lengths)`` of a few micro-batches."""
        return self.layout.ranges(*self.bounds(which))

    def range_lengths(self, which: NDArray[np.int64]) -> list[NDArray[np.int32]]:
        """Entry lengths of a few micro-batches (no entry is looked up)."""
        return self.layout.range_lengths(*self.bounds(which))

    def members_of(self, which: NDArray[np.integer]) -> NDArray[np.int64]:
        """The entries of the given micro-batches, concatenated (int64)."""
        parts = self.layout.range_members(*self.bounds(which))
        return np.concatenate([np.zeros(0, dtype=np.int64), *parts]).astype(np.int64)

    def compress(self, threads: int = 1) -> None:
        """Packed bins of a large epoch keep the bin of each slot encoded until it is needed
        again (`batchplan.planning.bins.PackedBins.compress`); otherwise nothing changes."""
        if not isinstance(self.layout, LaidOut):
            self.layout.compress(threads)

    def free_lengths(self) -> None:
        """Free the entries' lengths held beside the members (laid-out micro-batches):
        what follows needs only what is cached (`tokens`) or asked for before. Packed bins
        hold none (they read the entries' own lengths)."""
        self.tokens()
        self.layout.free_lengths()

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
        destinations when long enough (`batchplan.planning.buffers`)."""
        return self.layout.gather(self._added, order, sizes, threads, scratch)

    def destinations(self, order: NDArray[np.integer], sizes: NDArray[np.int64], threads: int = 1) -> Destinations:
        """Where the members of micro-batches ``order`` (of ``sizes`` entries, as for `gather`)
        go when laid out one after another; its ``offsets`` are the CSR offsets."""
        return self.layout.destinations(self._added, order, sizes, threads)

    def lay_out(self, where: Destinations, threads: int = 1) -> Members:
        """The members at ``where`` (`destinations`), as `gather` lays them out; these
        micro-batches are empty afterwards: they free every array before the members are made (only
        ``packing`` is left), so that the peak holds the members (packed bins: the places
        they are laid out from, a window at a time, `batchplan.planning.bins.PendingMembers`)
        and what laying them out needs, nothing of the micro-batches as formed."""
        layout = self.layout
        del self.layout, self._extra
        self._base_tokens = self._joined_cache = None
        return layout.lay_out(where, threads)
