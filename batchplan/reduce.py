"""Per-segment reductions over CSR offsets, in plain numpy (no numba: readers use them).

Segment ``k`` is ``values[offsets[k]:offsets[k + 1]]``; empty segments reduce to 0.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["segment_max", "segment_sum"]


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
