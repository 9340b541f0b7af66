"""Packed micro-batches before their entries are laid out: best-fit decreasing's bins, with
the methods of a `batchplan.planning.micro_batches` layout."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from batchplan.kernels.pack import (
    bin_destinations,
    bin_item_sums,
    bin_length_sums,
    bin_members,
    fill_bins,
    scatter_bins,
)
from batchplan.planning.buffers import new_buffer, scratch_or_new
from batchplan.planning.threads import run_in_parts

if TYPE_CHECKING:
    from batchplan.planning.micro_batches import MicroBatches

__all__ = ["PackedBins", "check_written"]


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

    def formed_tokens(self, starts: NDArray[np.int64], ends: NDArray[np.int64]) -> NDArray[np.int64]:
        return self.tokens

    def length_sums(self, value: Callable, batches: MicroBatches) -> NDArray[np.float64]:
        """Per micro-batch, ``sum(value(length))`` over its entries: per bin from a table of
        ``value`` over 0..capacity, then the pieces the last round split off."""
        table = value(np.arange(self.capacity + 1, dtype=np.float64))
        per_bin = bin_length_sums(table, self.start, self.slot_bin, self.num_bins, self.capacity)
        return self._with_pieces(per_bin, batches, lambda _, lengths: _float_sum(table[lengths]))

    def entry_sums(self, values: NDArray[np.integer], batches: MicroBatches) -> NDArray[np.int64]:
        """Per micro-batch, ``sum(values[entry])`` over its entries."""
        per_bin = bin_item_sums(values, self.items, self.start, self.slot_bin, self.num_bins, self.capacity)
        return self._with_pieces(per_bin, batches, lambda members, _: values[members].sum(dtype=np.int64))

    def _with_pieces(self, per_bin: NDArray, batches: MicroBatches, reduce: Callable) -> NDArray:
        """Per-bin values for the bins, then ``reduce(members, lengths)`` for the later pieces."""
        if batches.count == self.num_bins:
            return per_bin
        pieces = batches.ranges(np.arange(self.num_bins, batches.count))
        return np.concatenate([per_bin, np.array([reduce(*piece) for piece in pieces], dtype=per_bin.dtype)])

    def gather(self, batches: MicroBatches, order, sizes, threads: int, scratch) -> tuple[NDArray[np.int64], NDArray]:
        """`MicroBatches.gather`: whole bins scattered straight to their rows (`scatter_bins`),
        pieces from their ranges, on ``threads`` threads."""
        offsets = np.empty(order.shape[0] + 1, dtype=np.int64)
        destination = scratch_or_new(scratch, self.num_bins)
        destination.fill(-1)
        run_in_parts(bin_destinations, threads, order, sizes, offsets, destination)
        pieces = np.flatnonzero(order >= self.num_bins)
        pieces = pieces[sizes[pieces] > 0]
        piece_starts, piece_ends = batches.bounds(order[pieces])
        by_start = np.argsort(piece_starts, kind="stable")
        members = new_buffer(offsets[-1], self.items.dtype)
        written = run_in_parts(
            scatter_bins, threads,
            self.items, self.start, self.slot_bin, self.offsets, destination, piece_starts[by_start],
            piece_ends[by_start], offsets[pieces][by_start], self.capacity, members,
        )  # fmt: skip
        check_written(sum(written), members)
        return offsets, members


def check_written(written: int, members: NDArray) -> None:
    if written != members.shape[0]:
        raise AssertionError(f"laid out {written:,} of {members.shape[0]:,} members: overlapping micro-batches")


def _float_sum(values: NDArray[np.float64]) -> float:
    """Left-to-right float sum, as the kernels add."""
    total = 0.0
    for value in values.tolist():
        total += value
    return total
