"""Give every rank the same number of micro-batches: split its bins, then add empty ones.

Each rank's bins come from packing its own items (`batchplan.kernels.pack.pack_runs`), so
ranks hold different counts; a synchronous step needs ``num_micro`` on each. A rank with
fewer splits its costliest bin that holds two or more items into two (items longest first,
each to the cheaper half: the halves' costs differ by at most one item's), until it has
``num_micro`` or every bin holds one item; then it runs empty micro-batches. A split never
raises a bin's tokens, so the cap holds. Each rank's micro-batches are then ordered by
decreasing cost (empty ones last; `batchplan.kernels.order.order_by_merging`, not numba's
argsort, which compiles for seconds): under FSDP the ranks wait for each other at every
micro-batch, and ranks of balanced totals then run similar costs side by side.
O(items + splits x num_micro) per rank.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from batchplan.kernels.order import order_by_merging

__all__ = ["even_out_counts"]


@njit(cache=True, nogil=True)
def even_out_counts(members, bin_offsets, run_bins, item_costs, num_micro):
    """``num_micro`` micro-batches per rank from each rank's bins.

    Args:
        members: item positions, bin after bin (each bin's items longest first).
        bin_offsets: CSR offsets of the bins over ``members``.
        run_bins: rank ``r``'s bins are ``run_bins[r]:run_bins[r + 1]`` (at most ``num_micro``).
        item_costs: float64 cost of each item position.
        num_micro: micro-batches per rank.

    Returns:
        ``(out_members, out_offsets)``: micro-batch ``m`` of rank ``r`` is
        ``out_members[out_offsets[r * num_micro + m]:out_offsets[r * num_micro + m + 1]]``.
    """
    num_ranks = run_bins.shape[0] - 1
    out_members = np.empty(members.shape[0], dtype=np.int64)
    out_offsets = np.zeros(num_ranks * num_micro + 1, dtype=np.int64)
    starts = np.empty(num_micro, dtype=np.int64)
    ends = np.empty(num_micro, dtype=np.int64)
    costs = np.empty(num_micro, dtype=np.float64)
    spare = np.empty(members.shape[0], dtype=np.int64)
    order = np.empty(num_micro, dtype=np.int64)
    spare_order = np.empty(num_micro, dtype=np.int64)
    for rank in range(num_ranks):
        first_bin, last_bin = run_bins[rank], run_bins[rank + 1]
        count = last_bin - first_bin
        base = bin_offsets[first_bin]
        for k in range(count):
            starts[k] = bin_offsets[first_bin + k]
            ends[k] = bin_offsets[first_bin + k + 1]
            costs[k] = _cost(members, starts[k], ends[k], item_costs)
        while count < num_micro:
            widest = _costliest_splittable(starts, ends, costs, count)
            if widest < 0:
                break
            middle = _split_in_two(members, starts[widest], ends[widest], item_costs, spare)
            starts[count], ends[count] = middle, ends[widest]
            ends[widest] = middle
            costs[widest] = _cost(members, starts[widest], middle, item_costs)
            costs[count] = _cost(members, middle, ends[count], item_costs)
            count += 1
        order_by_merging(costs[:count], order, spare_order)  # stable: depends only on the input order
        cursor = base
        slot = rank * num_micro
        for k in range(num_micro):
            if k < count:
                for p in range(starts[order[k]], ends[order[k]]):
                    out_members[cursor] = members[p]
                    cursor += 1
            out_offsets[slot + k + 1] = cursor
    return out_members, out_offsets


@njit(cache=True, nogil=True, inline="always")
def _cost(members, start, end, item_costs):
    total = 0.0
    for p in range(start, end):
        total += item_costs[members[p]]
    return total


@njit(cache=True, nogil=True)
def _costliest_splittable(starts, ends, costs, count):
    """The costliest of the first ``count`` bins with two or more items (the first such), or -1."""
    best = -1
    for k in range(count):
        if ends[k] - starts[k] >= 2 and (best < 0 or costs[k] > costs[best]):
            best = k
    return best


@njit(cache=True, nogil=True)
def _split_in_two(members, start, end, item_costs, spare):
    """Reorder ``members[start:end]`` (longest first) into two non-empty halves of near-equal
    cost, each longest first; returns where the second begins."""
    first_cost = 0.0
    second_cost = 0.0
    taken = 0
    kept = 0
    for p in range(start, end):  # the first item opens the first half, the second the other
        item = members[p]
        if first_cost <= second_cost and not (p == start + 1):
            members[start + taken] = item
            taken += 1
            first_cost += item_costs[item]
        else:
            spare[kept] = item
            kept += 1
            second_cost += item_costs[item]
    for k in range(kept):
        members[start + taken + k] = spare[k]
    return start + taken
