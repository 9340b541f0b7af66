"""Balance ranks: steps of similar-cost micro-batches, then equal counts per rank by cost.

In a synchronous step every rank waits for the slowest, so a step should hold
micro-batches that can be split evenly. `sort_within_windows` orders each window of
micro-batches by cost, so that consecutive groups of ``world_size`` ("chunks") hold
similar costs; the planner then shuffles the chunks. `assign_ranks` places each step's
micro-batches on ranks: longest-processing-time first under a cardinality constraint,
by decreasing cost onto the least-loaded rank that still has room (every rank gets
exactly ``count / world_size``). O(n log n + n x world_size).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["assign_ranks", "sort_within_windows"]


@njit(cache=True, nogil=True)
def _assign_step(costs, per_rank, world_size, rank_out, micro_out):
    order = np.argsort(-costs, kind="mergesort")  # stable: depends only on the input order
    if per_rank == 1:  # every rank starts empty and takes one: the k-th largest goes to rank k
        for position in range(order.shape[0]):
            rank_out[order[position]] = position
            micro_out[order[position]] = 0
        return
    load = np.zeros(world_size, dtype=np.float64)
    taken = np.zeros(world_size, dtype=np.int64)
    for item in order:
        best = -1
        for rank in range(world_size):
            if taken[rank] < per_rank and (best < 0 or load[rank] < load[best]):
                best = rank
        rank_out[item] = best
        micro_out[item] = taken[best]
        taken[best] += 1
        load[best] += costs[item]


@njit(cache=True, nogil=True)
def assign_ranks(costs, step_offsets, world_size):
    """Rank and position within the step of each micro-batch.

    Args:
        costs: cost of each micro-batch (tokens or predicted compute), schedule order.
        step_offsets: step ``s`` holds micro-batches ``step_offsets[s]:step_offsets[s + 1]``;
            each step's count must be a multiple of ``world_size``.
        world_size: number of ranks.

    Returns:
        ``(rank, micro)`` int64 arrays, one entry per micro-batch.
    """
    count = costs.shape[0]
    rank = np.empty(count, dtype=np.int64)
    micro = np.empty(count, dtype=np.int64)
    for step in range(step_offsets.shape[0] - 1):
        begin = step_offsets[step]
        end = step_offsets[step + 1]
        _assign_step(
            costs[begin:end].astype(np.float64),
            (end - begin) // world_size,
            world_size,
            rank[begin:end],
            micro[begin:end],
        )
    return rank, micro


@njit(cache=True, nogil=True)
def sort_within_windows(costs, window):
    """Positions ordered by decreasing cost inside each window of ``window`` positions.

    Consecutive groups of ``world_size`` positions in the result hold micro-batches of
    similar cost (a step whose ranks can finish together); stable on equal costs.
    """
    count = costs.shape[0]
    order = np.empty(count, dtype=np.int64)
    for begin in range(0, count, window):
        end = min(begin + window, count)
        order[begin:end] = begin + np.argsort(-costs[begin:end], kind="mergesort")
    return order
