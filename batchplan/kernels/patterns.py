"""Packing patterns over a length histogram: cheap bin bounds, knapsack pricing, an
exact-fill greedy, and the slot layout of a list of patterns.

A pattern is the contents of one bin as ``(length, count)`` pairs; a packing is a list of
patterns, each used ``copies`` times, in CSR form (``pattern_offsets`` over
``pattern_lengths`` / ``pattern_counts``). `lay_out_patterns` turns it into the
``(slot_bin, offsets, tokens)`` contract of `batchplan.kernels.pack.pack_bins`: slots
longest first, the slots of one length consecutive and handed to bins in bin order.

Costs, at C = max_tokens and m distinct lengths: `histogram_bounds` O(C);
`price_patterns` O(m C) (0.02 s at m = C = 4,096); `fill_exact` O(log C) per item
placed, a bin's contents being repeated while every length in it lasts (10^7
lognormal lengths at 8,192: about 0.3 s).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from batchplan.kernels.pack import _tree_add, _tree_first_at_least

__all__ = ["fill_exact", "histogram_bounds", "lay_out_patterns", "price_patterns", "take_patterns"]

# Candidate first items tried per bin when completing it with an exact pair.
PAIR_TRIES = 64


@njit(cache=True, nogil=True)
def histogram_bounds(histogram, max_tokens):
    """``(volume, l2)``: ceil(tokens / C) and Martello and Toth's L2 (>= volume, and >= the
    number of items longer than C / 2).

    L2 at a threshold k: items longer than C - k each fill a bin alone; items in
    (C / 2, C - k] each need a bin of their own, whose free space only items in
    [k, C / 2] can use; what of those does not fit there needs whole bins.
    """
    count_above = np.zeros(max_tokens + 2, dtype=np.int64)  # items of length >= s
    tokens_above = np.zeros(max_tokens + 2, dtype=np.int64)
    for length in range(max_tokens, 0, -1):
        count_above[length] = count_above[length + 1] + histogram[length]
        tokens_above[length] = tokens_above[length + 1] + length * histogram[length]
    total = tokens_above[1]
    volume = (total + max_tokens - 1) // max_tokens
    half = max_tokens // 2
    best = volume
    for k in range(0, half + 1):
        low = max(k, 1)
        alone = count_above[max_tokens - k + 1]  # longer than C - k
        big = count_above[half + 1] - alone  # in (C / 2, C - k]
        big_tokens = tokens_above[half + 1] - tokens_above[max_tokens - k + 1]
        small_tokens = tokens_above[low] - tokens_above[half + 1]  # in [k, C / 2]
        spill = small_tokens - (big * max_tokens - big_tokens)
        bound = alone + big + max(0, (spill + max_tokens - 1) // max_tokens)
        best = max(best, bound)
    return volume, best


@njit(cache=True, nogil=True)
def _best_values(sizes, values, max_tokens):
    """Unbounded knapsack over all capacities: ``(best, choice)``; ``best[w]`` is the most
    value that fits in ``w`` and ``choice[w]`` the last item of it (-1: as ``w - 1``).
    ``sizes`` ascending."""
    best = np.zeros(max_tokens + 1, dtype=np.float64)
    choice = np.full(max_tokens + 1, -1, dtype=np.int64)
    for capacity in range(1, max_tokens + 1):
        value = best[capacity - 1]
        arg = -1
        for i in range(sizes.shape[0]):
            size = sizes[i]
            if size > capacity:
                break
            candidate = best[capacity - size] + values[i]
            if candidate > value:
                value = candidate
                arg = i
        best[capacity] = value
        choice[capacity] = arg
    return best, choice


@njit(cache=True, nogil=True)
def price_patterns(sizes, values, max_tokens, num_patterns):
    """Knapsack pricing for column generation.

    Args:
        sizes: item lengths, ascending (int64).
        values: their values (float64, > 0).
        max_tokens: capacity.
        num_patterns: how many patterns to return.

    Returns:
        ``(most, patterns, pattern_values)``: the most value any pattern holds (exact up to
        float rounding), and for the ``num_patterns`` items of highest "best pattern holding
        this item", that pattern (int64 counts per item, one row each) and its value.
    """
    best, choice = _best_values(sizes, values, max_tokens)
    num_items = sizes.shape[0]
    score = np.full(num_items, -1.0)
    for i in range(num_items):
        if sizes[i] <= max_tokens:
            score[i] = best[max_tokens - sizes[i]] + values[i]
    order = np.argsort(-score, kind="mergesort")[:num_patterns]
    patterns = np.zeros((order.shape[0], num_items), dtype=np.int64)
    pattern_values = np.empty(order.shape[0], dtype=np.float64)
    for row in range(order.shape[0]):
        item = order[row]
        patterns[row, item] += 1
        pattern_values[row] = score[item]
        capacity = max_tokens - sizes[item]
        while capacity > 0:
            last = choice[capacity]
            if last < 0:
                capacity -= 1
            else:
                patterns[row, last] += 1
                capacity -= sizes[last]
    return best[max_tokens], patterns, pattern_values


@njit(cache=True, nogil=True)
def _tree_last_at_most(tree, size, leaf):
    """Largest leaf index <= ``leaf`` with a non-zero count, or -1."""
    if leaf < 0:
        return -1
    node = leaf + size
    if tree[node] > 0:
        return leaf
    # Climb until a left sibling holds something, then walk down its rightmost path.
    while node > 1:
        if node & 1 == 1 and tree[node - 1] > 0:
            node -= 1
            while node < size:
                node = 2 * node + 1 if tree[2 * node + 1] > 0 else 2 * node
            return node - size
        node >>= 1
    return -1


@njit(cache=True, nogil=True)
def _length_tree(histogram, max_tokens):
    """A segment tree over lengths 0..C counting the non-empty ones: ``(tree, size)``."""
    size = 1
    while size < max_tokens + 1:
        size <<= 1
    tree = np.zeros(2 * size, dtype=np.int64)
    for length in range(1, max_tokens + 1):
        if histogram[length] > 0:
            tree[length + size] = 1
    for node in range(size - 1, 0, -1):
        tree[node] = tree[2 * node] + tree[2 * node + 1]
    return tree, size


@njit(cache=True, nogil=True)
def _take(left, tree, size, length, count, bin_lengths, num_items):
    """Take ``count`` items of ``length`` into the bin being filled; returns its new item count."""
    left[length] -= count
    if left[length] == 0:
        _tree_add(tree, size, length, -1)
    for _ in range(count):
        bin_lengths[num_items] = length
        num_items += 1
    return num_items


@njit(cache=True, nogil=True)
def _exact_pair(left, tree, size, residual, largest):
    """The longest ``a <= largest`` with ``a + b == residual``, ``b <= a``, both available
    (``PAIR_TRIES`` candidates at most), or -1."""
    first = _tree_last_at_most(tree, size, min(largest, residual - 1))
    for _ in range(PAIR_TRIES):
        if first < 0 or 2 * first < residual:
            return -1
        second = residual - first
        if left[second] > (1 if second == first else 0):
            return first
        first = _tree_last_at_most(tree, size, first - 1)
    return -1


@njit(cache=True, nogil=True)
def _fill_bin(left, tree, size, max_tokens, bin_lengths):
    """Fill one bin from the lengths ``left``: the longest item that fits, ending on an exact
    single or pair when one exists, never leaving a gap shorter than every item left when
    another choice fits. Returns how many items it took (lengths in ``bin_lengths``)."""
    residual = max_tokens
    num_items = 0
    while residual > 0:
        if left[residual] > 0:
            return _take(left, tree, size, residual, 1, bin_lengths, num_items)
        largest = _tree_last_at_most(tree, size, residual)
        if largest < 0:
            break
        if residual <= 2 * largest:
            first = _exact_pair(left, tree, size, residual, largest)
            if first >= 0:
                num_items = _take(left, tree, size, first, 1, bin_lengths, num_items)
                return _take(left, tree, size, residual - first, 1, bin_lengths, num_items)
        shortest = _tree_first_at_least(tree, size, 1)
        keeps_gap = _tree_last_at_most(tree, size, residual - shortest)
        if keeps_gap > 0:
            largest = keeps_gap
        num_items = _take(left, tree, size, largest, 1, bin_lengths, num_items)
        residual -= largest
    return num_items


@njit(cache=True, nogil=True)
def _repeats(left, bin_lengths, num_items):
    """How many more times the bin just filled can be filled the same way: while every
    length in it lasts, the greedy sees the same non-empty lengths and repeats itself."""
    repeats = np.iinfo(np.int64).max
    start = 0
    while start < num_items:
        end = start
        while end < num_items and bin_lengths[end] == bin_lengths[start]:
            end += 1
        repeats = min(repeats, left[bin_lengths[start]] // (end - start))
        start = end
    return repeats
