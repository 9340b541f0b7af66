"""Packing patterns over a length histogram: cheap bin bounds, knapsack pricing, an
exact-fill greedy, and the slot layout of a list of patterns.

A pattern is the contents of one bin as ``(length, count)`` pairs; a packing is a list of
patterns, each used ``copies`` times, in CSR form (``pattern_offsets`` over
``pattern_lengths`` / ``pattern_counts``). `lay_out_patterns` turns it into the
``(slot_bin, offsets, tokens)`` contract of `batchplan.kernels.pack.pack_bins`: slots
longest first, the slots of one length consecutive and handed to bins in bin order.

Costs, at C = max_tokens and m distinct lengths: `histogram_bounds` O(C);
`price_patterns` O(m C); `fill_exact` O(log C) per item placed, a bin's contents being
repeated while every length in it lasts (10^7 lognormal lengths at 8,192: 0.02 s, about
11,000 distinct bins); `lay_out_patterns` O(items).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from batchplan.kernels.tree import tree_add, tree_first_at_least

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
    for k in range(half + 1):
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
        tree_add(tree, size, length, np.int64(-1))
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
        shortest = tree_first_at_least(tree, size, 1)
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


@njit(cache=True, nogil=True)
def _grow(array, needed):
    """``array`` with room for ``needed`` entries (doubled when short)."""
    if needed <= array.shape[0]:
        return array
    grown = np.empty(max(needed, 2 * array.shape[0]), dtype=array.dtype)
    grown[: array.shape[0]] = array
    return grown


@njit(cache=True, nogil=True)
def fill_exact(histogram, max_tokens):
    """Pack a histogram bin after bin with `_fill_bin`, each bin's contents repeated while
    they last.

    Returns:
        ``(pattern_offsets, pattern_lengths, pattern_counts, copies)``: pattern ``p`` holds
        ``pattern_counts[i]`` items of ``pattern_lengths[i]`` for ``i`` in
        ``pattern_offsets[p]:pattern_offsets[p + 1]`` (lengths descending) and makes
        ``copies[p]`` bins.
    """
    left = histogram[: max_tokens + 1].astype(np.int64)
    tree, size = _length_tree(left, max_tokens)
    bin_lengths = np.empty(max_tokens, dtype=np.int64)
    pattern_offsets = np.zeros(1024, dtype=np.int64)
    pattern_lengths = np.empty(1024, dtype=np.int64)
    pattern_counts = np.empty(1024, dtype=np.int64)
    copies = np.empty(1024, dtype=np.int64)
    num_patterns = 0
    while tree[1] > 0:
        num_items = _fill_bin(left, tree, size, max_tokens, bin_lengths)
        contents = -np.sort(-bin_lengths[:num_items])
        more = _repeats(left, contents, num_items)
        copies = _grow(copies, num_patterns + 1)
        pattern_offsets = _grow(pattern_offsets, num_patterns + 2)
        end = pattern_offsets[num_patterns]
        pattern_lengths = _grow(pattern_lengths, end + num_items)
        pattern_counts = _grow(pattern_counts, end + num_items)
        start = 0
        while start < num_items:
            stop = start
            while stop < num_items and contents[stop] == contents[start]:
                stop += 1
            length = contents[start]
            if more > 0:
                left[length] -= more * (stop - start)
                if left[length] == 0:
                    tree_add(tree, size, length, np.int64(-1))
            pattern_lengths[end] = length
            pattern_counts[end] = stop - start
            end += 1
            start = stop
        copies[num_patterns] = 1 + more
        num_patterns += 1
        pattern_offsets[num_patterns] = end
    end = pattern_offsets[num_patterns]
    return pattern_offsets[: num_patterns + 1], pattern_lengths[:end], pattern_counts[:end], copies[:num_patterns]


@njit(cache=True, nogil=True)
def take_patterns(histogram, pattern_offsets, pattern_lengths, pattern_counts, copies):
    """Take up to ``copies[p]`` whole copies of each pattern, in order, from the histogram.

    Returns:
        ``(taken, left)``: the copies taken of each pattern and the histogram left.
    """
    left = histogram.astype(np.int64)
    taken = np.zeros(copies.shape[0], dtype=np.int64)
    for p in range(copies.shape[0]):
        most = copies[p]
        for i in range(pattern_offsets[p], pattern_offsets[p + 1]):
            most = min(most, left[pattern_lengths[i]] // pattern_counts[i])
        for i in range(pattern_offsets[p], pattern_offsets[p + 1]):
            left[pattern_lengths[i]] -= most * pattern_counts[i]
        taken[p] = most
    return taken, left


@njit(cache=True, nogil=True)
def patterns_of_bins(slot_bin, offsets, histogram, max_tokens):
    """A slot packing (`batchplan.kernels.pack.pack_bins`) as patterns, one copy per bin."""
    num_bins = offsets.shape[0] - 1
    cursor = offsets[:-1].copy()
    member_lengths = np.empty(slot_bin.shape[0], dtype=np.int64)
    slot = 0
    for length in range(max_tokens, 0, -1):
        for _ in range(histogram[length]):
            target = slot_bin[slot]
            member_lengths[cursor[target]] = length
            cursor[target] += 1
            slot += 1
    # Members of a bin are longest first: runs of one length become one pattern entry.
    pattern_offsets = np.zeros(num_bins + 1, dtype=np.int64)
    pattern_lengths = np.empty(slot_bin.shape[0], dtype=np.int64)
    pattern_counts = np.empty(slot_bin.shape[0], dtype=np.int64)
    end = 0
    for target in range(num_bins):
        for i in range(offsets[target], offsets[target + 1]):
            if i > offsets[target] and member_lengths[i] == member_lengths[i - 1]:
                pattern_counts[end - 1] += 1
            else:
                pattern_lengths[end] = member_lengths[i]
                pattern_counts[end] = 1
                end += 1
        pattern_offsets[target + 1] = end
    return pattern_offsets, pattern_lengths[:end], pattern_counts[:end], np.ones(num_bins, dtype=np.int64)


@njit(cache=True, nogil=True)
def lay_out_patterns(histogram, max_tokens, pattern_offsets, pattern_lengths, pattern_counts, copies, slot_bin):
    """Patterns as slots: ``(slot_bin, offsets, tokens)`` (the contract of `pack_bins`).

    Bins are the patterns' copies in pattern order; the slots of each length go to bins
    in bin order. The patterns must use exactly the histogram's items. ``slot_bin`` (one per
    slot, int32 or int64) is filled.
    """
    slot_start = np.zeros(max_tokens + 2, dtype=np.int64)  # first slot of each length
    for length in range(max_tokens, 0, -1):
        slot_start[length - 1] = slot_start[length] + histogram[length]
    num_bins = copies.sum()
    offsets = np.zeros(num_bins + 1, dtype=np.int64)
    tokens = np.zeros(num_bins, dtype=np.int64)
    cursor = slot_start[1:].copy()  # next free slot of length s at cursor[s - 1]
    target = 0
    for p in range(copies.shape[0]):
        size = 0
        volume = 0
        for i in range(pattern_offsets[p], pattern_offsets[p + 1]):
            size += pattern_counts[i]
            volume += pattern_lengths[i] * pattern_counts[i]
        for _ in range(copies[p]):
            for i in range(pattern_offsets[p], pattern_offsets[p + 1]):
                length = pattern_lengths[i]
                for _ in range(pattern_counts[i]):
                    slot_bin[cursor[length - 1]] = target
                    cursor[length - 1] += 1
            offsets[target + 1] = offsets[target] + size
            tokens[target] = volume
            target += 1
    return slot_bin, offsets, tokens
