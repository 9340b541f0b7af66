"""Interleave sources' micro-batches so that every step holds each source's token share.

The micro-batches are taken in blocks of ``seats`` (a step's micro-batches). In each block a
source takes the floor or the ceiling of its quota, ``seats x its micro-batches / all
micro-batches`` (so no step is off by a whole micro-batch of any source), and which source
takes each place follows stride scheduling on tokens: the source whose next micro-batch is
due first, ``(tokens taken + half of the next) / share`` smallest, which keeps the run's
cumulative tokens of each source within about one micro-batch of ``share x tokens``. Every
source ends with the last position. O(n x sources).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["interleave_by_share"]


@njit(cache=True, nogil=True)
def interleave_by_share(part_offsets, tokens, shares, seats, out):
    """Write into ``out`` the micro-batch ids of every part, interleaved by share.

    Args:
        part_offsets: int64, ``sources + 1`` bounds: source ``s`` holds micro-batches
            ``part_offsets[s]:part_offsets[s + 1]``, in the order they are to be taken.
        tokens: tokens of every micro-batch (int64).
        shares: float64 token share of each source (> 0 where the source has micro-batches).
        seats: micro-batches per block (a step's), >= 1.
        out: int64, ``part_offsets[-1]`` long. Ties go to the lowest source.
    """
    num_sources = shares.shape[0]
    total = out.shape[0]
    cursor = part_offsets[:-1].copy()
    taken = np.zeros(num_sources, dtype=np.float64)
    low = np.zeros(num_sources, dtype=np.int64)
    high = np.zeros(num_sources, dtype=np.int64)
    in_block = np.zeros(num_sources, dtype=np.int64)
    for block in range(0, total, seats):
        size = min(seats, total - block)
        for source in range(num_sources):
            quota = size * (part_offsets[source + 1] - part_offsets[source]) / total
            low[source] = int(np.floor(quota))
            high[source] = int(np.ceil(quota))
            in_block[source] = 0
        for place in range(size):
            owed = 0
            for source in range(num_sources):
                left = part_offsets[source + 1] - cursor[source]
                owed += max(0, min(low[source], in_block[source] + left) - in_block[source])
            must = owed >= size - place  # every place left goes to a source short of its floor
            best = _pick(part_offsets, tokens, shares, cursor, taken, low, high, in_block, must, True)
            if best < 0:  # quotas cannot be met (sources ran out): any source with micro-batches left
                best = _pick(part_offsets, tokens, shares, cursor, taken, low, high, in_block, False, False)
            out[block + place] = cursor[best]
            taken[best] += tokens[cursor[best]]
            cursor[best] += 1
            in_block[best] += 1


@njit(cache=True, nogil=True, inline="always")
def _pick(part_offsets, tokens, shares, cursor, taken, low, high, in_block, must, bounded):
    """The source due first among those with micro-batches left (``bounded``: below their
    ceiling, and with ``must`` below their floor); -1 when none."""
    best = -1
    best_due = np.inf
    for source in range(shares.shape[0]):
        if cursor[source] >= part_offsets[source + 1]:
            continue
        if bounded and (in_block[source] >= high[source] or (must and in_block[source] >= low[source])):
            continue
        due = (taken[source] + 0.5 * tokens[cursor[source]]) / shares[source]
        if due < best_due:
            best, best_due = source, due
    return best
