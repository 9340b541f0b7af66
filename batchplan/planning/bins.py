"""Packed micro-batches before their entries are laid out: best-fit decreasing's bins."""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import NDArray

from batchplan.kernels.pack import bin_item_sums, bin_length_sums, bin_members, fill_bins

__all__ = ["PackedBins"]


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
