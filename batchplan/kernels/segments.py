"""Gather segments into CSR form; sum ranges.

A CSR grouping is ``(offsets, members)``: segment ``s`` holds
``members[offsets[s]:offsets[s + 1]]``. All O(n), stable (items keep their order).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["gather_segments", "range_sums"]


@njit(cache=True, nogil=True)
def gather_segments(members, starts, ends, order):
    """Concatenate segments ``members[starts[k]:ends[k]]`` for ``k`` in ``order`` into CSR form."""
    num_segments = order.shape[0]
    offsets = np.zeros(num_segments + 1, dtype=np.int64)
    for i in range(num_segments):
        segment = order[i]
        offsets[i + 1] = offsets[i] + ends[segment] - starts[segment]
    out = np.empty(offsets[num_segments], dtype=members.dtype)
    for i in range(num_segments):
        source = starts[order[i]]
        for position in range(offsets[i], offsets[i + 1]):  # a loop: no slice object per segment
            out[position] = members[source]
            source += 1
    return offsets, out


@njit(cache=True, nogil=True)
def range_sums(values, starts, ends, out):
    """Add ``values[starts[k]:ends[k]]`` to ``out[k]`` (zeros) for each k, left to right; ``out``'s
    dtype is the arithmetic: int64 is exact for integers (no prefix-sum array), float64 sums each
    range on its own (a prefix sum's differences would carry the rounding of everything before)."""
    for k in range(starts.shape[0]):
        for i in range(starts[k], ends[k]):
            out[k] += values[i]
    return out
