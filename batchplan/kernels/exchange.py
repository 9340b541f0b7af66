"""Lower the busiest rank's load by moving or swapping items with the least-loaded ranks.

Longest processing time first (`batchplan.kernels.balance.place_decreasing`) leaves the
busiest rank at most one item above the mean; an exchange then takes that rank ``a`` and,
for each of the ``tries`` least-loaded ranks ``b``, looks for the move of one item of ``a``
to ``b``, or the swap of an item of ``a`` with a cheaper one of ``b``, that shifts ``d``
with ``0 < d < load[a] - load[b]`` closest to half that gap: both ranks end below
``load[a]``, so the busiest load never rises. It repeats on the new busiest rank until no
such exchange exists, the busiest load is good enough (the caller's target) or ``rounds``
are done. Each try sorts ``b``'s items and binary-searches
each of ``a``'s: O(rounds x tries x k log k) for k items per rank. A rank takes at most
``slack`` more items than LPT gave it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["exchange_items"]


@njit(cache=True, nogil=True)
def exchange_items(costs, rank, world_size, rounds, tries, slack, good_enough):
    """Improve ``rank`` (each item's rank, changed in place) until the busiest load is at most
    ``good_enough`` (or no exchange helps, or ``rounds`` are done); returns each rank's load."""
    count = costs.shape[0]
    sizes = np.zeros(world_size, dtype=np.int64)
    load = np.zeros(world_size, dtype=np.float64)
    for item in range(count):
        sizes[rank[item]] += 1
        load[rank[item]] += costs[item]
    base = np.zeros(world_size + 1, dtype=np.int64)
    for r in range(world_size):
        base[r + 1] = base[r] + sizes[r] + slack
    members = np.empty(base[world_size], dtype=np.int64)
    fill = sizes.copy()
    fill[:] = 0
    for item in range(count):
        members[base[rank[item]] + fill[rank[item]]] = item
        fill[rank[item]] += 1
    for _ in range(rounds):
        busiest = np.argmax(load)
        if load[busiest] <= good_enough or not _improve(costs, rank, members, base, sizes, load, busiest, tries):
            break
    return load


@njit(cache=True, nogil=True)
def _improve(costs, rank, members, base, sizes, load, busiest, tries):
    """One exchange that lowers ``load[busiest]``, with one of the ``tries`` least-loaded ranks."""
    for b in _least_loaded(load, busiest, tries):
        if load[b] >= load[busiest]:
            return False
        gap = load[busiest] - load[b]
        x, y = _best_pair(costs, members, base, sizes, busiest, b, gap)
        if x >= 0:
            _apply(costs, rank, members, base, sizes, load, busiest, b, x, y)
            return True
    return False


@njit(cache=True, nogil=True)
def _least_loaded(load, skip, tries):
    """The ``tries`` least-loaded ranks other than ``skip``, by load (ties: lower rank first):
    one pass with a small sorted buffer, O(world_size x tries), not a sort per round."""
    chosen = np.empty(min(tries, load.shape[0] - 1), dtype=np.int64)
    count = 0
    for r in range(load.shape[0]):
        if r == skip:
            continue
        if count == chosen.shape[0] and load[r] >= load[chosen[count - 1]]:
            continue
        k = min(count, chosen.shape[0] - 1)  # the last place, dropped when the buffer is full
        while k > 0 and load[chosen[k - 1]] > load[r]:
            chosen[k] = chosen[k - 1]
            k -= 1
        chosen[k] = r
        count = min(count + 1, chosen.shape[0])
    return chosen[:count]


@njit(cache=True, nogil=True)
def _best_pair(costs, members, base, sizes, a, b, gap):
    """Positions (in ``a``'s and ``b``'s items; ``y = -1``: a move) of the exchange whose shift
    is closest to ``gap / 2`` within (0, gap), or (-1, -1)."""
    items_b = members[base[b] : base[b] + sizes[b]]
    order = np.argsort(costs[items_b], kind="mergesort")
    sorted_b = costs[items_b][order]
    can_move = base[b] + sizes[b] < base[b + 1]
    best_x, best_y, best_miss = -1, -1, gap / 2
    for i in range(sizes[a]):
        x = costs[members[base[a] + i]]
        if x <= 0:
            continue
        if can_move and x < gap and abs(x - gap / 2) < best_miss:
            best_x, best_y, best_miss = i, -1, abs(x - gap / 2)
        target = x - gap / 2  # the cost of b's item that would shift exactly half the gap
        k = np.searchsorted(sorted_b, target)
        for j in (k - 1, k):
            if 0 <= j < sorted_b.shape[0]:
                shift = x - sorted_b[j]
                if 0 < shift < gap and abs(shift - gap / 2) < best_miss:
                    best_x, best_y, best_miss = i, order[j], abs(shift - gap / 2)
    return best_x, best_y


@njit(cache=True, nogil=True)
def _apply(costs, rank, members, base, sizes, load, a, b, x, y):
    item_x = members[base[a] + x]
    if y < 0:  # move: a's last item fills the hole, b takes item_x at its end
        members[base[a] + x] = members[base[a] + sizes[a] - 1]
        sizes[a] -= 1
        members[base[b] + sizes[b]] = item_x
        sizes[b] += 1
        shift = costs[item_x]
    else:
        item_y = members[base[b] + y]
        members[base[a] + x] = item_y
        members[base[b] + y] = item_x
        rank[item_y] = a
        shift = costs[item_x] - costs[item_y]
    rank[item_x] = b
    load[a] -= shift
    load[b] += shift
