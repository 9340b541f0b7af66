"""Group items by length and shuffle each group with caller-given random keys, O(n).

Best-fit decreasing only needs a random order *among items of equal length* (items
of one length are interchangeable), not a full permutation. A counting sort reads
the lengths sequentially, then a Fisher-Yates shuffle inside each length group
(contiguous, cache-friendly) draws its swaps from ``keys``: 32 random bits per item
that the caller makes with a seeded generator. This replaces a random permutation
of all items plus a random-access counting sort, at a third of the cost.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["length_offsets", "shuffle_by_length"]


@njit(cache=True, nogil=True)
def length_offsets(lengths, max_length):
    """Where each length's group starts when items are grouped by length (shortest first)."""
    start = np.zeros(max_length + 2, dtype=np.int64)
    for item in range(lengths.shape[0]):
        start[lengths[item] + 1] += 1
    for length in range(1, max_length + 2):
        start[length] += start[length - 1]
    return start


@njit(cache=True, nogil=True)
def shuffle_by_length(lengths, keys, max_length, items):
    """Items grouped by length (shortest first), randomly ordered within each length.

    Args:
        lengths: length of each item (every one in 0..max_length).
        keys: uint32 random bits, one per item.
        max_length: the longest possible length.
        items: int32 or int64, one per item, filled with the item indices (made by the
            caller: numpy asks for huge pages, and the writes go to a stream per length).

    Returns:
        ``start``: items of length ``s`` are at ``items[start[s]:start[s + 1]]``.
    """
    start = length_offsets(lengths, max_length)
    cursor = start.copy()
    for item in range(lengths.shape[0]):
        length = lengths[item]
        items[cursor[length]] = item
        cursor[length] += 1
    for length in range(max_length + 1):
        begin = start[length]
        for last in range(start[length + 1] - 1, begin, -1):
            # Lemire's multiply-shift maps 32 random bits onto 0..last-begin.
            pick = begin + ((np.uint64(keys[last]) * np.uint64(last - begin + 1)) >> np.uint64(32))
            swap = items[last]
            items[last] = items[pick]
            items[pick] = swap
    return start
