"""An epoch's micro-batches, held as (start, end) ranges over their entries.

Formed by `batchplan.planning.forming`, scheduled by `batchplan.planning.schedule`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from batchplan.kernels.pack import bin_destinations, scatter_bins
from batchplan.kernels.segments import lay_out_segments, range_sums
from batchplan.planning.bins import PackedBins
from batchplan.planning.buffers import new_buffer, scratch_or_new
from batchplan.planning.threads import run_in_parts

__all__ = ["MicroBatches"]


class MicroBatches:
    """Micro-batches of an epoch: micro-batch ``k`` holds entries ``members[starts[k]:ends[k]]``,
    whose lengths are ``lengths[starts[k]:ends[k]]`` (kept beside the members so that sums
    read memory in order instead of gathering lengths at random).

    Start/end pairs (not offsets) let the last round split a micro-batch in place,
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
        destinations when long enough (`batchplan.planning.buffers`)."""
        if not self._lazy:
            destination = scratch_or_new(scratch, self.count)
            members = np.empty(int(sizes.sum()), dtype=self.members.dtype)
            offsets, written = lay_out_segments(self.members, self.starts, self.ends, order, destination, members)
            _check_written(written, members)
            return offsets, members
        packed = self.packed
        offsets = np.empty(order.shape[0] + 1, dtype=np.int64)
        destination = scratch_or_new(scratch, packed.num_bins)
        destination.fill(-1)
        run_in_parts(bin_destinations, threads, order, sizes, offsets, destination)
        pieces = np.flatnonzero(order >= packed.num_bins)
        pieces = pieces[sizes[pieces] > 0]
        piece_starts, piece_ends = self.bounds(order[pieces])
        by_start = np.argsort(piece_starts, kind="stable")
        members = new_buffer(offsets[-1], packed.items.dtype)
        written = run_in_parts(
            scatter_bins, threads,
            packed.items, packed.start, packed.slot_bin, packed.offsets, destination, piece_starts[by_start],
            piece_ends[by_start], offsets[pieces][by_start], packed.capacity, members,
        )  # fmt: skip
        _check_written(sum(written), members)
        return offsets, members


def _check_written(written: int, members: NDArray) -> None:
    if written != members.shape[0]:
        raise AssertionError(f"laid out {written:,} of {members.shape[0]:,} members: overlapping micro-batches")


def _float_sum(values: NDArray[np.float64]) -> float:
    """Left-to-right float sum, as the kernels add."""
    total = 0.0
    for value in values.tolist():
        total += value
    return total
