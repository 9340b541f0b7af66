"""Lay segments out in CSR form; sum ranges.

A CSR grouping is ``(offsets, members)``: segment ``s`` holds
``members[offsets[s]:offsets[s + 1]]``. All O(n), stable (items keep their order).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["gather_rows", "lay_out_segments", "range_sums", "scatter_segments", "segment_destinations"]


@njit(cache=True, nogil=True)
def lay_out_segments(members, starts, ends, order, destination, out):
    """Segments ``members[starts[k]:ends[k]]`` for ``k`` in ``order``, one after another, in
    CSR form: returns their offsets and fills ``out`` (`segment_destinations`, then
    `scatter_segments`).

    Args:
        members, starts, ends: the segments.
        order: segment ids, each at most once; segments not named are left out.
        destination: int64, one per segment: scratch, filled with where each goes (-1: left out).
        out: as long as the named segments together (made by the caller,
            `batchplan.planning.buffers`: the writes land at random).

    Returns:
        ``(offsets, written)``: the CSR offsets over ``order`` and how many members were
        written, ``len(out)`` unless ``order`` names a segment twice.
    """
    offsets = segment_destinations(starts, ends, order, destination)
    if offsets[order.shape[0]] != out.shape[0]:
        raise ValueError("lay_out_segments: out does not hold the segments exactly")
    return offsets, scatter_segments(members, starts, ends, destination, out)


@njit(cache=True, nogil=True)
def segment_destinations(starts, ends, order, destination):
    """Where each segment of ``order`` goes when they are laid one after another: fills
    ``destination`` (int64, one per segment; -1: not in ``order``) and returns the CSR
    offsets over ``order`` (int64, ``len(order) + 1``)."""
    count = order.shape[0]
    offsets = np.empty(count + 1, dtype=np.int64)
    offsets[0] = 0
    destination[:] = -1
    for i in range(count):
        segment = order[i]
        offsets[i + 1] = offsets[i] + ends[segment] - starts[segment]
        destination[segment] = offsets[i]
    return offsets


@njit(cache=True, nogil=True)
def scatter_segments(members, starts, ends, destination, out):
    """Write each segment ``members[starts[k]:ends[k]]`` at ``out[destination[k]:]`` (-1: left out).

    Written as a scatter: the segments are read in order of ``k`` (sequentially) and each is
    written at its place, rather than read at random in the order of the layout (a gather
    waits on every read; ~4x slower at 10^7 members). Returns how many members were written.
    """
    written = 0
    for segment in range(starts.shape[0]):
        target = destination[segment]
        if target < 0:
            continue
        for source in range(starts[segment], ends[segment]):  # a loop: no slice object per segment
            out[target] = members[source]
            target += 1
        written += ends[segment] - starts[segment]
    return written


@njit(cache=True, nogil=True)
def range_sums(values, starts, ends, out):
    """Add ``values[starts[k]:ends[k]]`` to ``out[k]`` (zeros) for each k, left to right; ``out``'s
    dtype is the arithmetic: int64 is exact for integers (no prefix-sum array), float64 sums each
    range on its own (a prefix sum's differences would carry the rounding of everything before)."""
    for k in range(starts.shape[0]):
        for i in range(starts[k], ends[k]):
            out[k] += values[i]
    return out


@njit(cache=True, nogil=True)
def gather_rows(space, offsets, row_starts, first_row, last_row, start, out):
    """Members ``start:start + len(out)`` in row order, of rows ``first_row:last_row`` (those
    the range meets), into ``out``: row ``r`` holds members ``offsets[r]:offsets[r + 1]``,
    which are ``space[row_starts[r]:]`` (as many); a row is one copy of a range of ``space``."""
    stop = start + out.shape[0]
    for row in range(first_row, last_row):
        low, high = max(offsets[row], start), min(offsets[row + 1], stop)
        at = row_starts[row] - offsets[row]
        for member in range(low, high):
            out[member - start] = space[at + member]
