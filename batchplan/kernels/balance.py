"""Balance ranks: steps of similar-cost micro-batches, then equal counts per rank by cost.

In a synchronous step every rank waits for the slowest, so a step should hold
micro-batches that can be split evenly. `batchplan.kernels.assemble.take_scheduled` orders
each window of micro-batches by cost, so that consecutive groups of ``world_size``
("rounds") hold similar costs, and shuffles the rounds. `assign_step` places each step's
micro-batches on ranks: longest-processing-time first under a cardinality constraint,
by decreasing cost onto the least-loaded rank that still has room (every rank gets
exactly ``count / world_size``). O(n log n + n x world_size).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["assign_step"]


@njit(cache=True, nogil=True)
def assign_step(costs, per_rank, world_size, rank_out, micro_out):
    """Place one step's micro-batches on ranks: rank and position of ``costs[i]`` go to
    ``rank_out[i]`` and ``micro_out[i]``; every rank takes ``per_rank``."""
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
