"""Reductions in plain numpy (no numba: readers use them): per segment of CSR offsets
(segment ``k`` is ``values[offsets[k]:offsets[k + 1]]``; empty segments reduce to 0), and
per group of unsorted labels."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["segment_max", "segment_sum", "sum_by_group"]


def segment_sum(values: NDArray, offsets: NDArray[np.int64]) -> NDArray:
    """Sum of each segment: exact int64 for integers; float64 segment by segment for floats
    (a prefix sum's differences would carry the rounding of everything before)."""
    values = np.asarray(values)
    if np.issubdtype(values.dtype, np.floating):
        out = np.zeros(offsets.shape[0] - 1, dtype=np.float64)
        nonempty = np.flatnonzero(np.diff(offsets) > 0)
        if nonempty.size:
            out[nonempty] = np.add.reduceat(values.astype(np.float64, copy=False), offsets[nonempty])
        return out
    total = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(values, dtype=np.int64)])
    return total[offsets[1:]] - total[offsets[:-1]]


def segment_max(values: NDArray, offsets: NDArray[np.int64]) -> NDArray:
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
