"""Per-segment reductions over CSR offsets, in plain numpy (no numba: readers use them).

Segment ``k`` is ``values[offsets[k]:offsets[k + 1]]``; empty segments reduce to 0.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["segment_max", "segment_sum"]


def segment_sum(values: NDArray, offsets: NDArray[np.int64]) -> NDArray:
    """Sum of each segment (int64 for integers, float64 for floats)."""
    dtype = np.float64 if np.issubdtype(np.asarray(values).dtype, np.floating) else np.int64
    total = np.concatenate([np.zeros(1, dtype=dtype), np.cumsum(values, dtype=dtype)])
    return total[offsets[1:]] - total[offsets[:-1]]


def segment_max(values: NDArray, offsets: NDArray[np.int64]) -> NDArray:
    """Largest value of each segment; 0 for an empty one."""
    values = np.asarray(values)
    out = np.zeros(offsets.shape[0] - 1, dtype=values.dtype)
    nonempty = np.flatnonzero(np.diff(offsets) > 0)
    if nonempty.size:
        out[nonempty] = np.maximum.reduceat(values, offsets[nonempty])
    return out
