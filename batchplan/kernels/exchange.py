"""Lower the busiest rank's load by re-splitting its cheapest items with a less-loaded rank's.

Longest processing time first (`batchplan.kernels.balance.place_decreasing`) leaves the
busiest rank at most one item above the mean. `exchange_items` then takes, round after
round, the busiest rank ``a`` and the least-loaded ``b``, pools the ``pool`` cheapest items of
each (the last ones LPT gave them) with one stand-in for what stays (the difference of the
two ranks' other items, on the side of the rank that keeps more), and splits the pool in two
by Karmarkar-Karp differencing: the two largest values leave, their difference goes back,
until one value is left, the two sides' difference. The split is kept only when both ranks
end below ``load[a]``, so the busiest load never rises. Where no split helps with ``b`` it
tries the next least-loaded ranks (``tries`` in all), then pools twice as many items, up to
every item of both ranks (and keeps that size: what helped once is needed again). It stops
once the busiest load is good enough (the caller's target), when no split helps, or after
``rounds``. Differencing leaves two ranks far closer than any one-item move or swap could.
Per round: O(pool log pool) for the split (the two pools merge as two sorted runs; a
difference, mostly small, enters the queue of live values from the small end) and
O(log ranks) to find the next pair (two winner trees over the ranks' loads).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["exchange_items"]


@njit(cache=True, nogil=True)
def exchange_items(costs, order, rank, world_size, rounds, pool, tries, good_enough):
    """Improve ``rank`` (each item's rank, changed in place) until the busiest load is at most
    ``good_enough``, no split helps, or ``rounds`` are done; returns each rank's load.

    Args:
        costs: float64 cost of each item.
        order: the items by decreasing cost (each rank's items are kept in this order, so a
            rank's last items are its cheapest from the start).
        rank: int64 rank of each item, in ``0..world_size - 1``.
        world_size: ranks.
        rounds: most splits made.
        pool: items first taken from each of the two ranks (>= 1).
        tries: ranks tried, least loaded first, before more items are pooled.
        good_enough: the busiest load at which to stop.
    """
    members, base, sizes, load = _rank_members(costs, order, rank, world_size)
    most = 1  # the largest pool that can be asked for: a rank's whole block
    for r in range(world_size):
        most = max(most, base[r + 1] - base[r])
    work = _scratch(2 * most + 1)
    size, tops, bottoms = _tournaments(load)
    level = min(max(pool, 1), most)
    for _ in range(rounds):
        busiest, idlest = tops[1], bottoms[1]
        if load[busiest] <= good_enough or busiest == idlest:
            break
        partner = _with_partners(costs, rank, members, base, sizes, load, busiest, idlest, level, tries, work)
        while partner < 0 and level < most:  # more items, more ways to split
            level = min(2 * level, most)
            partner = _with_partners(costs, rank, members, base, sizes, load, busiest, idlest, level, tries, work)
        if partner < 0:
            break
        _replay(load, tops, bottoms, size, busiest)
        _replay(load, tops, bottoms, size, partner)
    return load


@njit(cache=True, nogil=True)
def _with_partners(costs, rank, members, base, sizes, load, busiest, idlest, pool, tries, work):
    """A split of the busiest rank with ``idlest``, else with the next least-loaded ranks below
    it (``tries`` in all): the rank it was made with, or -1."""
    if _split_pair(costs, rank, members, base, sizes, load, busiest, idlest, pool, work):
        return idlest
    for other in _least_loaded(load, busiest, tries)[1:]:
        if load[other] >= load[busiest]:
            return -1
        if _split_pair(costs, rank, members, base, sizes, load, busiest, other, pool, work):
            return other
    return -1


@njit(cache=True, nogil=True, inline="always")
def _tournaments(load):
    """Two winner trees over the ranks (leaves at ``size + r``): the most loaded rank at
    ``tops[1]``, the least at ``bottoms[1]`` (ties: the lowest rank); O(log ranks) to replay
    one rank's change, where a scan would take O(ranks) every round."""
    size = 1
    while size < load.shape[0]:
        size <<= 1
    tops = np.full(2 * size, -1, dtype=np.int64)
    bottoms = np.full(2 * size, -1, dtype=np.int64)
    for r in range(load.shape[0]):
        tops[size + r] = r
        bottoms[size + r] = r
    for node in range(size - 1, 0, -1):
        _play(load, tops, bottoms, node)
    return size, tops, bottoms


@njit(cache=True, nogil=True, inline="always")
def _replay(load, tops, bottoms, size, r):
    node = (size + r) >> 1
    while node >= 1:
        _play(load, tops, bottoms, node)
        node >>= 1


@njit(cache=True, nogil=True, inline="always")
def _play(load, tops, bottoms, node):
    """The winners of ``node`` from its children's (the left holds the lower ranks: it wins ties)."""
    left, right = tops[2 * node], tops[2 * node + 1]
    tops[node] = left if right < 0 or (left >= 0 and load[left] >= load[right]) else right
    left, right = bottoms[2 * node], bottoms[2 * node + 1]
    bottoms[node] = left if right < 0 or (left >= 0 and load[left] <= load[right]) else right


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


@njit(cache=True, nogil=True, inline="always")
def _scratch(count):
    """Buffers of one split of up to ``count`` values: entries, values, their order, the
    differencing queue (twice as long), merge partners, merge order, sides."""
    entries = np.empty(count, dtype=np.int64)
    values = np.empty(count, dtype=np.float64)
    by_value = np.empty(count, dtype=np.int64)
    queue = np.empty(2 * count, dtype=np.int64)
    partner = np.empty(count, dtype=np.int64)
    merged = np.empty(count, dtype=np.int64)
    side = np.empty(count, dtype=np.int64)
    return entries, values, by_value, queue, partner, merged, side


@njit(cache=True, nogil=True, inline="always")
def _rank_members(costs, order, rank, world_size):
    """Each rank's items in ``order``, in a block with room for as many more as the largest
    rank holds; and each rank's load."""
    sizes = np.zeros(world_size, dtype=np.int64)
    load = np.zeros(world_size, dtype=np.float64)
    for item in order:
        sizes[rank[item]] += 1
        load[rank[item]] += costs[item]
    room = 0
    for r in range(world_size):
        room = max(room, sizes[r])
    base = np.zeros(world_size + 1, dtype=np.int64)
    for r in range(world_size):
        base[r + 1] = base[r] + sizes[r] + room
    members = np.empty(base[world_size], dtype=np.int64)
    sizes[:] = 0
    for item in order:
        r = rank[item]
        members[base[r] + sizes[r]] = item
        sizes[r] += 1
    return members, base, sizes, load


@njit(cache=True, nogil=True)
def _split_pair(costs, rank, members, base, sizes, load, a, b, pool, work):
    """Re-split the cheapest ``pool`` items of ranks ``a`` (the busiest) and ``b``; whether it helped."""
    entries, values, by_value, queue, partner, merged, side = work
    take_a, take_b = min(pool, sizes[a]), min(pool, sizes[b])
    count = 0
    kept_a, kept_b = load[a], load[b]  # less the pooled items: what stays on each rank
    for r, take in ((a, take_a), (b, take_b)):
        for k in range(sizes[r] - take, sizes[r]):
            entries[count] = members[base[r] + k]
            values[count] = costs[entries[count]]
            if r == a:
                kept_a -= values[count]
            else:
                kept_b -= values[count]
            count += 1
    entries[count] = -1  # the stand-in for what stays, on the side of the rank that keeps more
    values[count] = abs(kept_a - kept_b)
    count += 1
    _difference(values, count, take_a, by_value, queue, partner, merged, side)
    side_a = side[count - 1] if kept_a >= kept_b else 1 - side[count - 1]
    new_a, new_b = kept_a, kept_b
    size_a, size_b = sizes[a] - take_a, sizes[b] - take_b
    for k in range(count - 1):
        if side[k] == side_a:
            new_a += costs[entries[k]]
            size_a += 1
        else:
            new_b += costs[entries[k]]
            size_b += 1
    if max(new_a, new_b) >= load[a] or size_a > base[a + 1] - base[a] or size_b > base[b + 1] - base[b]:
        return False  # no lower, or a rank's block is full
    sizes[a] -= take_a
    sizes[b] -= take_b
    for k in by_value[:count]:  # each rank's new items by decreasing cost, after what it kept
        if entries[k] >= 0:
            r = a if side[k] == side_a else b
            members[base[r] + sizes[r]] = entries[k]
            sizes[r] += 1
            rank[entries[k]] = r
    load[a], load[b] = new_a, new_b
    return True


@njit(cache=True, nogil=True)
def _difference(values, count, first_run, by_value, queue, partner, merged, side):
    """Karmarkar-Karp on ``values[:count]`` (changed): ``side[k]`` (0 or 1) of each value;
    returns the two sides' difference and leaves ``by_value[:count]``, the positions by
    decreasing value (ties: lower position first). The live values wait in that order between
    ``queue[first]`` and ``queue[last - 1]``: the two largest leave from the front, their
    difference goes in from the back."""
    _sort_positions(values, count, first_run, by_value)
    for k in range(count):  # a loop: a slice assignment compiles numba's shape-check message
        queue[k] = by_value[k]
    first, last = 0, count
    for step in range(count - 1):
        largest, second = queue[first], queue[first + 1]  # the second goes opposite the largest
        first += 2
        values[largest] -= values[second]
        partner[second] = largest
        merged[step] = second
        k = last
        while k > first and _above(values, largest, queue[k - 1]):
            queue[k] = queue[k - 1]
            k -= 1
        queue[k] = largest
        last += 1
    side[queue[first]] = 0
    for step in range(count - 2, -1, -1):  # a partner is merged later than the value it took
        side[merged[step]] = 1 - side[partner[merged[step]]]
    return values[queue[first]]


@njit(cache=True, nogil=True, inline="always")
def _sort_positions(values, count, first_run, out):
    """``out[:count]``: positions by decreasing value (ties: lower first). Positions before
    ``first_run`` and from it to ``count - 1`` are two runs, mostly in that order already:
    merged, then set right by insertion (the last value, the stand-in, goes in there)."""
    left, right, k = 0, first_run, 0
    while left < first_run or right < count - 1:
        if right >= count - 1 or (left < first_run and not _above(values, right, left)):
            out[k] = left
            left += 1
        else:
            out[k] = right
            right += 1
        k += 1
    out[count - 1] = count - 1
    for k in range(1, count):
        j, position = k, out[k]
        while j > 0 and _above(values, position, out[j - 1]):
            out[j] = out[j - 1]
            j -= 1
        out[j] = position


@njit(cache=True, nogil=True, inline="always")
def _above(values, x, y):
    """Whether value ``x`` comes before ``y``: larger, or equal at a lower position."""
    return values[x] > values[y] or (values[x] == values[y] and x < y)
