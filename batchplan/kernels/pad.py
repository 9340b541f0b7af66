"""Padded micro-batches: sort inside shuffled windows, then cut greedily, O(n log w).

The caller passes the entries in a seeded random order. Each window of ``window``
consecutive entries is sorted longest first (stable), then cut into micro-batches
front to back: a micro-batch starts at its longest entry ``L`` and takes up to
``max_tokens // L`` entries (fairseq's "max tokens": count x longest <= cap),
rounded down to a multiple of ``batch_multiple`` when at least that many fit.
Neighbours in a sorted window have near-equal lengths, so padding is small.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from batchplan.kernels.order import counting_pays, order_by_decreasing

__all__ = ["cut_padded"]


@njit(cache=True, nogil=True)
def _cut_window(sorted_lengths, max_tokens, batch_multiple, sizes, num_batches):
    """Append the sizes of the micro-batches of one sorted window to ``sizes``."""
    position = 0
    count = sorted_lengths.shape[0]
    while position < count:
        fit = max_tokens // sorted_lengths[position]
        take = min(fit, count - position)
        if take >= batch_multiple:
            take -= take % batch_multiple
        sizes[num_batches] = take
        num_batches += 1
        position += take
    return num_batches


@njit(cache=True, nogil=True)
def cut_padded(members, member_lengths, window, max_tokens, batch_multiple):
    """Cut entries into padded micro-batches, in place.

    Args:
        members: entry indices in the epoch's (shuffled) order; each window is sorted in
            place, longest first (stable), and micro-batch ``b`` is then
            ``members[offsets[b]:offsets[b + 1]]``.
        member_lengths: int32, the length of each of ``members`` (every one in
            1..max_tokens), sorted along with them.
        window: entries per sorting window.
        max_tokens: cap on count x longest.
        batch_multiple: preferred multiple of the entry count per micro-batch.

    Returns:
        ``offsets`` (int64) of the micro-batches.
    """
    num_entries = members.shape[0]
    sizes = np.empty(num_entries, dtype=np.int64)
    by_counting = counting_pays(max_tokens, window)
    counts = np.empty(max_tokens + 2 if by_counting else 0, dtype=np.int64)
    size = min(window, num_entries)
    order = np.empty(size, dtype=np.int64)
    spare = np.empty(size, dtype=members.dtype)
    spare_lengths = np.empty(size, dtype=member_lengths.dtype)
    num_batches = 0
    for begin in range(0, num_entries, window):
        end = min(begin + window, num_entries)
        # int64 keys, as `batchplan.planning.batch` passes them: one compiled specialisation
        order_by_decreasing(member_lengths[begin:end].astype(np.int64), max_tokens, by_counting, counts, order)
        for i in range(end - begin):  # the window in that order, through the spare space
            spare[i] = members[begin + order[i]]
            spare_lengths[i] = member_lengths[begin + order[i]]
        for i in range(end - begin):  # loops, not slice assignments (`batchplan.kernels.order`)
            members[begin + i] = spare[i]
            member_lengths[begin + i] = spare_lengths[i]
        num_batches = _cut_window(member_lengths[begin:end], max_tokens, batch_multiple, sizes, np.int64(num_batches))
    offsets = np.zeros(num_batches + 1, dtype=np.int64)
    for b in range(num_batches):
        offsets[b + 1] = offsets[b] + sizes[b]
    return offsets
