"""Balance ranks: steps of similar-cost micro-batches, then equal counts per rank by cost.

In a synchronous step every rank waits for the slowest, so a step should hold
micro-batches that can be split evenly. `batchplan.kernels.assemble.take_scheduled` orders
each window of micro-batches by cost, so that consecutive groups of ``world_size``
("rounds") hold similar costs, and shuffles the rounds. `assign_step` places each step's
micro-batches on ranks: longest-processing-time first under a cardinality constraint,
by decreasing cost onto the least-loaded rank that still has room (every rank gets
exactly ``count / world_size``), found in a heap: O(n log n). `place_decreasing` is that
placement alone; `batchplan.planning.batch` places a batch's samples on ranks with it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from batchplan.kernels.order import order_by_merging

__all__ = ["SCAN_UP_TO", "assign_step", "place_decreasing"]

# Up to this many ranks, `place_decreasing` scans them for the least loaded instead of
# keeping a heap (fewer steps per item at this size; the same choices).
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
    rank); its rank and position there go to ``rank_out`` and ``micro_out``. A min-heap of
    (load, rank) over the ranks with room finds it in O(log world_size); up to
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
    heap = np.arange(world_size, dtype=np.int64)  # every load 0: rank order is a heap
    open_ranks = world_size
    for item in order:
        best = heap[0]
        rank_out[item] = best
        micro_out[item] = taken[best]
        taken[best] += 1
        load[best] += costs[item]
        if taken[best] == per_rank:  # full: off the heap
            open_ranks -= 1
            heap[0] = heap[open_ranks]
        _sift_down(heap, open_ranks, load)
    return load


@njit(cache=True, nogil=True, inline="always")
def _before(load, a, b):
    return load[a] < load[b] or (load[a] == load[b] and a < b)


@njit(cache=True, nogil=True)
def _sift_down(heap, count, load):
    """Restore the heap order of ``heap[:count]`` (by load, then rank) after its top changed."""
    node = 0
    while True:
        child = 2 * node + 1
        if child >= count:
            return
        if child + 1 < count and _before(load, heap[child + 1], heap[child]):
            child += 1
        if not _before(load, heap[child], heap[node]):
            return
        heap[node], heap[child] = heap[child], heap[node]
        node = child
