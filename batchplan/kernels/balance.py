"""Balance ranks: steps of similar-cost micro-batches, then equal counts per rank by cost.

In a synchronous step every rank waits for the slowest, so a step should hold
micro-batches that can be split evenly. `batchplan.kernels.assemble.take_scheduled` orders
each window of micro-batches by cost, so that consecutive groups of ``world_size``
("rounds") hold similar costs, and shuffles the rounds. `assign_step` places each step's
micro-batches on ranks: longest-processing-time first under a cardinality constraint,
by decreasing cost onto the least-loaded rank that still has room (every rank gets
exactly ``count / world_size``), found in a winner tree: O(n log n). `place_decreasing` is that
placement alone; `batchplan.kernels.batch` places a batch's samples on ranks with it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from batchplan.kernels.order import order_by_merging

__all__ = ["SCAN_UP_TO", "assign_step", "place_decreasing"]

# Up to this many ranks, `place_decreasing` scans them for the least loaded instead of
# keeping a winner tree (fewer steps per item at this size; the same choices).
SCAN_UP_TO = 16


@njit(cache=True, nogil=True)
def assign_step(costs, per_rank, world_size, rank_out, micro_out, order, spare):
    """Place one step's micro-batches on ranks: rank and position of ``costs[i]`` go to
    ``rank_out[i]`` and ``micro_out[i]``; every rank takes ``per_rank``. ``order`` (as long as
    ``costs``) and ``spare`` (at least as long): int64 scratch."""
    order_by_merging(costs, order, spare)  # stable: depends only on the input order
    if per_rank == 1:  # every rank starts empty and takes one: the k-th largest goes to rank k
        for position in range(order.shape[0]):
            rank_out[order[position]] = position
            micro_out[order[position]] = 0
        return
    place_decreasing(costs, order, per_rank, world_size, rank_out, micro_out)


@njit(cache=True, nogil=True)
def place_decreasing(costs, order, per_rank, world_size, rank_out, micro_out):
    """Longest processing time first: ``costs[order[k]]`` (``order`` by decreasing cost) goes,
    k after k, to the least-loaded rank that holds fewer than ``per_rank`` (ties: the lowest
    rank); its rank and position there go to ``rank_out`` and ``micro_out``. A winner tree
    over the ranks with room finds it in O(log world_size), one comparison per level; up to
    `SCAN_UP_TO` ranks a scan of them is faster (the same choice). Returns each rank's load.

    The rank that ends with the most load took its last item ``p`` when it was the least
    loaded, so with no count limit (``per_rank >= len(order)``) the most loaded rank carries
    at most the mean + ``p`` (and at most 4/3 of the best assignment's, Graham 1969).
    """
    load = np.zeros(world_size, dtype=np.float64)
    taken = np.zeros(world_size, dtype=np.int64)
    if world_size <= SCAN_UP_TO:
        for item in order:
            best = -1
            for rank in range(world_size):
                if taken[rank] < per_rank and (best < 0 or load[rank] < load[best]):
                    best = rank
            rank_out[item] = best
            micro_out[item] = taken[best]
            taken[best] += 1
            load[best] += costs[item]
        return load
    # A winner tree over the ranks (leaves at size + rank): each node holds the least-loaded
    # open rank below it and its load (a full rank: inf, and no rank); the top is the choice.
    size = 1
    while size < world_size:
        size <<= 1
    winner = np.empty(2 * size, dtype=np.int64)
    key = np.empty(2 * size, dtype=np.float64)
    for leaf in range(size):  # a loop, not np.full: one numba overload less to compile
        winner[size + leaf] = leaf if leaf < world_size else -1
        key[size + leaf] = 0.0 if leaf < world_size else np.inf
    for node in range(size - 1, 0, -1):
        _play(winner, key, node)
    for item in order:
        best = winner[1]
        rank_out[item] = best
        micro_out[item] = taken[best]
        taken[best] += 1
        load[best] += costs[item]
        node = size + best
        if taken[best] == per_rank:  # full: out of the tree
            winner[node], key[node] = -1, np.inf
        else:
            key[node] = load[best]
        node >>= 1
        while node >= 1:
            _play(winner, key, node)
            node >>= 1
    return load


@njit(cache=True, nogil=True, inline="always")
def _play(winner, key, node):
    """Node ``node`` takes the lesser of its children's loads (a tie: the left, the lower ranks)."""
    left, right = 2 * node, 2 * node + 1
    if key[right] < key[left]:
        winner[node], key[node] = winner[right], key[right]
    else:
        winner[node], key[node] = winner[left], key[left]
