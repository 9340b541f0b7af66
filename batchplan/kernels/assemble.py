"""Lay out scheduled micro-batches as plan rows ordered by (rank, step, micro), O(n).

Every rank holds the same number of rows, ``rows_per_rank``, so the row of a micro-batch
is ``rank x rows_per_rank + (rows of its rank before its step) + micro``: no sort, and
the writes go to ``world_size`` sequential streams, one per rank.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["order_rows"]


@njit(cache=True, nogil=True)
def order_rows(step_offsets, rank, micro, world_size):
    """Where each scheduled micro-batch goes.

    Args:
        step_offsets: step ``s`` holds scheduled positions ``step_offsets[s]:step_offsets[s + 1]``.
        rank: rank of each scheduled position.
        micro: position within its step on its rank.
        world_size: number of ranks.

    Returns:
        ``(position, step, rank, micro, num_micro)`` per row: the scheduled position the row
        holds, its epoch-local step, rank and micro (int32), and micro-batches per rank in
        its step (int32).
    """
    count = step_offsets[-1]
    rows_per_rank = count // world_size
    position = np.empty(count, dtype=np.int64)
    row_step = np.empty(count, dtype=np.int64)
    row_rank = np.empty(count, dtype=np.int32)
    row_micro = np.empty(count, dtype=np.int32)
    num_micro = np.empty(count, dtype=np.int32)
    before = 0
    for step in range(step_offsets.shape[0] - 1):
        begin = step_offsets[step]
        end = step_offsets[step + 1]
        per_rank = (end - begin) // world_size
        for p in range(begin, end):
            row = rank[p] * rows_per_rank + before + micro[p]
            position[row] = p
            row_step[row] = step
            row_rank[row] = rank[p]
            row_micro[row] = micro[p]
            num_micro[row] = per_rank
        before += per_rank
    return position, row_step, row_rank, row_micro, num_micro
