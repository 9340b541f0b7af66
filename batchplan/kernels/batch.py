"""One batch's micro-batches on every rank, in one kernel: items to ranks, units, packing, equal counts.

`batchplan.planning.batch.plan_batch` makes the entries (samples, or pieces of samples
above the cap) ordered by item (a group, or one sample) and calls `split_batch`, which runs
every stage in one call, so that a fresh process loads one compiled kernel from numba's
cache rather than one per stage:

1. items' tokens and costs, and their order by decreasing cost (by tokens where cost grows
   with them: a counting or radix sort, `batchplan.kernels.order`), equal ones in the
   caller's seeded order;
2. ranks: longest processing time first (`batchplan.kernels.balance.place_decreasing`, the
   offline planner's balancer), then `batchplan.kernels.exchange.exchange_items`;
3. units, what the packer places: an item that fits, or each entry of one that does not,
   by rank then longest first (equal lengths in the seeded order): a counting sort by rank
   (and one by length first, unless the items' order is it already);
4. each rank's units packed best fit decreasing (`batchplan.kernels.pack.pack_runs`, the
   offline packer), then equal counts (`batchplan.kernels.even_counts.even_out_counts`);
5. the micro-batches' entries laid out rank after rank, with their tokens, loss tokens and cost.

O(n log n) overall (the sorts are O(n) where keys are tokens).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from batchplan.kernels.balance import place_decreasing
from batchplan.kernels.even_counts import even_out_counts
from batchplan.kernels.exchange import exchange_items
from batchplan.kernels.order import counting_pays, order_by_decreasing, order_by_merging
from batchplan.kernels.pack import pack_runs

__all__ = ["split_batch"]


@njit(cache=True, nogil=True)
def split_batch(
    lengths, loss, item_offsets, shuffled, coefficient, by_tokens, world_size, max_tokens, num_micro, exchange
):
    """Every rank's micro-batches of one batch.

    Args:
        lengths, loss: int64 tokens and loss tokens of each entry, entries ordered by item.
        item_offsets: int64, ``items + 1``: item ``k``'s entries are ``item_offsets[k]:item_offsets[k + 1]``.
        shuffled: the items in a seeded order, which decides among equal costs and lengths.
        coefficient: the attention term of the cost: ``L + coefficient x L^2`` per entry.
        by_tokens: whether an item's cost grows with its tokens (it is then ordered by them).
        world_size: ranks.
        max_tokens: most tokens in a micro-batch.
        num_micro: micro-batches per rank; 0: the fewest the packing needs.
        exchange: ``(rounds per rank, pool, tries, good enough)`` of `exchange_items`; good
            enough is the busiest rank's cost over the mean at which to stop.

    Returns:
        ``(entries, offsets, tokens, loss, costs, needed, item_costs)``: rank ``r``'s
        micro-batch ``m`` holds ``entries[offsets[r * num_micro + m]:offsets[r * num_micro + m + 1]]``;
        its tokens, loss tokens and cost are at ``r * num_micro + m``; ``needed`` is the
        micro-batches the packing needs (when it exceeds ``num_micro``, nothing else is filled).
    """
    cost = np.empty(lengths.shape[0], dtype=np.float64)
    for e in range(lengths.shape[0]):
        cost[e] = lengths[e] + coefficient * np.float64(lengths[e]) ** 2
    item_tokens, item_costs = _item_sums(lengths, cost, item_offsets)
    order = _by_decreasing_cost(item_tokens, item_costs, shuffled, by_tokens)
    rank = _ranks(item_costs, order, world_size, exchange)
    presorted = by_tokens  # items by decreasing tokens are the units' order, where none is split
    for item in range(item_tokens.shape[0]):
        presorted = presorted and item_tokens[item] <= max_tokens
    items = order if presorted else shuffled
    unit_start, unit_end, unit_length, unit_cost, run_offsets = _units(
        lengths, cost, item_offsets, item_tokens, items, presorted, rank, world_size, max_tokens
    )
    members, bin_offsets, _, run_bins = pack_runs(unit_length, run_offsets, max_tokens)
    needed = np.int64(0)
    for r in range(world_size):
        needed = max(needed, run_bins[r + 1] - run_bins[r])
    if num_micro == 0:
        num_micro = needed
    if needed > num_micro:
        return _nothing(needed, item_costs)
    out_members, out_offsets = even_out_counts(members, bin_offsets, run_bins, unit_cost, num_micro)
    entries, offsets, tokens, loss_out, costs = _lay_out(
        out_members, out_offsets, unit_start, unit_end, lengths, loss, cost
    )
    return entries, offsets, tokens, loss_out, costs, needed, item_costs


@njit(cache=True, nogil=True)
def _item_sums(lengths, cost, item_offsets):
    count = item_offsets.shape[0] - 1
    tokens = np.zeros(count, dtype=np.int64)
    costs = np.zeros(count, dtype=np.float64)
    for item in range(count):
        for e in range(item_offsets[item], item_offsets[item + 1]):
            tokens[item] += lengths[e]
            costs[item] += cost[e]
    return tokens, costs


@njit(cache=True, nogil=True)
def _by_decreasing_cost(item_tokens, item_costs, shuffled, by_tokens):
    """The items by decreasing cost, equal costs in ``shuffled``'s order."""
    count = shuffled.shape[0]
    positions = np.empty(count, dtype=np.int64)
    if by_tokens:
        token_keys = np.empty(count, dtype=np.int64)
        longest = np.int64(0)
        for k in range(count):
            token_keys[k] = item_tokens[shuffled[k]]
            longest = max(longest, token_keys[k])
        counts = np.empty(longest + 2, dtype=np.int64)
        order_by_decreasing(token_keys, longest, counting_pays(longest, count), counts, positions)
    else:
        cost_keys = np.empty(count, dtype=np.float64)
        for k in range(count):
            cost_keys[k] = item_costs[shuffled[k]]
        order_by_merging(cost_keys, positions, np.empty(count, dtype=np.int64))
    order = np.empty(count, dtype=np.int64)
    for k in range(count):
        order[k] = shuffled[positions[k]]
    return order


