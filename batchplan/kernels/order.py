"""Stable orders by decreasing key. Integer keys, O(n): a counting sort when the range of keys
is not much longer than the keys, else a radix sort (8-bit digits: two passes for keys below
65,536). Float keys (costs), O(n log n): a merge sort.

None calls numba's argsort: numba compiles its argsort per key type, in every process that
compiles a kernel calling it (~1.2-1.4 s of a first run for float64 keys, its helpers
included), where the merge sort here compiles in ~0.5 s; it sorts 512 costs in ~1.3x numba's
time and a step's few micro-batches faster (an epoch of 10^7 samples plans as fast). Each
gives the order of ``np.argsort(-keys, kind="stable")``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["counting_pays", "order_by_counting", "order_by_decreasing", "order_by_merging"]

_RADIX = 256  # values of one digit of `_order_by_radix`
_RUN = 16  # `order_by_merging` sorts runs of this many keys by insertion, then merges them


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


@njit(cache=True, nogil=True)
def order_by_merging(keys, order, spare):
    """Fill ``order[:len(keys)]`` with the positions of float ``keys`` by decreasing key, NaN
    last; equal keys keep their order (stable): the order of ``np.argsort(-keys,
    kind="stable")``. Runs of `_RUN` keys are sorted by insertion, then merged pairwise, pass
    after pass, between ``order`` and ``spare`` (int64 scratch, at least as long as ``keys``)."""
    n = keys.shape[0]
    for begin in range(0, n, _RUN):
        for i in range(begin, min(begin + _RUN, n)):
            j = i
            while j > begin and _before(keys[i], keys[order[j - 1]]):
                order[j] = order[j - 1]
                j -= 1
            order[j] = i
    width = np.int64(_RUN)  # np.int64: a literal would compile `_merge_runs` once more
    in_order = True  # the current order is in ``order`` (else in ``spare``)
    while width < n:
        if in_order:
            _merge_runs(keys, width, order, spare)
        else:
            _merge_runs(keys, width, spare, order)
        in_order = not in_order
        width *= 2
    if not in_order:
        for i in range(n):  # a loop, not a slice assignment (see `_order_by_radix`)
            order[i] = spare[i]


@njit(cache=True, nogil=True)
def _merge_runs(keys, width, source, target):
    """Merge each pair of sorted runs of ``width`` positions of ``source`` into ``target``; the
    left run's key first unless the right run's comes before it (stable)."""
    n = keys.shape[0]
    for begin in range(0, n, 2 * width):
        middle, end = min(begin + width, n), min(begin + 2 * width, n)
        left, right, k = begin, middle, begin
        while left < middle and right < end:
            if _before(keys[source[right]], keys[source[left]]):
                target[k] = source[right]
                right += 1
            else:
                target[k] = source[left]
                left += 1
            k += 1
        for i in range(left, middle):
            target[k] = source[i]
            k += 1
        for i in range(right, end):
            target[k] = source[i]
            k += 1


@njit(cache=True, nogil=True, inline="always")
def _before(a, b):
    """Whether key ``a`` comes before key ``b``: larger first, NaN last."""
    return a > b or (b != b and a == a)
