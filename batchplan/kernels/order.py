"""Stable orders by decreasing integer key: a counting sort when the keys are small."""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["counting_pays", "order_by_decreasing"]


@njit(cache=True, nogil=True, inline="always")
def counting_pays(max_key, count):
    """Whether a counting sort over ``0..max_key`` beats a comparison sort of ``count`` keys:
    when the range is not much longer than the keys (~3x faster there, the same order)."""
    return max_key <= 4 * count


@njit(cache=True, nogil=True)
def order_by_decreasing(keys, max_key, by_counting, counts, order):
    """Fill ``order[:len(keys)]`` with the positions of ``keys`` by decreasing key; equal keys
    keep their order (stable).

    Args:
        keys: integers in ``0..max_key``.
        max_key: the largest possible key.
        by_counting: a counting sort over ``0..max_key`` (when `counting_pays`; the same
            order as the comparison sort, faster).
        counts: int64 scratch, ``max_key + 2`` long (unused without ``by_counting``).
        order: int64, at least as long as ``keys``.
    """
    n = keys.shape[0]
    if not by_counting:
        # Copied in a loop: an array assigned to a slice makes numba compile the message of
        # its shape check (str of ints), ~2-4 s of a first run.
        positions = np.argsort(-keys, kind="mergesort")  # stable: depends only on the input order
        for i in range(n):
            order[i] = positions[i]
        return
    counts[:] = 0
    for i in range(n):
        if keys[i] < 0 or keys[i] > max_key:
            raise ValueError("order_by_decreasing: a key is outside 0..max_key")
        counts[max_key - keys[i] + 1] += 1
    for key in range(1, max_key + 2):
        counts[key] += counts[key - 1]
    for i in range(n):
        key = max_key - keys[i]
        order[counts[key]] = i
        counts[key] += 1
