"""Segment helpers: gather segments into CSR form, reduce segments and labels.

A CSR grouping is ``(offsets, members)``: segment ``s`` holds
``members[offsets[s]:offsets[s + 1]]``. All O(n), stable (items keep their order).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["gather_segments", "sum_by_label", "sum_segments"]


@njit(cache=True)
def sum_by_label(labels, values, num_labels):
    """Sum of ``values`` per label as int64."""
    out = np.zeros(num_labels, dtype=np.int64)
    for i in range(labels.shape[0]):
        out[labels[i]] += values[i]
    return out


@njit(cache=True)
def sum_segments(values, members, starts, ends):
    """Sum of ``values[members[starts[k]:ends[k]]]`` for each segment ``k``, as int64."""
    out = np.zeros(starts.shape[0], dtype=np.int64)
    for segment in range(starts.shape[0]):
        total = 0
        for i in range(starts[segment], ends[segment]):
            total += values[members[i]]
        out[segment] = total
    return out


@njit(cache=True)
def gather_segments(members, starts, ends, order):
    """Concatenate segments ``members[starts[k]:ends[k]]`` for ``k`` in ``order`` into CSR form."""
    num_segments = order.shape[0]
    offsets = np.zeros(num_segments + 1, dtype=np.int64)
    for i in range(num_segments):
        segment = order[i]
        offsets[i + 1] = offsets[i] + ends[segment] - starts[segment]
    out = np.empty(offsets[num_segments], dtype=members.dtype)
    for i in range(num_segments):
        segment = order[i]
        out[offsets[i] : offsets[i + 1]] = members[starts[segment] : ends[segment]]
    return offsets, out
