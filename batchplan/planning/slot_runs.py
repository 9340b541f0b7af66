"""A compressed epoch's bins: the bin of each slot, run-length encoded (`batchplan.kernels.slot_runs`)
while the epoch is scheduled (`batchplan.planning.bins.PackedBins.compress`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from numpy.typing import NDArray

from batchplan.kernels.slot_runs import count_runs, decode_runs, encode_runs
from batchplan.planning.buffers import new_buffer

__all__ = ["SLOT_RUN_PARTS", "SlotRuns"]

# Parts a compressed epoch's runs are kept in (`SlotRuns`): each freed once decoded, so decoding
# holds the bins and an eighth of the runs (~0.09 bytes per slot), not all of them (0.7).
SLOT_RUN_PARTS = 8


class SlotRuns:
    """The bin of each slot, run-length encoded (`batchplan.kernels.slot_runs`) in `SLOT_RUN_PARTS`
    parts, each with arrays of its own: each run's bin (the bins' dtype) and its slots (uint16).
    Decoding frees each part's runs once it is decoded, so that the bins and their runs are
    never all held at once (the peak of laying a large epoch out holds the bins)."""

    def __init__(self, parts: list[tuple[NDArray, NDArray[np.uint16]] | None], count: int, dtype, threads: int):
        self.parts, self.count, self.dtype, self.threads = parts, count, np.dtype(dtype), threads

    @classmethod
    def encode(cls, slot_bin: NDArray[np.integer], threads: int) -> SlotRuns:
        num_parts = SLOT_RUN_PARTS

        def encode_part(part: int) -> tuple[NDArray, NDArray[np.uint16]]:
            count = count_runs(slot_bin, part, num_parts)
            run_bin, run_length = np.empty(count, dtype=slot_bin.dtype), np.empty(count, dtype=np.uint16)
            encode_runs(slot_bin, run_bin, run_length, part, num_parts)
            return run_bin, run_length

        parts: list[tuple[NDArray, NDArray[np.uint16]] | None] = list(_each_part(encode_part, num_parts, threads))
        return cls(parts, int(slot_bin.shape[0]), slot_bin.dtype, threads)

    def decode(self) -> NDArray[np.integer]:
        """The bin of each slot, in a new array (the runs are freed)."""
        slot_bin = new_buffer(self.count, self.dtype)
        num_parts = len(self.parts)

        def decode_part(part: int) -> int:
            runs = self.parts[part]
            if runs is None:
                raise ValueError("the runs were decoded already")
            self.parts[part] = None
            return decode_runs(*runs, slot_bin, part, num_parts)

        written = list(_each_part(decode_part, num_parts, self.threads))
        if sum(written) != self.count or min(written) < 0:
            raise AssertionError(f"runs decoded into {sum(written):,} of {self.count:,} slots")
        return slot_bin


def _each_part(work: Callable[[int], Any], num_parts: int, threads: int) -> Iterator[Any]:
    """``work(part)`` for each part, in order, on up to ``threads`` threads."""
    if threads <= 1:
        return map(work, range(num_parts))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return iter(list(pool.map(work, range(num_parts))))
