"""Reductions in plain numpy (no numba: readers use them): per segment of CSR offsets
(segment ``k`` is ``values[offsets[k]:offsets[k + 1]]``; empty segments reduce to 0), per
group of unsorted labels, and occurrences into a small saturating counter."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["add_counts", "segment_max", "segment_sum", "sum_by_group"]


def segment_sum(values: NDArray, offsets: NDArray[np.integer]) -> NDArray:
    """Sum of each segment: exact int64 for integers; float64 segment by segment for floats
    (a prefix sum's differences would carry the rounding of everything before)."""
    values = np.asarray(values)
    if np.issubdtype(values.dtype, np.floating):
        out = np.zeros(offsets.shape[0] - 1, dtype=np.float64)
        nonempty = np.flatnonzero(np.diff(offsets) > 0)
        if nonempty.size:
            out[nonempty] = np.add.reduceat(values.astype(np.float64, copy=False), offsets[nonempty])
        return out
    total = np.zeros(values.shape[0] + 1, dtype=np.int64)
    np.cumsum(values, dtype=np.int64, out=total[1:])  # with ``out``, numpy casts int32 10x faster
    return total[offsets[1:]] - total[offsets[:-1]]


def segment_max(values: NDArray, offsets: NDArray[np.integer]) -> NDArray:
    """Largest value of each segment; 0 for an empty one."""
    values = np.asarray(values)
    out = np.zeros(offsets.shape[0] - 1, dtype=values.dtype)
    nonempty = np.flatnonzero(np.diff(offsets) > 0)
    if nonempty.size:
        out[nonempty] = np.maximum.reduceat(values, offsets[nonempty])
    return out


def sum_by_group(groups: NDArray[np.integer], values: NDArray, num_groups: int) -> NDArray:
    """Sum of ``values`` per label in ``groups`` (each in ``0..num_groups - 1``, any order):
    exact int64 for integers, float64 for floats."""
    dtype = np.float64 if np.issubdtype(np.asarray(values).dtype, np.floating) else np.int64
    sums = np.zeros(num_groups, dtype=dtype)
    np.add.at(sums, groups, values)
    return sums


def add_counts(counts: NDArray[np.unsignedinteger], values: NDArray[np.integer], limit: int) -> None:
    """Add how often each value occurs in ``values`` to ``counts[value]``, in place, stopping at
    ``limit`` (at most ``counts``' largest value). Exact where ``counts[values] += 1`` counts a
    repeated value once; sorts ``values``: for a few million at a time."""
    if values.size == 0:
        return
    unique, times = np.unique(values, return_counts=True)
    counts[unique] = np.minimum(counts[unique].astype(np.int64) + times, limit)