@njit(cache=True, nogil=True)
def _ranks(item_costs, order, world_size, exchange):
    """Each item's rank: longest processing time first, then exchanges that lower the busiest."""
    count = item_costs.shape[0]
    rank = np.empty(count, dtype=np.int64)
    micro = np.empty(count, dtype=np.int64)
    place_decreasing(item_costs, order, max(count, 1), world_size, rank, micro)
    rounds, pool, tries, good_enough = exchange
    total = 0.0
    whole = True  # cost is tokens: no rank gets below the mean rounded up
    for item in range(count):
        total += item_costs[item]
        whole = whole and item_costs[item] == np.floor(item_costs[item])
    mean = total / world_size
    target = max(mean * (1.0 + good_enough), np.ceil(mean) if whole else 0.0)
    exchange_items(item_costs, order, rank, world_size, rounds * world_size, pool, tries, target)
    return rank


@njit(cache=True, nogil=True)
def _units(lengths, cost, item_offsets, item_tokens, items, by_length, rank, world_size, max_tokens):
    """Units (an item that fits, else each of its entries) by rank, longest first, then in
    the order of ``items`` (an item's entries in order; ``by_length``: ``items`` are longest
    first already): entry ranges, lengths, costs, and each rank's units
    ``run_offsets[r]:run_offsets[r + 1]``."""
    count = 0
    for item in range(item_tokens.shape[0]):
        count += 1 if item_tokens[item] <= max_tokens else item_offsets[item + 1] - item_offsets[item]
    start = np.empty(count, dtype=np.int64)  # in the order of items
    end = np.empty(count, dtype=np.int64)
    unit_rank = np.empty(count, dtype=np.int64)
    run_offsets = np.zeros(world_size + 1, dtype=np.int64)
    u = 0
    for item in items:
        first, last = item_offsets[item], item_offsets[item + 1]
        whole = item_tokens[item] <= max_tokens
        for e in range(first, first + 1 if whole else last):
            start[u], end[u] = e, last if whole else e + 1
            unit_rank[u] = rank[item]
            run_offsets[rank[item] + 1] += 1
            u += 1
    for r in range(world_size):
        run_offsets[r + 1] += run_offsets[r]
    shortfall = np.empty(count, dtype=np.int64)  # max_tokens - the unit's tokens: longest first
    for k in range(count):
        shortfall[k] = max_tokens
        for e in range(start[k], end[k]):
            shortfall[k] -= lengths[e]
    order = np.empty(count, dtype=np.int64)
    for k in range(count):
        order[k] = k
    if not by_length:
        order = _counting_order(shortfall, max_tokens, order)
    order = _counting_order(unit_rank, world_size - 1, order)
    unit_start = np.empty(count, dtype=np.int64)
    unit_end = np.empty(count, dtype=np.int64)
    unit_length = np.empty(count, dtype=np.int64)
    unit_cost = np.zeros(count, dtype=np.float64)
    for k in range(count):
        unit_start[k], unit_end[k], unit_length[k] = start[order[k]], end[order[k]], max_tokens - shortfall[order[k]]
        for e in range(unit_start[k], unit_end[k]):
            unit_cost[k] += cost[e]
    return unit_start, unit_end, unit_length, unit_cost, run_offsets


@njit(cache=True, nogil=True, inline="always")
def _counting_order(keys, max_key, positions):
    """``positions`` (an order of ``keys``' indices) stably sorted by increasing key in ``0..max_key``."""
    counts = np.zeros(max_key + 2, dtype=np.int64)
    for p in positions:
        counts[keys[p] + 1] += 1
    for key in range(1, max_key + 2):
        counts[key] += counts[key - 1]
    out = np.empty(positions.shape[0], dtype=np.int64)
    for p in positions:
        out[counts[keys[p]]] = p
        counts[keys[p]] += 1
    return out


@njit(cache=True, nogil=True)
def _lay_out(out_members, out_offsets, unit_start, unit_end, lengths, loss, cost):
    """The entries of every micro-batch in order, their CSR offsets, and each micro-batch's sums."""
    slots = out_offsets.shape[0] - 1
    entries = np.empty(lengths.shape[0], dtype=np.int64)
    offsets = np.zeros(slots + 1, dtype=np.int64)
    tokens = np.zeros(slots, dtype=np.int64)
    loss_out = np.zeros(slots, dtype=np.int64)
    costs = np.zeros(slots, dtype=np.float64)
    cursor = 0
    for slot in range(slots):
        for p in range(out_offsets[slot], out_offsets[slot + 1]):
            unit = out_members[p]
            for e in range(unit_start[unit], unit_end[unit]):
                entries[cursor] = e
                cursor += 1
                tokens[slot] += lengths[e]
                loss_out[slot] += loss[e]
                costs[slot] += cost[e]
        offsets[slot + 1] = cursor
    return entries, offsets, tokens, loss_out, costs


@njit(cache=True, nogil=True, inline="always")
def _nothing(needed, item_costs):
    """The result when ``num_micro`` is too few: only ``needed`` (and the items' costs) filled."""
    empty = np.empty(0, dtype=np.int64)
    return empty, empty.copy(), empty.copy(), empty.copy(), np.empty(0, dtype=np.float64), needed, item_costs
