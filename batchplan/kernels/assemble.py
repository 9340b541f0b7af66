"""Carry scheduled micro-batches to plan rows ordered by (rank, step, micro), O(n).

`take_scheduled` gathers what each scheduled micro-batch needs once (the only random
reads) and writes it straight to its balanced position (sorted by cost inside windows,
chunks shuffled); `lay_out_rows` assigns ranks step by step and writes each row's values
in place. Every rank holds the same number of rows, ``rows_per_rank``, so the row of a
micro-batch is ``rank x rows_per_rank + (rows of its rank before its step) + micro``: no
sort, and each output column is written as ``world_size`` sequential streams, one per rank.
Outputs written at scattered places are made by the callers with numpy, which asks the
kernel for huge pages (numba's own allocations do not): fewer TLB misses.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from batchplan.kernels.balance import assign_step

__all__ = ["lay_out_rows", "take_scheduled"]


@njit(cache=True, nogil=True)
def take_scheduled(schedule, begin, end, window, chunk_order, world_size, table, values, by_values, out, out_values):
    """Per scheduled position, its micro-batch's id, tokens, entry count and ``values``,
    gathered in one pass (the only random reads), with positions ``begin:end`` balanced.

    Balancing (``window > 0``) reorders ``begin:end`` (a whole number of chunks of
    ``world_size``): each window of ``window`` positions is sorted by decreasing cost
    (stable; cost = ``values`` if ``by_values`` else tokens), so consecutive chunks hold
    similar costs, then the chunks are shuffled: chunk ``j`` of the result is sorted chunk
    ``chunk_order[j]``. Every value is written once, to its final position.

    Args:
        schedule: micro-batch ids in (shuffled) schedule order.
        table: shape (micro-batches, 2): tokens and entries of each (one cache line per
            random read).
        values: float64 per micro-batch (predicted compute), or empty.
        out: int64, shape (3, positions), filled with each position's micro-batch id,
            tokens and entries (made by the caller: numpy asks for huge pages).
        out_values: float64, filled with each position's ``values`` (empty when none).
    """
    count = schedule.shape[0]
    if window <= 0:
        begin = end = count
    for position in range(begin):
        _put(out, out_values, position, schedule[position], table, values)
    for position in range(end, count):
        _put(out, out_values, position, schedule[position], table, values)
    inverse = np.empty(chunk_order.shape[0], dtype=np.int64)
    for j in range(chunk_order.shape[0]):
        inverse[chunk_order[j]] = j
    costs = np.empty(min(window, max(end - begin, 0)), dtype=np.float64)
    for first in range(begin, end, max(window, 1)):
        n = min(first + window, end) - first
        for i in range(n):
            k = schedule[first + i]
            costs[i] = values[k] if by_values else table[k, 0]
        order = np.argsort(-costs[:n], kind="mergesort")  # stable: depends only on the input order
        for i in range(n):
            relative = first - begin + i  # its place once sorted, then its chunk's place
            target = begin + inverse[relative // world_size] * world_size + relative % world_size
            _put(out, out_values, target, schedule[first + order[i]], table, values)


@njit(cache=True, nogil=True, inline="always")
def _put(out, out_values, target, k, table, values):
    out[0, target] = k
    out[1, target] = table[k, 0]
    out[2, target] = table[k, 1]
    if values.shape[0]:
        out_values[target] = values[k]


@njit(cache=True, nogil=True)
def lay_out_rows(step_offsets, costs, batch, tokens, sizes, loss, compute, world_size, rows, row_compute):
    """Assign ranks in each step and lay the rows out by (rank, step, micro), in one pass.

    Args:
        step_offsets: step ``s`` holds scheduled positions ``step_offsets[s]:step_offsets[s + 1]``.
        costs: what ranks are balanced by, per scheduled position.
        batch, tokens, sizes: micro-batch id, tokens and entries per scheduled position.
        loss: loss tokens per scheduled position, or empty for ``tokens - sizes``.
        compute: predicted compute per scheduled position, or empty.
        world_size: number of ranks.
        rows: int64, shape (4, positions), filled with each row's ``batch``, ``tokens``,
            ``loss`` and ``sizes``, rows ordered by (rank, step, micro); made by the caller
            (numpy asks for huge pages: the writes go to ``4 x world_size`` streams).
        row_compute: float64, filled with each row's compute (empty when not given).

    Returns:
        Per row of one rank (every rank has the same): ``step``, ``micro``, ``num_micro``;
        per step: ``step_tokens``, ``step_loss``.
    """
    count = step_offsets[-1]
    num_steps = step_offsets.shape[0] - 1
    rows_per_rank = count // world_size
    rank_step = np.empty(rows_per_rank, dtype=np.int64)
    rank_micro = np.empty(rows_per_rank, dtype=np.int32)
    rank_num_micro = np.empty(rows_per_rank, dtype=np.int32)
    step_tokens = np.zeros(num_steps, dtype=np.int64)
    step_loss = np.zeros(num_steps, dtype=np.int64)
    rank = np.empty(0, dtype=np.int64)
    micro = np.empty(0, dtype=np.int64)
    before = 0
    for step in range(num_steps):
        begin = step_offsets[step]
        end = step_offsets[step + 1]
        per_rank = (end - begin) // world_size
        if rank.shape[0] < end - begin:
            rank = np.empty(end - begin, dtype=np.int64)
            micro = np.empty(end - begin, dtype=np.int64)
        assign_step(costs[begin:end].astype(np.float64), per_rank, world_size, rank, micro)
        for m in range(per_rank):
            rank_step[before + m] = step
            rank_micro[before + m] = m
            rank_num_micro[before + m] = per_rank
        for p in range(begin, end):
            row = rank[p - begin] * rows_per_rank + before + micro[p - begin]
            lost = loss[p] if loss.shape[0] else tokens[p] - sizes[p]
            rows[0, row] = batch[p]
            rows[1, row] = tokens[p]
            rows[2, row] = lost
            rows[3, row] = sizes[p]
            if compute.shape[0]:
                row_compute[row] = compute[p]
            step_tokens[step] += tokens[p]
            step_loss[step] += lost
        before += per_rank
    return rank_step, rank_micro, rank_num_micro, step_tokens, step_loss
