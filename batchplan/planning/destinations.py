"""Where micro-batches go when their members are laid out one after another (CSR), and the
check that a layout wrote every member once."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["Destinations", "check_written"]


class Destinations:
    """Where micro-batches go when laid out one after another (a layout's ``destinations``):
    ``offsets`` (CSR over the micro-batches in order), a destination per bin or micro-batch
    (-1: not laid out whole; scratch, taken once), and ``ranges``: for packed bins the
    pieces ``(starts, ends, destinations)`` in member space, sorted by start; for laid-out
    micro-batches every micro-batch's ``(starts, ends)``."""

    def __init__(self, offsets: NDArray[np.int64], destination: NDArray[np.int64], ranges: tuple) -> None:
        self.offsets, self.ranges = offsets, ranges
        self._destination: NDArray[np.int64] | None = destination

    @property
    def count(self) -> int:
        return int(self.offsets[-1])

    def take_destination(self) -> NDArray[np.int64]:
        """The per-bin destinations, handed over (overwritten as they are used; not kept here)."""
        destination, self._destination = self._destination, None
        if destination is None:
            raise ValueError("the destinations were used already")
        return destination


def check_written(written: int, members: NDArray) -> None:
    if written != members.shape[0]:
        raise AssertionError(f"laid out {written:,} of {members.shape[0]:,} members: overlapping micro-batches")
