"""Lay packed bins out from the entries, without holding the entries in their shuffled order.

Best fit decreasing (`batchplan.kernels.pack`) places slots, longest first; the k-th slot of
length ``s`` takes the k-th entry of length ``s`` once the entries of each length are shuffled
with seeded keys (`batchplan.kernels.shuffle.shuffle_groups`). Holding that shuffled order
costs one index per entry; these kernels lay members out without it, in three passes:

1. `place_slots`: each slot's place in the output (or -1: left out), written over the bin
   of each slot (in place: the bins are read once, in slot order);
2. `unshuffle_groups`: the shuffle undone on those places: afterwards the place of the
   k-th entry of length ``s`` in dataset order sits at the k-th position of the length's slots;
3. `scatter_entries`: one pass over the entries in dataset order writes each to its place
   (or, pass after pass, those whose places fall in a window: the members a window at a time).

At the peak two arrays of one index per entry are held (places and members), not three
(shuffled entries, bins of slots, members). The result is the same as filling the bins
with the shuffled entries and gathering them (`tests/test_kernels.py` checks it).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from batchplan.kernels.split import share

__all__ = ["bin_lengths", "place_slots", "scatter_entries", "unshuffle_groups"]


@njit(cache=True, nogil=True)
def place_slots(slot_bin, offsets, destination, piece_starts, piece_ends, piece_destination, places):
    """Where the item of each slot goes, in slot order (the placement order within each bin).

    Args:
        slot_bin: the bin of each slot (`batchplan.kernels.pack.pack_bins`).
        offsets: the bins' ranges of member space (``num_bins + 1``).
        destination: one per bin (int64, or int32 when the member space fits): where its
            whole member list goes, or -1 (a bin cut into pieces or left out). Overwritten
            (scratch): advanced past each slot placed.
        piece_starts, piece_ends, piece_destination: non-empty ranges of member space,
            sorted by start and not overlapping, each inside one bin whose destination is
            -1, and where each goes; slots of a -1 bin outside every piece are left out.
        places: filled with each slot's place, or -1 (left out); int32 or int64, one per
            slot. May be ``slot_bin`` itself (each slot is read before it is written).

    Returns:
        How many slots have a place.
    """
    placed = 0
    for slot in range(slot_bin.shape[0]):
        target = slot_bin[slot]
        place = destination[target]
        if place == -1:  # the first slot of a bin laid out in pieces: from its member space
            place = -2 - offsets[target]
        if place >= 0:
            destination[target] = place + 1
            places[slot] = place
            placed += 1
            continue
        destination[target] = place - 1  # -2 - (member-space position of the next slot)
        position = -2 - place
        piece = np.searchsorted(piece_starts, position, side="right") - 1
        if piece >= 0 and position < piece_ends[piece]:
            places[slot] = piece_destination[piece] + position - piece_starts[piece]
            placed += 1
        else:
            places[slot] = -1
    return placed


@njit(cache=True, nogil=True)
def unshuffle_groups(start, block, keys, first, values):
    """Undo `batchplan.kernels.shuffle.shuffle_groups` on ``values`` for the item positions
    ``first:first + len(keys)``, whose keys these are.

    Group ``g`` holds item positions ``start[g]:start[g + 1]``; its values lie at
    ``block[g]:block[g] + start[g + 1] - start[g]`` (in the same order within the group).
    The shuffle swaps position ``i`` with ``begin + (keys[i] x (i - begin + 1)) >> 32``
    from each group's last position down; the same swaps from its second position up undo
    it: where the shuffle puts item ``k`` of a group at position ``p``, this moves the value
    at ``p`` to ``k``. Positions are taken in order, so the keys can come in consecutive
    chunks, and chunks of different groups can run at once (disjoint places).
    """
    num_groups = start.shape[0] - 1
    group = np.searchsorted(start, first, side="right") - 1
    for i in range(keys.shape[0]):
        position = first + i
        while group < num_groups - 1 and start[group + 1] <= position:
            group += 1
        begin = start[group]
        if position == begin:
            continue
        within = position - begin
        pick = (np.uint64(keys[i]) * np.uint64(within + 1)) >> np.uint64(32)
        a = block[group] + within
        b = block[group] + np.int64(pick)
        swap = values[a]
        values[a] = values[b]
        values[b] = swap


@njit(cache=True, nogil=True)
def scatter_entries(groups, cursors, places, values, out, first, base, part, parts):
    """Write this part's share of the entries to their places: entry ``i`` of group ``g`` takes
    the next place of its group's stream (``places[cursors[part, g]]``, advanced); a place
    outside ``first:first + len(out)`` (-1: left out) is not written.

    Args:
        groups: the group (length) of each entry.
        cursors: int64, shape (parts, groups): where part ``part`` reads its first place of each
            group (after the parts before it); advanced as it reads.
        places: each position's place (`place_slots`, then `unshuffle_groups`).
        values: None to write entry indices (``base + i`` for entry ``i``), else write
            ``values[i]``.
        out: filled at the places less ``first`` (made by the caller,
            `batchplan.planning.buffers`: the writes land at random).
        first: the place ``out[0]`` stands for (0: the whole layout; more: a window of it).
        base: added to the entry indices written (the entries' first id, when ``groups``
            are a part of a larger set of entries).

    Returns:
        How many entries this part wrote.
    """
    begin, end = share(groups.shape[0], part, parts)
    cursor = cursors[part]
    stop = first + out.shape[0]
    written = 0
    for item in range(begin, end):
        group = groups[item]
        place = places[cursor[group]]
        cursor[group] += 1
        if place < first or place >= stop:
            continue
        if values is None:
            out[place - first] = base + item
        else:
            out[place - first] = values[item]
        written += 1
    return written


@njit(cache=True, nogil=True)
def bin_lengths(start, slot_bin, offsets, bins, max_tokens):
    """Member lengths of a few bins (``bins`` sorted, unique) in CSR form, in the order of
    ``bins``: ``(bin_offsets, member_lengths)``; one pass over the slots."""
    wanted = np.zeros(offsets.shape[0] - 1, dtype=np.bool_)
    local = np.zeros(bins.shape[0] + 1, dtype=np.int64)
    for i in range(bins.shape[0]):
        wanted[bins[i]] = True
        local[i + 1] = local[i] + offsets[bins[i] + 1] - offsets[bins[i]]
    cursor = local[:-1].copy()
    member_lengths = np.empty(local[-1], dtype=np.int32)
    slot = 0
    for length in range(max_tokens, 0, -1):
        for _ in range(start[length + 1] - start[length]):
            target = slot_bin[slot]
            slot += 1
            if wanted[target]:
                # As `place_slots` searches (int64, side "right"): one searchsorted for numba to compile.
                i = np.searchsorted(bins, np.int64(target), side="right") - 1
                member_lengths[cursor[i]] = length
                cursor[i] += 1
    return local, member_lengths
