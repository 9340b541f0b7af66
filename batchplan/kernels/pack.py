"""Best-fit-decreasing bin packing over integer lengths, O(n log C).

Items are taken longest first; each goes into the open bin whose residual capacity
is the smallest that still fits it (a new bin when none fits). Open bins sit in one
stack per residual capacity, and a segment tree over capacities 0..C finds "the
smallest non-empty residual >= length" in O(log C).

Items of equal length are interchangeable, so the packing runs on the length
histogram and places "slots" (a length in a bin); items are handed to slots at the
end, the k-th slot of length s getting the k-th item of length s in the caller's
permutation. A seeded permutation thus gives a different, equally good,
sample-to-bin assignment each epoch. A run of equal lengths that can each take
only one place in a bin is placed in one step (every bin at that residual is
equivalent), which keeps 16 M Wikipedia lengths near a second.

On the shared Wikipedia lengths at C = 512 this packs 99.95 % full (LPFHP: 99.81 %).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from batchplan.kernels.shuffle import length_offsets

__all__ = ["pack_grouped", "pack_items", "pack_segments"]


@njit(cache=True, nogil=True)
def _tree_add(tree, size, leaf, delta):
    node = leaf + size
    while node > 0:
        tree[node] += delta
        node >>= 1


@njit(cache=True, nogil=True)
def _tree_first_at_least(tree, size, leaf):
    """Smallest leaf index >= ``leaf`` with a non-zero count, or -1."""
    node = leaf + size
    if tree[node] > 0:
        return leaf
    # Climb until a right sibling holds something, then walk down its leftmost path.
    while node > 1:
        if node & 1 == 0 and tree[node + 1] > 0:
            node += 1
            while node < size:
                node = 2 * node if tree[2 * node] > 0 else 2 * node + 1
            return node - size
        node >>= 1
    return -1


@njit(cache=True, nogil=True)
def _push(head, below, tree, size, target, residual):
    """Put bin ``target`` on the stack of its residual (a full bin takes nothing more)."""
    if residual > 0:
        below[target] = head[residual]
        head[residual] = target
        _tree_add(tree, size, residual, 1)


@njit(cache=True, nogil=True)
def _best_fit_decreasing(histogram, max_tokens, index):
    """Pack a histogram of lengths; returns (slot_bin, num_bins): the bin of each slot in
    placement order. Slots are placed longest first, so slot k's length follows from the
    histogram. ``index`` is an array whose dtype (int32 or int64) bins are counted in.
    """
    num_items = histogram.sum()
    slot_bin = np.empty(num_items, dtype=index.dtype)
    size = 1
    while size < max_tokens + 1:
        size <<= 1
    tree = np.zeros(2 * size, dtype=np.int64)
    # One stack of open bins per residual: head[r] -> bin, below[bin] -> next bin down.
    head = np.full(max_tokens + 1, -1, dtype=np.int64)
    # At most one bin ends up half full or less (an item opening a second such bin
    # would have fit the first), so bins <= 2 tokens / max_tokens + 1.
    total = 0
    for length in range(max_tokens + 1):
        total += length * histogram[length]
    below = np.empty(min(num_items, 2 * total // max_tokens + 2), dtype=index.dtype)
    num_bins = 0
    slot = 0
    for length in range(max_tokens, 0, -1):
        left = histogram[length]
        while left > 0:
            fit = _tree_first_at_least(tree, size, length)
            if fit < 0 or fit - length >= length:
                # One bin takes items of this length until it cannot fit another: no other
                # bin has a residual in [length, fit), so it stays the best fit meanwhile.
                if fit < 0:  # nothing fits: open a bin
                    target = num_bins
                    num_bins += 1
                    fit = max_tokens
                else:
                    target = head[fit]
                    head[fit] = below[target]
                    _tree_add(tree, size, fit, -1)
                take = min(left, fit // length)
                for _ in range(take):
                    slot_bin[slot] = target
                    slot += 1
                _push(head, below, tree, size, target, fit - take * length)
            else:
                # Every bin at residual `fit` takes exactly one item of this length, in
                # stack order: the next item's best fit is the next bin of that stack.
                take = min(left, tree[fit + size])
                remaining = fit - length
                for _ in range(take):
                    target = head[fit]
                    head[fit] = below[target]
                    if remaining > 0:
                        below[target] = head[remaining]
                        head[remaining] = target
                    slot_bin[slot] = target
                    slot += 1
                _tree_add(tree, size, fit, -take)
                if remaining > 0:
                    _tree_add(tree, size, remaining, take)
            left -= take
    return slot_bin, num_bins


@njit(cache=True, nogil=True)
def _items_by_length(lengths, order, max_tokens):
    """Counting sort of ``order`` by length: (items, start) with length-s items at start[s]:start[s+1]."""
    start = length_offsets(lengths, max_tokens)
    cursor = start.copy()
    items = np.empty(order.shape[0], dtype=order.dtype)
    for item in order:
        length = lengths[item]
        items[cursor[length]] = item
        cursor[length] += 1
    return items, start


@njit(cache=True, nogil=True)
def pack_segments(lengths, order, max_tokens):
    """Best-fit decreasing, as micro-batches.

    Args:
        lengths: length of each item (every one in 1..max_tokens).
        order: a permutation of item indices (int32 or int64); breaks ties among equal lengths.
        max_tokens: bin capacity.

    Returns:
        ``(offsets, members)``: bin ``b`` holds items ``members[offsets[b]:offsets[b + 1]]``
        (``members`` of the dtype of ``order``), longest first; bins numbered in order of
        creation.
    """
    items, start = _items_by_length(lengths, order, max_tokens)
    offsets, members, _ = pack_grouped(items, start, max_tokens)
    return offsets, members


@njit(cache=True, nogil=True)
def pack_grouped(items, start, max_tokens):
    """`pack_segments` for items already grouped by length.

    Args:
        items: item indices, those of length ``s`` at ``items[start[s]:start[s + 1]]``
            (`batchplan.kernels.shuffle.shuffle_by_length` makes them); within a length,
            items are consumed in this order.
        start: offsets of each length in ``items`` (``max_tokens + 2`` of them).
        max_tokens: bin capacity.

    Returns:
        ``(offsets, members, member_lengths)``: as `pack_segments`, plus the length of each
        member (int32), so callers never gather lengths at random.
    """
    histogram = np.diff(start)[: max_tokens + 1]
    slot_bin, num_bins = _best_fit_decreasing(histogram, max_tokens, items)
    offsets = np.zeros(num_bins + 1, dtype=np.int64)
    for target in slot_bin:
        offsets[target + 1] += 1
    for target in range(num_bins):
        offsets[target + 1] += offsets[target]
    cursor = offsets[:-1].copy()
    members = np.empty(slot_bin.shape[0], dtype=items.dtype)
    member_lengths = np.empty(slot_bin.shape[0], dtype=np.int32)
    slot = 0
    for length in range(max_tokens, 0, -1):  # the placement order of the slots
        for item in range(start[length], start[length + 1]):
            target = slot_bin[slot]
            members[cursor[target]] = items[item]
            member_lengths[cursor[target]] = length
            cursor[target] += 1
            slot += 1
    return offsets, members, member_lengths


@njit(cache=True, nogil=True)
def pack_items(lengths, order, max_tokens):
    """Best-fit decreasing, as the bin of each item (see `pack_segments`)."""
    offsets, members = pack_segments(lengths, order, max_tokens)
    bin_of_item = np.empty(lengths.shape[0], dtype=np.int64)
    for target in range(offsets.shape[0] - 1):
        for i in range(offsets[target], offsets[target + 1]):
            bin_of_item[members[i]] = target
    return bin_of_item
