"""Assign each step's micro-batches to ranks, equal counts per rank, balancing cost.

Longest-processing-time first under a cardinality constraint: a step's micro-batches
are taken by decreasing cost and each goes to the least-loaded rank that still has
room (every rank gets exactly ``count / world_size``). O(n log n + n x world_size).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["assign_ranks"]


@njit(cache=True)
def _assign_step(costs, per_rank, world_size, rank_out, micro_out):
    load = np.zeros(world_size, dtype=np.float64)
    taken = np.zeros(world_size, dtype=np.int64)
    # Stable on equal costs, so the result depends only on the input order.
    for item in np.argsort(-costs, kind="mergesort"):
        best = -1
        for rank in range(world_size):
            if taken[rank] < per_rank and (best < 0 or load[rank] < load[best]):
                best = rank
        rank_out[item] = best
        micro_out[item] = taken[best]
        taken[best] += 1
        load[best] += costs[item]


@njit(cache=True)
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
