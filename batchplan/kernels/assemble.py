"""Carry scheduled micro-batches to plan rows ordered by (rank, step, micro), O(n).

`take_scheduled` gathers what each scheduled micro-batch needs once (the only random
reads) and writes it straight to its balanced position (sorted by cost inside windows,
rounds shuffled); `lay_out_rows` assigns ranks step by step and writes each row's values
in place. Every rank holds the same number of rows, ``rows_per_rank``, so the row of a
micro-batch is ``rank x rows_per_rank + (rows of its rank before its step) + micro``: no
sort, and each output column is written as ``world_size`` sequential streams, one per rank.
Outputs written at scattered places are made by the callers (`batchplan.planning.buffers`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from batchplan.kernels.balance import assign_step
from batchplan.kernels.order import counting_pays, order_by_counting, order_by_merging
from batchplan.kernels.split import share

__all__ = ["lay_out_rows", "take_scheduled"]


@njit(cache=True, nogil=True)
def take_scheduled(
    schedule,
    begin,
    end,
    window,
    round_order,
    world_size,
    table,
    values,
    by_values,
    max_tokens,
    out,
    out_values,
    part,
    parts,
):
    """Per scheduled position, its micro-batch's id, tokens, entry count and ``values``,
    gathered in one pass (the only random reads), with positions ``begin:end`` balanced.

    Balancing (``window > 0``) reorders ``begin:end`` (a whole number of rounds of
    ``world_size``): each window of ``window`` positions is sorted by decreasing cost
    (stable; cost = ``values`` if ``by_values`` else tokens), so consecutive rounds hold
    similar costs, then the rounds are shuffled: round ``j`` of the result is sorted round
    ``round_order[j]``. Every value is written once, to its final position.

    Args:
        schedule: micro-batch ids in (shuffled) schedule order.
        table: shape (micro-batches, 2): tokens and entries of each (one cache line per
            random read).
        values: float64 per micro-batch (predicted compute), or empty.
        max_tokens: no micro-batch has more tokens: windows sorted by tokens use a counting
            sort over ``0..max_tokens`` when that pays (`batchplan.kernels.order`).
        out: int64, shape (3, positions), filled with each position's micro-batch id,
            tokens and entries (made by the caller, `batchplan.planning.buffers`).
        out_values: float64, filled with each position's ``values`` (empty when none).
        part, parts: this call does part ``part`` of ``parts`` (its share of the windows
            and of the other positions); the parts write disjoint places, so threads can
            run them at once, with the same result as one call.
    """
    count = schedule.shape[0]
    if window <= 0:
        begin = end = count
    first, last = share(begin, part, parts)
    for position in range(first, last):
        _put(out, out_values, position, schedule[position], table, values)
    first, last = share(count - end, part, parts)
    for position in range(end + first, end + last):
        _put(out, out_values, position, schedule[position], table, values)
    inverse = np.empty(round_order.shape[0], dtype=np.int64)
    for j in range(round_order.shape[0]):
        inverse[round_order[j]] = j
    size = min(window, max(end - begin, 0))
    by_counting = not by_values and counting_pays(max_tokens, window)
    # Tokens sort by counting where that pays, else as float64 costs (the merge sort rank balancing uses).
    tokens = np.empty(size if by_counting else 0, dtype=np.int64)
    costs = np.empty(0 if by_counting else size, dtype=np.float64)
    counts = np.empty(max_tokens + 2 if by_counting else 0, dtype=np.int64)
    order = np.empty(size, dtype=np.int64)
    spare = np.empty(0 if by_counting else size, dtype=np.int64)
    first_window, last_window = share(-(-(end - begin) // max(window, 1)), part, parts)
    for first in range(begin + first_window * window, min(begin + last_window * window, end), max(window, 1)):
        n = min(first + window, end) - first
        if by_counting:
            for i in range(n):
                tokens[i] = table[schedule[first + i], 0]
            order_by_counting(tokens[:n], max_tokens, counts, order)
        else:
            for i in range(n):
                k = schedule[first + i]
                costs[i] = values[k] if by_values else table[k, 0]
            order_by_merging(costs[:n], order, spare)  # stable: depends only on the input order
        for i in range(n):
            relative = first - begin + i  # its place once sorted, then its round's place
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
def lay_out_rows(
    step_offsets,
    costs,
    batch,
    tokens,
    sizes,
    loss,
    compute,
    world_size,
    order_rows,
    rows,
    row_compute,
    rank_rows,
    step_sums,
    part,
    parts,
):
    """Assign ranks in each step and lay the rows out by (rank, step, micro), in one pass.

    Args:
        step_offsets: step ``s`` holds scheduled positions ``step_offsets[s]:step_offsets[s + 1]``.
        costs: what ranks are balanced by, per scheduled position.
        batch, tokens, sizes: micro-batch id, tokens and entries per scheduled position.
        loss: loss tokens per scheduled position, or empty for ``tokens - sizes``.
        compute: predicted compute per scheduled position, or empty.
        world_size: number of ranks.
        order_rows: int64, shape (2, positions), filled with each row's ``batch`` and ``sizes``,
            rows ordered by (rank, step, micro) (what laying out members needs, then freed).
        rows: int32 or int64 (the caller checks the values fit), shape (2, positions), filled
            with each row's ``tokens`` and ``loss``, in the same order. Both made by the
            caller (`batchplan.planning.buffers`).
        row_compute: float64, filled with each row's compute (empty when not given).
        rank_rows: int64, shape (3, rows per rank), filled with ``step``, ``micro`` and
            ``num_micro`` of each row of one rank (every rank has the same).
        step_sums: int64 zeros, shape (2, steps), filled with each step's tokens and loss.
        part, parts: this call lays out part ``part`` of ``parts`` (a share of the steps);
            the parts write disjoint places, so threads can run them at once, with the
            same result as one call.
    """
    count = step_offsets[-1]
    rows_per_rank = count // world_size
    first_step, last_step = share(step_offsets.shape[0] - 1, part, parts)
    longest = 0
    for step in range(first_step, last_step):
        longest = max(longest, step_offsets[step + 1] - step_offsets[step])
    rank = np.empty(longest, dtype=np.int64)
    micro = np.empty(longest, dtype=np.int64)
    step_costs = np.empty(longest, dtype=np.float64)
    by_cost = np.empty(longest, dtype=np.int64)
    spare = np.empty(longest, dtype=np.int64)
    for step in range(first_step, last_step):
        begin = step_offsets[step]
        end = step_offsets[step + 1]
        per_rank = (end - begin) // world_size
        before = begin // world_size  # rows of each rank in earlier steps
        for p in range(begin, end):
            step_costs[p - begin] = costs[p]
        assign_step(step_costs[: end - begin], per_rank, world_size, rank, micro, by_cost[: end - begin], spare)
        for m in range(per_rank):
            rank_rows[0, before + m] = step
            rank_rows[1, before + m] = m
            rank_rows[2, before + m] = per_rank
        for p in range(begin, end):
            row = rank[p - begin] * rows_per_rank + before + micro[p - begin]
            lost = loss[p] if loss.shape[0] else tokens[p] - sizes[p]
            order_rows[0, row] = batch[p]
            order_rows[1, row] = sizes[p]
            rows[0, row] = tokens[p]
            rows[1, row] = lost
            if compute.shape[0]:
                row_compute[row] = compute[p]
            step_sums[0, step] += tokens[p]
            step_sums[1, step] += lost
