"""Stable orders by decreasing integer key, O(n): a counting sort when the range of keys is
not much longer than the keys, else a radix sort (8-bit digits: two passes for keys below
65,536).

Neither calls numba's argsort: a caller that sorts only integer keys compiles no comparison
sort on its first run (numba compiles its argsort per key type, in every process that
compiles a kernel calling it: ~1 s of a first run each).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["counting_pays", "order_by_counting", "order_by_decreasing"]

_RADIX = 256  # values of one digit of `_order_by_radix`


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
        by_counting: a counting sort over ``0..max_key`` (when `counting_pays`), else a
            radix sort: the same order.
        counts: int64 scratch, ``max_key + 2`` long (unused without ``by_counting``).
        order: int64, at least as long as ``keys``.
    """
    if by_counting:
        order_by_counting(keys, max_key, counts, order)
    else:
        _order_by_radix(keys, max_key, order)


@njit(cache=True, nogil=True, inline="always")
def _order_by_radix(keys, max_key, order):
    """`order_by_decreasing` by a least-significant-digit radix sort of ``max_key - key``
    (each pass stable, so the whole is): one pass per 8 bits of ``max_key``."""
    n = keys.shape[0]
    spare = np.empty(n, dtype=np.int64)
    counts = np.empty(_RADIX + 1, dtype=np.int64)
    for i in range(n):
        if keys[i] < 0 or keys[i] > max_key:
            raise ValueError("order_by_decreasing: a key is outside 0..max_key")
        order[i] = i
    shift = 0
    in_order = True  # the current order is in ``order`` (else in ``spare``)
    while (max_key >> shift) > 0:
        source, target = (order, spare) if in_order else (spare, order)
        counts[:] = 0
        for i in range(n):
            counts[((max_key - keys[source[i]]) >> shift & (_RADIX - 1)) + 1] += 1
        for digit in range(1, _RADIX + 1):
            counts[digit] += counts[digit - 1]
        for i in range(n):
            digit = (max_key - keys[source[i]]) >> shift & (_RADIX - 1)
            target[counts[digit]] = source[i]
            counts[digit] += 1
        in_order = not in_order
        shift += 8
    if not in_order:
        # A loop: an array assigned to a slice makes numba compile the message of its shape
        # check (str of ints), ~2-4 s of a first run.
        for i in range(n):
            order[i] = spare[i]


@njit(cache=True, nogil=True, inline="always")
def order_by_counting(keys, max_key, counts, order):
    """`order_by_decreasing` by a counting sort over ``0..max_key`` (``counts``: int64
    scratch, ``max_key + 2`` long). Inlined into its callers: no kernel of its own to compile."""
    n = keys.shape[0]
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
