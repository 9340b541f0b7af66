"""Micro-batches packed part by part: a mixture's epoch, whose parts (one pass of one source
each) are packed on their own and never share a micro-batch.

`PartedBins` holds each part's `batchplan.planning.bins.PackedBins` as they are (their members
are never laid out to be scheduled) and has the methods of a
`batchplan.planning.micro_batches` layout over all of them: micro-batch ids are the parts'
bins one part after another, member space the parts' member spaces one after another, and
entry ids global (part ``p``'s entry ``i`` is ``entry_base[p] + i``). The final layout places
every part's slots (`PackedBins.placed`), and the epoch's members are laid out a window at a
time from all the parts' places (`batchplan.planning.bins.PendingMembers`): memory and time
are those of one packed dataset of the same entries, plus one array of a few bytes per bin.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from batchplan.plan import index_dtype
from batchplan.planning.bins import PackedBins, PendingMembers, bin_destinations_of, left_to_right_sum
from batchplan.planning.buffers import new_buffer
from batchplan.planning.destinations import Destinations, check_written
from batchplan.planning.threads import threads_for

__all__ = ["PartedBins"]



class PartedBins:
    """Parts' packed bins as one layout (the module docstring).

    Args:
        parts: each part's bins over its own entries ``0..n_p - 1``.
        entry_base: the global id of each part's first entry.
        num_entries: the global entries' count (sets the dtype of member ids).
    """

    def __init__(self, parts: list[PackedBins], entry_base: list[int], num_entries: int) -> None:
        if len(parts) != len(entry_base) or not parts:
            raise ValueError(f"{len(parts)} parts with {len(entry_base)} entry bases")
        self.parts = parts
        self.entry_base = [int(base) for base in entry_base]
        self.bin_base = _bases([part.num_bins for part in parts])
        self.member_base = _bases([int(part.offsets[-1]) for part in parts])
        self.offsets = np.concatenate(
            [part.offsets[:-1].astype(np.int64) + base for part, base in zip(parts, self.member_base[:-1])]
            + [self.member_base[-1:]]
        )
        self._dtype = index_dtype(num_entries)
        if self.member_base[-1] >= 2**31 and any(part.offsets.dtype == np.int32 for part in parts):
            raise ValueError(f"an epoch of {int(self.member_base[-1]):,} entries packed in parts of int32 places")

    @property
    def num_formed(self) -> int:
        return int(self.bin_base[-1])

    @property
    def starts(self) -> NDArray[np.int64]:
        return self.offsets[:-1]

    @property
    def ends(self) -> NDArray[np.int64]:
        return self.offsets[1:]

    def formed_tokens(self) -> NDArray[np.int64]:
        return np.concatenate([part.tokens.astype(np.int64) for part in self.parts])

    def members(self, use_up: bool = False) -> tuple[NDArray[np.integer], NDArray[np.int32]]:
        """The whole member space, part after part: ``(members, lengths)``."""
        members, lengths = [], []
        for part, base in zip(self.parts, self.entry_base):
            part_members, part_lengths = part.members(use_up=use_up)
            members.append(np.add(part_members, base, dtype=self._dtype))
            lengths.append(part_lengths)
        if use_up:
            self.parts = []
        return np.concatenate(members), np.concatenate(lengths)

    def ranges(self, starts: NDArray[np.int64], ends: NDArray[np.int64]) -> list[tuple[NDArray, NDArray]]:
        """``(members, lengths)`` of a few ranges of member space, each inside one bin."""
        out: list[tuple[NDArray, NDArray]] = [(np.zeros(0, dtype=self._dtype), np.zeros(0, dtype=np.int32))] * len(starts)
        for index, which, local_starts, local_ends in self._by_part(starts, ends):
            found = self.parts[index].ranges(local_starts, local_ends)
            for at, (members, lengths) in zip(which, found):
                out[at] = (np.add(members, self.entry_base[index], dtype=self._dtype), lengths)
        return out

    def range_members(self, starts: NDArray[np.int64], ends: NDArray[np.int64]) -> list[NDArray]:
        return [members for members, _ in self.ranges(starts, ends)]

    def range_lengths(self, starts: NDArray[np.int64], ends: NDArray[np.int64]) -> list[NDArray[np.int32]]:
        out: list[NDArray[np.int32]] = [np.zeros(0, dtype=np.int32)] * len(starts)
        for index, which, local_starts, local_ends in self._by_part(starts, ends):
            for at, lengths in zip(which, self.parts[index].range_lengths(local_starts, local_ends)):
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

    def release_lengths(self) -> None:
        """Nothing to let go: the lengths read are the entries' own."""

    def park(self) -> None:
        for part in self.parts:
            part.park()

    def length_sums(self, value: Callable, extra: NDArray[np.int64]) -> NDArray[np.float64]:
        """Per micro-batch, ``sum(value(length))`` over its entries (as `PackedBins.length_sums`)."""
        none = np.zeros((0, 2), dtype=np.int64)
        per_bin = [part.length_sums(value, none) for part in self.parts]
        table = value(np.arange(max(part.capacity for part in self.parts) + 1, dtype=np.float64))
        pieces = self.range_lengths(extra[:, 0], extra[:, 1]) if extra.shape[0] else []
        return np.concatenate(per_bin + [np.array([left_to_right_sum(table[lengths]) for lengths in pieces])])

    def entry_sums(self, values: NDArray[np.integer], extra: NDArray[np.int64]) -> NDArray[np.int64]:
        """Per micro-batch, ``sum(values[entry])`` over its entries (int64)."""
        none = np.zeros((0, 2), dtype=np.int64)
        per_bin = [
            part.entry_sums(values[base : base + part.lengths.shape[0]], none)
            for part, base in zip(self.parts, self.entry_base)
        ]
        members = self.range_members(extra[:, 0], extra[:, 1]) if extra.shape[0] else []
        pieces = np.array([int(values[part].sum(dtype=np.int64)) for part in members], dtype=np.int64)
        return np.concatenate(per_bin + [pieces])

    def destinations(self, extra: NDArray[np.int64], order, sizes, threads: int) -> Destinations:
        """Where micro-batches ``order`` (of ``sizes`` entries) go when laid out one after another
        (as `PackedBins.destinations`, over every part's bins)."""
        return bin_destinations_of(int(self.member_base[-1]), self.num_formed, extra, order, sizes, threads)

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
        """`MicroBatches.gather`, leaving the bins as they are."""
        where = self.destinations(extra, order, sizes, threads)
        members = new_buffer(where.count, self._dtype)
        written = sum(
            part.write_members(part_where, members, threads_for(part.lengths.shape[0], threads), base)
            for part, part_where, base in zip(self.parts, self._part_destinations(where), self.entry_base)
        )
        check_written(written, members)
        return where.offsets, members

    def lay_out(self, where: Destinations, threads: int) -> PendingMembers:
        """The members at ``where``, laid out a window at a time from every part's places,
        using the parts' bins up (`PackedBins.placed`)."""
        streams = []
        for part, part_where, base in zip(self.parts, self._part_destinations(where), self.entry_base):
            streams.append(part.placed(part_where, threads_for(part.lengths.shape[0], threads), base))
        self.parts = []
        return PendingMembers(streams, where.count, self._dtype)


def _bases(counts: list[int]) -> NDArray[np.int64]:
    bases = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=bases[1:])
    return bases

