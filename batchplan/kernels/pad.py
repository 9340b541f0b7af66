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
def _sort_window_by_counting(lengths, order, begin, end, counts, members, member_lengths):
    """Stable sort of ``order[begin:end]`` by decreasing length into ``members[begin:end]``."""
    max_tokens = counts.shape[0] - 2
    counts[:] = 0
    window_lengths = np.empty(end - begin, dtype=member_lengths.dtype)  # read at random once, then in cache
    for i in range(begin, end):
        length = lengths[order[i]]
        window_lengths[i - begin] = length
        counts[max_tokens - length + 1] += 1
    counts[0] = begin
    for key in range(1, max_tokens + 2):
        counts[key] += counts[key - 1]
    for i in range(begin, end):
        length = window_lengths[i - begin]
        key = max_tokens - length
        members[counts[key]] = order[i]
        member_lengths[counts[key]] = length
        counts[key] += 1


@njit(cache=True, nogil=True)
def cut_padded(lengths, order, window, max_tokens, batch_multiple):
    """Cut entries into padded micro-batches.

    Args:
        lengths: length of each entry (every one in 1..max_tokens).
        order: a permutation of entry indices (the epoch's shuffle).
        window: entries per sorting window.
        max_tokens: cap on count x longest.
        batch_multiple: preferred multiple of the entry count per micro-batch.

    Returns:
        ``(offsets, members, member_lengths)``: micro-batch ``b`` holds entries
        ``members[offsets[b]:offsets[b + 1]]``, longest first; ``member_lengths`` (int32)
        are their lengths.
    """
    num_entries = order.shape[0]
    members = np.empty(num_entries, dtype=order.dtype)
    member_lengths = np.empty(num_entries, dtype=np.int32)
    sizes = np.empty(num_entries, dtype=np.int64)
    counts = np.zeros(max_tokens + 2, dtype=np.int64)
    num_batches = 0
    for begin in range(0, num_entries, window):
        end = min(begin + window, num_entries)
        if max_tokens <= 4 * window:  # a counting sort is cheaper than a comparison sort
            _sort_window_by_counting(lengths, order, begin, end, counts, members, member_lengths)
        else:
            chunk = order[begin:end]
            chunk_lengths = lengths[chunk]
            ranked = np.argsort(-chunk_lengths, kind="mergesort")
            members[begin:end] = chunk[ranked]
            member_lengths[begin:end] = chunk_lengths[ranked]
        num_batches = _cut_window(member_lengths[begin:end], max_tokens, batch_multiple, sizes, num_batches)
    offsets = np.zeros(num_batches + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(sizes[:num_batches])
    return offsets, members, member_lengths
