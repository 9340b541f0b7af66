"""Every numba kernel equals its pure-Python reference (tests/reference.py), plus the
properties each kernel promises, on hypothesis-generated inputs.

Inputs use the dtypes the planner passes (int32 lengths, int64 permutations, offsets
and tokens), so numba's on-disk cache serves these tests too.
"""

from __future__ import annotations

from random import Random

import numpy as np
import pytest
import reference as ref
from hypothesis import example, given
from hypothesis import strategies as st

from batchplan.kernels.assemble import lay_out_rows, take_scheduled
from batchplan.kernels.bin_layout import bin_lengths, place_slots, scatter_entries, unshuffle_groups
from batchplan.kernels.order import order_by_decreasing, order_by_merging
from batchplan.kernels.pack import (
    bin_destinations,
    bin_length_sums,
    fill_bins,
    most_bins,
    pack_bins,
    pack_segments,
)
from batchplan.kernels.pad import cut_padded
from batchplan.kernels.segments import lay_out_segments, range_sums
from batchplan.kernels.shuffle import count_groups, scatter_groups
from batchplan.kernels.steps import ramp_steps, steps_by_tokens
from batchplan.planning import randomness
from batchplan.planning.randomness import KeyStream, shuffle_by_group, unshuffle_by_group
from batchplan.reduce import segment_max, segment_sum

# --------------------------------------------------------------------------- strategies


def pack_items(lengths, order, max_tokens):
    """Best-fit decreasing as the bin of each item (`pack_segments` read back per item)."""
    offsets, members = pack_segments(lengths, order, max_tokens)
    bin_of_item = np.empty(lengths.shape[0], dtype=np.int64)
    bin_of_item[members] = np.repeat(np.arange(offsets.shape[0] - 1), np.diff(offsets))
    return bin_of_item


@st.composite
def items(draw, max_items: int = 40):
    """``(lengths int32, order int64 permutation, max_tokens)``, every length in 1..max_tokens.

    Mixes: max_tokens 1; small and large caps; few distinct lengths (many ties);
    every length == max_tokens; fully random lengths.
    """
    max_tokens = draw(st.one_of(st.just(1), st.integers(1, 64), st.integers(65, 4096)))
    count = draw(st.integers(0, max_items))
    pool = draw(st.lists(st.integers(1, max_tokens), min_size=1, max_size=3))
    lengths = draw(
        st.one_of(
            st.lists(st.sampled_from(pool), min_size=count, max_size=count),
            st.lists(st.integers(1, max_tokens), min_size=count, max_size=count),
            st.just([max_tokens] * count),
            st.lists(st.integers(max(1, max_tokens // 3), max_tokens), min_size=count, max_size=count),
        )
    )
    order = draw(st.permutations(range(count)))
    return np.array(lengths, dtype=np.int32), np.array(order, dtype=np.int64), max_tokens


def as_inputs(lengths, order, max_tokens):
    return np.array(lengths, dtype=np.int32), np.array(order, dtype=np.int64), max_tokens


EDGE_ITEMS = [
    as_inputs([], [], 8),  # empty input
    as_inputs([5], [0], 8),  # one item
    as_inputs([8], [0], 8),  # length == max_tokens
    as_inputs([1, 1, 1], [2, 0, 1], 1),  # max_tokens 1
    as_inputs([3] * 12, [11, 3, 7, 0, 5, 9, 1, 10, 2, 8, 4, 6], 10),  # many equal lengths
    as_inputs([6, 4, 6, 4, 2, 2, 3, 7, 1], [8, 0, 7, 1, 6, 2, 5, 3, 4], 10),  # residual ties
]


def with_edges(test):
    for case in EDGE_ITEMS:
        test = example(case)(test)
    return test


# --------------------------------------------------------------------------- pack


@given(items())
@with_edges
def test_pack_items_matches_reference(case):
    lengths, order, max_tokens = case
    found = pack_items(lengths, order, max_tokens)
    assert found.tolist() == ref.pack_items(lengths.tolist(), order.tolist(), max_tokens)


@given(items())
@with_edges
def test_pack_segments_matches_reference(case):
    """Bins as CSR, in creation order; inside a bin, items in placement order (longest first)."""
    lengths, order, max_tokens = case
    offsets, members = pack_segments(lengths, order, max_tokens)
    want_offsets, want_members = ref.pack_segments(lengths.tolist(), order.tolist(), max_tokens)
    assert offsets.tolist() == want_offsets
    assert members.tolist() == want_members


@given(items())
@with_edges
def test_pack_items_caps_and_exactly_once(case):
    lengths, order, max_tokens = case
    bins = pack_items(lengths, order, max_tokens).tolist()
    assert len(bins) == len(lengths)  # every item placed exactly once (one bin each)
    if not bins:
        return
    num_bins = max(bins) + 1
    assert sorted(set(bins)) == list(range(num_bins))  # no empty or skipped bin ids
    load = [0] * num_bins
    for item, b in enumerate(bins):
        load[b] += int(lengths[item])
    assert max(load) <= max_tokens
    assert num_bins >= -(-sum(load) // max_tokens)
    # Any-fit: a new bin opens only when nothing fits, so at most one bin is half empty or less.
    assert sum(1 for x in load if 2 * x <= max_tokens) <= 1
    # Bins are numbered in order of creation: first use in processing order is 0, 1, 2, ...
    first_use = []
    for item in ref.sort_by_length_desc(lengths.tolist(), order.tolist()):
        if bins[item] not in first_use:
            first_use.append(bins[item])
    assert first_use == list(range(num_bins))


def test_pack_items_equal_lengths_follow_order():
    """Ties among equal lengths are broken by ``order``: another permutation, another packing."""
    lengths = np.array([4, 3, 3, 3, 3, 2, 2], dtype=np.int32)
    first = pack_items(lengths, np.arange(7, dtype=np.int64), 7).tolist()
    second = pack_items(lengths, np.arange(7, dtype=np.int64)[::-1].copy(), 7).tolist()
    assert first == ref.pack_items(lengths.tolist(), list(range(7)), 7)
    assert first != second


def test_pack_items_most_recent_bin_wins_residual_ties():
    """Two bins reach residual 4; the item of length 4 joins the one that got there last."""
    lengths = np.array([6, 6, 4], dtype=np.int32)
    # bins: 0 <- item 0 (residual 4), 1 <- item 1 (residual 4): item 2 goes to bin 1.
    assert pack_items(lengths, np.arange(3, dtype=np.int64), 10).tolist() == [0, 1, 1]
    assert ref.pack_items([6, 6, 4], [0, 1, 2], 10) == [0, 1, 1]


# --------------------------------------------------------------------------- pad


@st.composite
def pad_inputs(draw):
    lengths, order, max_tokens = draw(items(max_items=60))
    window = draw(st.one_of(st.just(1), st.integers(1, 12), st.just(16_384)))
    batch_multiple = draw(st.one_of(st.just(1), st.integers(1, min(max_tokens, 8))))
    return lengths, order, window, max_tokens, batch_multiple


PAD_EDGES = [(*case[:2], window, case[2], 1) for case in EDGE_ITEMS for window in (1, 4, 16_384)]
PAD_EDGES += [
    (*as_inputs([3] * 12, list(range(12)), 10)[:2], 16_384, 10, 2),  # fit 3 rounded to 2
    (*as_inputs([3] * 12, list(range(12)), 10)[:2], 16_384, 10, 4),  # fewer than batch_multiple fit
    (*as_inputs([1] * 9, list(range(9)), 8)[:2], 5, 8, 4),  # window tails below batch_multiple
]


def with_pad_edges(test):
    for case in PAD_EDGES:
        test = example(case)(test)
    return test


def cut_in_place(lengths, order, window, max_tokens, batch_multiple):
    """`cut_padded` on a copy of ``order`` with its lengths: (offsets, members, member_lengths)."""
    members, member_lengths = order.copy(), lengths[order].astype(np.int32)
    offsets = cut_padded(members, member_lengths, window, max_tokens, batch_multiple)
    return offsets, members, member_lengths


@given(pad_inputs())
@with_pad_edges
def test_cut_padded_matches_reference(case):
    lengths, order, window, max_tokens, batch_multiple = case
    offsets, members, member_lengths = cut_in_place(lengths, order, window, max_tokens, batch_multiple)
    assert member_lengths.tolist() == lengths[members].tolist()
    want_offsets, want_members = ref.cut_padded(lengths.tolist(), order.tolist(), window, max_tokens, batch_multiple)
    assert offsets.tolist() == want_offsets
    assert members.tolist() == want_members


@given(pad_inputs())
@with_pad_edges
def test_cut_padded_caps_windows_and_batch_multiple(case):
    lengths, order, window, max_tokens, batch_multiple = case
    offsets, members, member_lengths = cut_in_place(lengths, order, window, max_tokens, batch_multiple)
    assert member_lengths.tolist() == lengths[members].tolist()
    offsets, members = offsets.tolist(), members.tolist()
    assert sorted(members) == sorted(order.tolist())  # exactly once
    assert offsets[0] == 0 and offsets[-1] == len(order)
    position_in_order = {item: i for i, item in enumerate(order.tolist())}
    for b in range(len(offsets) - 1):
        batch = members[offsets[b] : offsets[b + 1]]
        assert batch, "a padded micro-batch is never empty"
        sizes = [int(lengths[i]) for i in batch]
        assert sizes == sorted(sizes, reverse=True)  # longest first
        assert len(batch) * sizes[0] <= max_tokens
        windows = {position_in_order[i] // window for i in batch}
        assert len(windows) == 1, "a micro-batch never crosses a sorting window"
        # batch_multiple is kept unless fewer than that fit, or the window has fewer left.
        (w,) = windows
        window_end = min((w + 1) * window, len(order))
        is_window_tail = offsets[b + 1] == window_end
        fits = max_tokens // sizes[0]
        assert len(batch) % batch_multiple == 0 or fits < batch_multiple or is_window_tail
        # Greedy: the micro-batch could not take one more of its window's entries,
        # unless that would break batch_multiple.
        if not is_window_tail and batch_multiple == 1:
            assert (len(batch) + 1) * sizes[0] > max_tokens


# --------------------------------------------------------------------------- steps


@st.composite
def step_inputs(draw):
    count = draw(st.integers(0, 40))
    scale = draw(st.sampled_from([1, 10, 1000]))
    pool = draw(st.lists(st.integers(0, 20 * scale), min_size=1, max_size=3))
    tokens = draw(
        st.one_of(
            st.lists(st.integers(0, 20 * scale), min_size=count, max_size=count),
            st.lists(st.sampled_from(pool), min_size=count, max_size=count),
        )
    )
    target = draw(st.integers(1, 60 * scale))
    return np.array(tokens, dtype=np.int64), target


@given(step_inputs())
@example((np.zeros(0, dtype=np.int64), 10))  # no rounds
@example((np.array([7], dtype=np.int64), 10))  # one round (fewer rounds than a step wants)
@example((np.array([5, 5, 5, 5], dtype=np.int64), 10))  # exact ties
@example((np.array([50, 1, 1], dtype=np.int64), 10))  # one round alone above target
@example((np.array([0, 0, 3, 0], dtype=np.int64), 10))  # zero-token rounds
def test_steps_by_tokens_matches_reference(case):
    tokens, target = case
    assert steps_by_tokens(tokens, target).tolist() == ref.steps_by_tokens(tokens.tolist(), target)


@given(step_inputs())
def test_steps_by_tokens_stays_within_half_a_round(case):
    tokens, target = case
    offsets = steps_by_tokens(tokens, target).tolist()
    tokens = tokens.tolist()
    if not tokens:
        assert offsets == [0]
        return
    assert offsets[0] == 0 and offsets[-1] == len(tokens)
    assert all(a < b for a, b in zip(offsets, offsets[1:])), "every step takes at least one round"
    for s in range(len(offsets) - 1):
        begin, end = offsets[s], offsets[s + 1]
        total = sum(tokens[begin:end])
        if end - begin > 1:  # overshoot only by less than half the round that caused it
            assert total - target < tokens[end - 1] / 2 or total <= target
        if end < len(tokens):  # stopped because the next round would not bring it closer
            assert abs(total + tokens[end] - target) >= abs(total - target)


@st.composite
def ramp_inputs(draw):
    """``(round_tokens, tokens_before, start, target, ramp_tokens, max_rounds)``: ramps that end
    inside the rounds, before them (tokens_before past the ramp) or beyond them; no ramp (0);
    round limits 0 (token target) or 1..5 (micro-batches)."""
    tokens, target = draw(step_inputs())
    total = int(tokens.sum())
    start = draw(st.integers(1, target))
    ramp_tokens = draw(st.one_of(st.just(0), st.integers(1, max(1, total)), st.integers(total + 1, 2 * total + 2)))
    tokens_before = draw(st.one_of(st.just(0), st.integers(0, 2 * total + 2)))
    max_rounds = draw(st.integers(0, 5))
    return tokens, tokens_before, float(start), float(target), ramp_tokens, max_rounds


@given(ramp_inputs())
@example((np.zeros(0, dtype=np.int64), 0, 1.0, 10.0, 5, 0))  # no rounds
@example((np.full(7, 3, dtype=np.int64), 0, 3.0, 9.0, 0, 2))  # no ramp: fixed steps of 2 rounds
def test_ramp_steps_matches_reference(case):
    assert ramp_steps(*case).tolist() == ref.ramp_steps(case[0].tolist(), *case[1:])


@given(ramp_inputs())
def test_ramp_steps_follow_the_ramp(case):
    """Each step lands within half its last round of its own target, the target grows
    linearly with the tokens done, and past the ramp a round limit is an exact count."""
    tokens, before, start, target, ramp_tokens, max_rounds = case
    offsets = ramp_steps(*case).tolist()
    tokens = tokens.tolist()
    done = before
    for s in range(len(offsets) - 1):
        begin, end = offsets[s], offsets[s + 1]
        assert end > begin, "every step takes at least one round"
        goal = target if done >= ramp_tokens else start + (target - start) * done / ramp_tokens
        assert min(start, target) <= goal <= max(start, target)
        total = sum(tokens[begin:end])
        if max_rounds:
            assert end - begin <= max_rounds
            if done >= ramp_tokens and end < len(tokens):
                assert end - begin == max_rounds
        elif end - begin > 1:
            assert total - goal < tokens[end - 1] / 2 or total <= goal
        done += total


def test_steps_by_tokens_is_ramp_steps_without_a_ramp():
    tokens = np.random.default_rng(0).integers(0, 100, 500)
    assert steps_by_tokens(tokens, 350).tolist() == ramp_steps(tokens, 0, 350.0, 350.0, 0, 0).tolist()


# --------------------------------------------------------------------------- balance


@st.composite
def balance_inputs(draw):
    world_size = draw(st.one_of(st.sampled_from([1, 2, 3, 8, 64]), st.integers(1, 9)))
    per_rank = draw(st.lists(st.integers(0, 4), max_size=5))
    sizes = [p * world_size for p in per_rank]
    count = sum(sizes)
    pool = draw(st.lists(st.integers(0, 10_000), min_size=1, max_size=3))
    costs = draw(
        st.one_of(
            st.lists(st.integers(0, 10_000), min_size=count, max_size=count),
            st.lists(st.sampled_from(pool), min_size=count, max_size=count),
        )
    )
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
    return np.array(costs, dtype=np.int64), offsets, world_size


def with_balance_edges(test):
    for case in BALANCE_EDGES:
        test = example(case)(test)
    return test


BALANCE_EDGES = [
    (np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64), 8),  # no micro-batches
    (np.array([5], dtype=np.int64), np.array([0, 1], dtype=np.int64), 1),  # one micro-batch
    (np.array([9, 0, 0, 4] + [0] * 60, dtype=np.int64), np.array([0, 64], dtype=np.int64), 64),  # empties
    (np.array([3, 3, 3, 3, 3, 3], dtype=np.int64), np.array([0, 6], dtype=np.int64), 3),  # all equal
    (np.array([4, 4, 2, 2, 1, 1], dtype=np.int64), np.array([0, 2, 6], dtype=np.int64), 2),  # two steps
]


def lay_out(offsets, costs, batch, tokens, sizes, loss, compute, world_size, rows, row_compute, parts=1):
    """`lay_out_rows` in ``parts`` calls, one after another, filling ``rows`` (4, positions) with
    batch, tokens, loss, sizes: ``(step, micro, num_micro, step_tokens, step_loss)``."""
    rank_rows = np.empty((3, offsets[-1] // world_size), dtype=np.int64)
    step_sums = np.zeros((2, offsets.shape[0] - 1), dtype=np.int64)
    for part in range(parts):
        lay_out_rows(
            offsets,
            costs,
            batch,
            tokens,
            sizes,
            loss,
            compute,
            world_size,
            rows[0::3],
            rows[1:3],
            row_compute,
            rank_rows,
            step_sums,
            part,
            parts,
        )
    return (*rank_rows, *step_sums)


@given(balance_inputs(), st.booleans(), st.booleans(), st.booleans(), st.integers(1, 3))
@example(BALANCE_EDGES[2], True, True, True, 1)
@example(BALANCE_EDGES[4], False, True, True, 2)
def test_lay_out_rows_matches_assign_ranks_and_order_rows(case, with_loss, with_compute, float_costs, parts):
    """The layout = the references `assign_ranks` + `order_rows`, plus the per-row values and step sums."""
    costs, offsets, world_size = case
    count = costs.shape[0]
    balance_by = costs * 0.5 if float_costs else costs  # compute (float64) or tokens (int64)
    batch = np.arange(count, dtype=np.int64)[::-1].copy()
    tokens = costs + 3
    sizes = costs % 4 + 1
    loss = (tokens - sizes - 1) if with_loss else np.zeros(0, dtype=np.int64)
    compute = tokens * 1.5 if with_compute else np.zeros(0, dtype=np.float64)
    rows, row_compute = np.empty((4, count), dtype=np.int64), np.empty(compute.shape[0])
    found = lay_out(offsets, balance_by, batch, tokens, sizes, loss, compute, world_size, rows, row_compute, parts)
    step, micro, num_micro, step_tokens, step_loss = found
    row_batch, row_tokens, row_loss, row_sizes = rows
    rank, want_micro = ref.assign_ranks(balance_by.tolist(), offsets.tolist(), world_size)
    rows = ref.order_rows(offsets.tolist(), rank, want_micro, world_size)
    position = [row[0] for row in rows]
    lost = (loss if with_loss else tokens - sizes).tolist()
    assert row_batch.tolist() == [int(batch[p]) for p in position]
    assert row_tokens.tolist() == [int(tokens[p]) for p in position]
    assert row_sizes.tolist() == [int(sizes[p]) for p in position]
    assert row_loss.tolist() == [lost[p] for p in position]
    assert row_compute.tolist() == ([float(compute[p]) for p in position] if with_compute else [])
    per_rank = count // world_size
    assert [(s, m, n) for s, m, n in zip(step.tolist(), micro.tolist(), num_micro.tolist())] == [
        (row[1], row[3], row[4]) for row in rows[:per_rank]
    ]
    assert all(
        row[1:2] + row[3:] == rows[r * per_rank + i][1:2] + rows[r * per_rank + i][3:]
        for r in range(world_size)
        for i, row in enumerate(rows[:per_rank])
    )
    assert step_tokens.tolist() == ref.segment_sum(tokens.tolist(), offsets.tolist())
    assert step_loss.tolist() == ref.segment_sum(lost, offsets.tolist())


@st.composite
def schedules(draw):
    """A shuffled schedule of micro-batches with tokens, ranges and costs, a balanced range
    ``begin:end`` of whole rounds, a window (0: none) and a round order."""
    world_size = draw(st.integers(1, 4))
    count = draw(st.integers(0, 40))
    tokens = np.array(draw(st.lists(st.integers(0, 9), min_size=count, max_size=count)), dtype=np.int64)
    starts = np.arange(count, dtype=np.int64) * 3
    ends = starts + tokens % 3
    schedule = np.array(draw(st.permutations(range(count))), dtype=np.int64)
    rounds = count // world_size
    first = draw(st.integers(0, rounds))
    last = draw(st.integers(first, rounds))
    begin, end = first * world_size, last * world_size
    window = draw(st.sampled_from([0, 1, 2, 3])) * world_size
    round_order = np.array(draw(st.permutations(range(last - first))) if window else [], dtype=np.int64)
    values = np.array(draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=count, max_size=count)))
    return schedule, begin, end, window, round_order, world_size, tokens, starts, ends, values


@given(schedules(), st.booleans(), st.booleans(), st.integers(1, 3), st.sampled_from([9, 10_000]))
def test_take_scheduled_matches_reference(case, with_values, by_values, parts, max_tokens):
    """Outside ``begin:end`` a plain gather; inside, windows sorted by cost (the reference's
    `sort_within_windows`), then round ``j`` = sorted round ``round_order[j]``; in one call
    or in parts."""
    schedule, begin, end, window, round_order, world_size, tokens, starts, ends, values = case
    values = values if with_values else np.zeros(0)
    by_values = by_values and with_values
    table = np.column_stack([tokens, ends - starts])
    got = [np.empty((3, schedule.shape[0]), dtype=np.int64), np.empty(values.shape[0])]
    for part in range(parts):
        # max_tokens 9 (every token count here is below 10): windows sorted by counting; 10,000: by comparison.
        take_scheduled(
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
            *got,
            part,
            parts,
        )
    got = [*got[0], got[1]]
    order = list(schedule)
    if window:
        costs = [float(values[k] if by_values else tokens[k]) for k in order[begin:end]]
        ranked = [order[begin + p] for p in ref.sort_within_windows(costs, window)]
        rounds = [ranked[c * world_size : (c + 1) * world_size] for c in range(len(ranked) // world_size)]
        order[begin:end] = [k for j in round_order for k in rounds[j]]
    assert got[0].tolist() == order
    assert got[1].tolist() == [int(tokens[k]) for k in order]
    assert got[2].tolist() == [int(ends[k] - starts[k]) for k in order]
    assert got[3].tolist() == ([float(values[k]) for k in order] if with_values else [])


@given(balance_inputs())
@with_balance_edges
def test_lay_out_rows_gives_every_rank_equal_counts(case):
    """Each rank's rows hold every scheduled position once per step: per_rank of each step."""
    costs, offsets, world_size = case
    count = costs.shape[0]
    rows = np.empty((4, count), dtype=np.int64)
    batch, none = np.arange(count), np.zeros(0)
    found = lay_out(offsets, costs, batch, costs, costs, costs[:0], none, world_size, rows, none)
    row_batch, step, micro = rows[0].tolist(), found[0].tolist(), found[1].tolist()
    assert sorted(row_batch) == list(range(count))
    per_rank_rows = count // world_size
    for rank in range(world_size):
        rows = row_batch[rank * per_rank_rows : (rank + 1) * per_rank_rows]
        for position, s in zip(rows, step):
            assert offsets[s] <= position < offsets[s + 1]  # the row's step holds it
    for s in range(len(offsets) - 1):
        per_rank = (offsets[s + 1] - offsets[s]) // world_size
        assert [m for m, t in zip(micro, step) if t == s] == list(range(per_rank))


@given(
    st.lists(st.integers(0, 12), max_size=80),
    st.integers(0, 2**32 - 1),
    st.integers(0, 5),
)
@example([], 0, 0)
@example([5], 7, 0)
@example([3] * 20, 123, 2)
def test_shuffle_by_group_matches_reference(groups, seed, first):
    keys = np.random.default_rng(seed).integers(0, 2**32, size=len(groups), dtype=np.uint32)
    for dtype in (np.int32, np.uint16):
        items = np.empty(len(groups), dtype=np.int32)
        start = shuffle_by_group(np.array(groups, dtype=dtype), 13, keys, items, first)
        assert (items.tolist(), start.tolist()) == ref.shuffle_by_group(groups, 13, keys.tolist(), first)
        assert items.dtype == np.int32
    # Values carried along land next to their items; the items are the same.
    values = np.arange(100, 100 + len(groups), dtype=np.int32)
    carried = np.empty(len(groups), dtype=np.int32)
    again = np.empty(len(groups), dtype=np.int64)
    shuffle_by_group(np.array(groups, dtype=np.int32), 13, keys, again, first, values, carried)
    assert again.tolist() == items.tolist()
    assert carried.tolist() == (values[again - first]).tolist()


@given(st.integers(0, 3000), st.integers(1, 13), st.integers(0, 2**32 - 1), st.integers(1, 4), st.booleans())
@example(0, 1, 0, 4, False)
@example(1000, 1, 5, 3, True)  # one group spans every part
def test_shuffle_by_group_in_parts_matches_reference(count, num_groups, seed, threads, carry):
    """The three passes split over threads (shares of the items, then of the groups) give
    the one-thread result, the reference's."""
    rng = np.random.default_rng(seed)
    groups = rng.integers(0, num_groups, size=count, dtype=np.uint16)
    keys = rng.integers(0, 2**32, size=count, dtype=np.uint32)
    values = rng.integers(0, 1000, size=count, dtype=np.int32) if carry else None
    carried = np.empty(count, dtype=np.int32) if carry else None
    items = np.empty(count, dtype=np.int64)
    start = shuffle_by_group(groups, num_groups, keys, items, 7, values, carried, threads=threads)
    assert (items.tolist(), start.tolist()) == ref.shuffle_by_group(groups.tolist(), num_groups, keys.tolist(), 7)
    if carry:
        assert np.array_equal(carried, values[items - 7])


@pytest.mark.parametrize("threads", [0, -1])
def test_shuffle_by_group_takes_fewer_than_one_thread_as_one(threads):
    """As `run_in_parts` does: no part-count array of zero rows for the kernels to write past."""
    groups = np.arange(1000, dtype=np.uint16) % 4
    keys = np.random.default_rng(0).integers(0, 2**32, size=1000, dtype=np.uint32)
    one, other = np.empty(1000, dtype=np.int64), np.empty(1000, dtype=np.int64)
    start = shuffle_by_group(groups, 4, keys, one)
    assert np.array_equal(start, shuffle_by_group(groups, 4, keys, other, threads=threads))
    assert np.array_equal(one, other)


def test_shuffle_by_group_refuses_arrays_of_other_lengths():
    """The kernels do not check bounds: sizes are checked before they run."""
    groups = np.zeros(10, dtype=np.int32)
    keys = np.zeros(10, dtype=np.uint32)
    with pytest.raises(ValueError, match="one entry per item"):
        shuffle_by_group(groups, 1, keys, np.empty(9, dtype=np.int64))
    with pytest.raises(ValueError, match="one entry per item"):
        shuffle_by_group(groups, 1, keys[:5], np.empty(10, dtype=np.int64))
    with pytest.raises(ValueError, match="together"):
        shuffle_by_group(groups, 1, keys, np.empty(10, dtype=np.int64), 0, np.zeros(10, dtype=np.int32), None)


@given(st.integers(0, 3), st.integers(0, 40), st.integers(0, 40), st.integers(1, 9), st.booleans())
@example(1, 40, 7, 3, True)  # a kept half from before, an odd start
def test_key_stream_reads_back_the_draws(drawn_before, count, first, size, jumps):
    """A `KeyStream` gives, in chunks from any position, the keys ``rng.integers`` would have
    drawn; the generator continues as if it had drawn them (a uint32 draw keeps half of a
    64-bit output for the next: odd counts before and in the stream); the same for a bit
    generator that cannot jump ahead (it draws them)."""
    make = (lambda: np.random.default_rng(5)) if jumps else (lambda: np.random.Generator(np.random.MT19937(5)))
    drawn, later = make(), make()
    for rng in (drawn, later):
        rng.integers(0, 2**32, size=drawn_before, dtype=np.uint32)
    keys = drawn.integers(0, 2**32, size=count, dtype=np.uint32)
    stream = KeyStream.draw_later(later, count)
    after = [rng.integers(0, 2**32, size=3, dtype=np.uint32).tolist() for rng in (later, drawn)]
    assert after[0] == after[1]
    assert later.random() == drawn.random()
    first = min(first, count)
    chunks = list(stream.chunks(first, count, size))
    assert [position for position, _ in chunks] == list(range(first, count, size))
    assert np.concatenate([np.zeros(0, dtype=np.uint32), *(k for _, k in chunks)]).tolist() == keys[first:].tolist()
    with pytest.raises(ValueError, match="asked of a stream"):
        next(stream.chunks(0, count + 1))


@given(st.lists(st.integers(0, 9), max_size=80), st.lists(st.integers(0, 10), max_size=4), st.integers(1, 3))
@example([3, 1, 3, 0, 1], [2], 2)
def test_groups_written_a_range_at_a_time_land_where_one_call_writes_them(groups, cuts, parts):
    """`scatter_groups` over ranges of groups, in parts, the cursors kept between calls: each
    call writes its groups' items where one call for every group writes them (in item order
    within a group), and no position of a group not yet written."""
    groups = np.array(groups, dtype=np.uint16)
    counts = np.zeros((parts, 10), dtype=np.int64)
    for part in range(parts):
        count_groups(groups, counts, part, parts)
    start = np.concatenate([[0], np.cumsum(counts.sum(axis=0))])
    cursors = start[:-1] + np.cumsum(counts, axis=0) - counts
    want = np.argsort(groups, kind="stable") + 5
    items = np.full(groups.shape[0], -1, dtype=np.int64)
    bounds = [0, *sorted(set(cuts)), 10]
    for low, high in zip(bounds[:-1], bounds[1:]):
        for part in range(parts):
            scatter_groups(groups, cursors, items, 5, None, None, low, high, part, parts)
        assert items[: start[high]].tolist() == want[: start[high]].tolist()
        assert (items[start[high] :] == -1).all()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("count, num_groups", [(0, 3), (1, 1), (50, 1), (300, 7), (1000, 40)])
def test_unshuffle_by_group_undoes_shuffle_by_group(monkeypatch, threads, count, num_groups):
    """Items shuffled within groups, then unshuffled with the same keys (read in chunks of 16, in
    parts on threads): back in their order before the shuffle, wherever the groups' values lie."""
    monkeypatch.setattr(randomness, "KEY_CHUNK", 16)
    rng = np.random.default_rng(count)
    groups = rng.integers(0, num_groups, size=count, dtype=np.int32)
    stream = KeyStream.draw_later(rng, count)
    keys = np.concatenate([np.zeros(0, dtype=np.uint32), *(k for _, k in stream.chunks(0, count))])
    items = np.empty(count, dtype=np.int64)
    start = shuffle_by_group(groups, num_groups, keys, items)
    # The groups' values laid out last group first (as slots are: longest first).
    block = count - start[1:]
    laid = [items[start[g] : start[g + 1]] for g in range(num_groups)][::-1]
    values = np.concatenate([np.zeros(0, dtype=np.int64), *laid])
    unshuffle_by_group(stream, start, block, values, threads=threads)
    by_group = np.argsort(groups, kind="stable")
    assert [values[block[g] : block[g] + start[g + 1] - start[g]].tolist() for g in range(num_groups)] == [
        by_group[start[g] : start[g + 1]].tolist() for g in range(num_groups)
    ]


def test_shuffle_by_group_is_a_fair_shuffle():
    """Each of 4 items of one group lands first about a quarter of the time."""
    groups = np.full(4, 3, dtype=np.int32)
    firsts = np.zeros(4)
    rng = np.random.default_rng(0)
    for _ in range(4000):
        keys = rng.integers(0, 2**32, size=4, dtype=np.uint32)
        items = np.empty(4, dtype=np.int64)
        shuffle_by_group(groups, 4, keys, items)
        firsts[items[0]] += 1
    assert np.all(np.abs(firsts / 4000 - 0.25) < 0.03)


def test_random_groups_then_shuffles_give_uniform_permutations():
    """Items in random groups, shuffled within each (what `permute` does): each of the 6
    permutations of 3 items comes out about a sixth of the time."""
    rng = np.random.default_rng(1)
    counts: dict[tuple[int, ...], int] = {}
    draws = 12000
    for _ in range(draws):
        groups = rng.integers(0, 4, size=3, dtype=np.uint16)
        keys = rng.integers(0, 2**32, size=3, dtype=np.uint32)
        items = np.empty(3, dtype=np.int64)
        shuffle_by_group(groups, 4, keys, items)
        counts[tuple(items.tolist())] = counts.get(tuple(items.tolist()), 0) + 1
    assert len(counts) == 6
    assert all(abs(count / draws - 1 / 6) < 0.015 for count in counts.values())


def grouped(lengths, order, max_tokens, dtype=np.int64):
    """``order`` grouped by length (shortest first, ``order`` kept within a length), with the
    ``max_tokens + 2`` offsets `group_offsets(lengths, max_tokens + 1)` gives; items as ``dtype``."""
    items = order[np.argsort(lengths[order], kind="stable")].astype(dtype)
    return items, np.concatenate([[0], np.cumsum(np.bincount(lengths, minlength=max_tokens + 1))]).astype(np.int64)


def with_edges_and_seed(test):
    for case in EDGE_ITEMS:
        test = example(case, 0)(test)
    return test


@given(items(), st.integers(0, 2**16))
@with_edges_and_seed
def test_packed_bins_give_the_bins_of_pack_segments(case, seed):
    """`pack_bins` + `fill_bins` is `pack_segments`, with the big outputs made by the caller or not."""
    random = Random(seed)
    lengths, order, max_tokens = case
    items, start = grouped(lengths, order, max_tokens, dtype=random.choice([np.int32, np.int64]))
    slot_bin, offsets, tokens = pack_bins(items, start, max_tokens)
    # The same with the big outputs made by the caller (as the planner does, with numpy).
    bound = most_bins(np.diff(start)[: max_tokens + 1], max_tokens)
    buffers = (
        np.empty(items.shape[0], dtype=items.dtype),
        np.zeros(bound + 1, dtype=items.dtype),
        np.empty(bound, dtype=items.dtype),
        np.empty(bound, dtype=items.dtype),
    )
    again = pack_bins(items, start, max_tokens, *buffers)
    assert [a.tolist() for a in again] == [slot_bin.tolist(), offsets.tolist(), tokens.tolist()]
    members, member_lengths = fill_bins(items, start, slot_bin, offsets, max_tokens)
    want_offsets, want_members = ref.pack_segments(lengths.tolist(), order.tolist(), max_tokens)
    assert (offsets.tolist(), members.tolist(), members.dtype) == (want_offsets, want_members, items.dtype)
    assert member_lengths.tolist() == lengths[members].tolist()
    assert tokens.tolist() == ref.segment_sum(member_lengths.tolist(), want_offsets)


def random_layout(random: Random, offsets):
    """Some bins whole, some cut into 1-4 pieces (1: the whole bin as a piece), some left out,
    some empty micro-batches, then shuffled: ``(starts, ends, layout)`` over bins and pieces."""
    num_bins = offsets.shape[0] - 1
    starts, ends, order_of = list(offsets[:-1]), list(offsets[1:]), []
    for b in range(num_bins):
        choice = random.choice(["whole", "whole", "cut", "out"])
        if choice == "whole":
            order_of.append(b)
        elif choice == "cut":
            inner = range(offsets[b] + 1, offsets[b + 1])
            cuts = [offsets[b], *sorted(random.sample(inner, min(len(inner), random.randrange(4)))), offsets[b + 1]]
            for first, end in zip(cuts[:-1], cuts[1:]):
                starts.append(first), ends.append(end), order_of.append(len(starts) - 1)
    for _ in range(random.randrange(3)):
        starts.append(0), ends.append(0), order_of.append(len(starts) - 1)
    random.shuffle(order_of)
    return tuple(np.array(x, dtype=np.int64) for x in (starts, ends, order_of))


@given(items(max_items=60), st.integers(0, 2**16))
@with_edges_and_seed
def test_bin_layout_lays_out_the_shuffled_entries_bins_in_any_layout(case, seed):
    """Entries shuffled within each length with keys (`shuffle_by_group`), packed and filled into
    bins: `place_slots`, `unshuffle_groups` (keys in chunks) and `scatter_entries` (in parts, and
    a window at a time) lay those bins (and pieces of bins, leaving the rest out) in any order,
    from the entries alone, exactly as a gather of the filled bins does."""
    random = Random(seed)
    lengths, _, max_tokens = case
    count, dtype = lengths.shape[0], random.choice([np.int32, np.int64])
    keys = np.random.default_rng(seed).integers(0, 2**32, size=count, dtype=np.uint32)
    items = np.empty(count, dtype=dtype)
    start = shuffle_by_group(lengths, max_tokens + 1, keys, items)
    slot_bin, offsets, tokens = pack_bins(items, start, max_tokens)
    members, _ = fill_bins(items, start, slot_bin, offsets, max_tokens)
    starts, ends, layout = random_layout(random, offsets)
    sizes = ends[layout] - starts[layout]
    parts = random.randint(1, 3)  # the kernels split into parts, called one after another
    out_offsets = np.full(sizes.shape[0] + 1, -7, dtype=np.int64)
    destination = np.full(tokens.shape[0], -1, dtype=np.int64)
    for part in range(parts):
        bin_destinations(layout, sizes, out_offsets, destination, part, parts)
    want_offsets, want = ref.gather_segments(members.tolist(), starts.tolist(), ends.tolist(), layout.tolist())
    assert out_offsets.tolist() == want_offsets
    assert destination.tolist() == [
        int(out_offsets[layout.tolist().index(b)]) if b in layout.tolist() else -1 for b in range(tokens.shape[0])
    ]
    pieces = np.array([i for i, k in enumerate(layout.tolist()) if k >= tokens.shape[0]], dtype=np.int64)
    pieces = pieces[sizes[pieces] > 0]  # the contract: non-empty pieces sorted by start
    by_start = np.argsort(starts[layout[pieces]], kind="stable")
    source = slot_bin.copy()
    places = source if random.random() < 0.5 else np.empty_like(source)  # written over the bins, or apart
    piece_starts, piece_ends = starts[layout[pieces]][by_start], ends[layout[pieces]][by_start]
    placed = place_slots(source, offsets, destination, piece_starts, piece_ends, out_offsets[pieces][by_start], places)
    assert placed == len(want)
    block = count - start[1:]  # slots go longest first
    cut = random.randint(0, count)
    for first, last in ((0, cut), (cut, count)):  # the keys in two chunks
        unshuffle_groups(start, block, keys[first:last], first, places)
    counts = np.zeros((parts, max_tokens + 1), dtype=np.int64)
    for part in range(parts):
        count_groups(lengths, counts, part, parts)
    cursors = block + np.cumsum(counts, axis=0) - counts
    laid = np.full(len(want), -1, dtype=dtype)
    base = random.randint(0, 3)  # the entries' first id, when they are a part of more
    written = sum(scatter_entries(lengths, cursors, places, None, laid, 0, base, part, parts) for part in range(parts))
    assert (laid.tolist(), written) == ([member + base for member in want], len(want))
    window = random.randint(1, max(1, len(want)))  # the same members, a window at a time
    for first in range(0, len(want), window):
        cursors = block + np.cumsum(counts, axis=0) - counts
        laid = np.full(min(window, len(want) - first), -1, dtype=dtype)
        written = sum(
            scatter_entries(lengths, cursors, places, None, laid, first, 0, part, parts) for part in range(parts)
        )
        assert (laid.tolist(), written) == (want[first : first + window], laid.shape[0])
    values = (np.arange(count, dtype=np.int32) * 7) % 5  # values written instead of entries
    cursors = block + np.cumsum(counts, axis=0) - counts
    laid_values = np.full(len(want), -1, dtype=np.int32)
    for part in range(parts):
        scatter_entries(lengths, cursors, places, values, laid_values, 0, 0, part, parts)
    assert laid_values.tolist() == [int(values[m]) for m in want]


@given(items())
@with_edges
def test_bin_sums_and_bin_lengths_match_reference(case):
    lengths, order, max_tokens = case
    items, start = grouped(lengths, order, max_tokens)
    slot_bin, offsets, tokens = pack_bins(items, start, max_tokens)
    want_offsets, want_members = ref.pack_segments(lengths.tolist(), order.tolist(), max_tokens)
    num_bins = tokens.shape[0]
    table = np.arange(max_tokens + 1, dtype=np.float64) ** 2 / 3.0
    want = [0.0] * num_bins
    for b in range(num_bins):
        for m in want_members[want_offsets[b] : want_offsets[b + 1]]:
            want[b] += float(table[lengths[m]])  # left to right, as the members lie
    assert bin_length_sums(table, start, slot_bin, num_bins, max_tokens).tolist() == want
    wanted = np.arange(0, num_bins, 2, dtype=np.int64)
    local, member_lengths = bin_lengths(start, slot_bin, offsets, wanted, max_tokens)
    expect = [[int(lengths[m]) for m in want_members[want_offsets[b] : want_offsets[b + 1]]] for b in wanted]
    assert [member_lengths[local[i] : local[i + 1]].tolist() for i in range(wanted.shape[0])] == expect


# --------------------------------------------------------------------------- segments


@st.composite
def segments(draw):
    """CSR segments given as (members, starts, ends), possibly empty, plus an order over them."""
    sizes = draw(st.lists(st.integers(0, 6), max_size=10))
    members = draw(st.permutations(range(sum(sizes))))
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
    order = draw(st.permutations(range(len(sizes))))
    values = draw(st.lists(st.integers(0, 10_000), min_size=sum(sizes), max_size=sum(sizes)))
    return (
        np.array(members, dtype=np.int64),
        offsets,
        np.array(order, dtype=np.int64),
        np.array(values, dtype=np.int32),  # the planner reduces int32 entry lengths
    )


@given(segments())
def test_segment_reductions_and_lay_out_segments_match_reference(case):
    members, offsets, order, values = case
    assert segment_sum(values, offsets).tolist() == ref.segment_sum(values.tolist(), offsets.tolist())
    assert segment_max(values, offsets).tolist() == ref.segment_max(values.tolist(), offsets.tolist())
    starts, ends = offsets[:-1].copy(), offsets[1:].copy()
    sums = range_sums(values.astype(np.float64), starts, ends, np.zeros(starts.shape[0]))
    assert sums.tolist() == [float(v) for v in ref.segment_sum(values.tolist(), offsets.tolist())]
    totals = range_sums(values, starts, ends, np.zeros(starts.shape[0], dtype=np.int64))
    assert totals.tolist() == ref.segment_sum(values.tolist(), offsets.tolist())
    for named in (order, order[::2]):  # every segment, or some left out
        new_members = np.empty(int((ends - starts)[named].sum()), dtype=members.dtype)
        destination = np.empty(starts.shape[0], dtype=np.int64)
        new_offsets, written = lay_out_segments(members, starts, ends, named, destination, new_members)
        assert written == new_members.shape[0]
        want = ref.gather_segments(members.tolist(), starts.tolist(), ends.tolist(), named.tolist())
        assert (new_offsets.tolist(), new_members.tolist()) == want


def test_lay_out_segments_counts_what_it_wrote():
    """A segment named twice is written once (the count tells); an out of the wrong size is refused."""
    members = np.arange(6, dtype=np.int64)
    starts, ends = np.array([0, 2], dtype=np.int64), np.array([2, 6], dtype=np.int64)
    destination = np.empty(2, dtype=np.int64)
    offsets, written = lay_out_segments(members, starts, ends, np.array([1, 1]), destination, np.empty(8, np.int64))
    assert offsets.tolist() == [0, 4, 8] and written == 4
    with pytest.raises(ValueError, match="exactly"):
        lay_out_segments(members, starts, ends, np.array([1, 0]), destination, np.empty(5, dtype=np.int64))


@given(st.lists(st.integers(0, 20), max_size=60), st.booleans())
def test_order_by_decreasing_is_a_stable_sort(keys, by_counting):
    """Both ways (counting over 0..20, comparison) give Python's stable sort by -key."""
    order = np.full(len(keys), -1, dtype=np.int64)
    order_by_decreasing(np.array(keys, dtype=np.int64), 20, by_counting, np.empty(22, dtype=np.int64), order)
    assert order.tolist() == sorted(range(len(keys)), key=lambda i: -keys[i])


@given(st.lists(st.integers(0, 70_000), max_size=200), st.booleans())
def test_order_by_decreasing_sorts_keys_of_several_digits(keys, by_counting):
    """Keys of up to three radix digits (max_key 70,000), both ways: Python's stable sort by -key."""
    order = np.full(len(keys), -1, dtype=np.int64)
    order_by_decreasing(np.array(keys, dtype=np.int64), 70_000, by_counting, np.empty(70_002, dtype=np.int64), order)
    assert order.tolist() == sorted(range(len(keys)), key=lambda i: -keys[i])


_FLOAT_KEYS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), -float("inf")]),  # ties, signed zeros
)


@given(keys=st.lists(_FLOAT_KEYS, max_size=200))
@example(keys=[1.0] * 40 + [2.0] * 40)  # runs of equal keys across the merge passes
@example(keys=[float("nan"), 0.0, -0.0, float("nan"), 0.0] * 9)
def test_order_by_merging_is_numpys_stable_order_by_decreasing_key(keys):
    """The merge sort gives exactly ``np.argsort(-keys, kind="stable")`` (larger first, NaN
    last, ties in input order), past one insertion run (16) and across several merge passes."""
    values = np.array(keys, dtype=np.float64)
    order = np.full(values.shape[0], -1, dtype=np.int64)
    order_by_merging(values, order, np.empty(values.shape[0], dtype=np.int64))
    assert order.tolist() == np.argsort(-values, kind="stable").tolist()


@pytest.mark.parametrize("by_counting", [True, False])
def test_order_by_decreasing_refuses_a_key_out_of_range(by_counting):
    with pytest.raises(ValueError, match="outside"):
        order_by_decreasing(
            np.array([3, 21]), 20, by_counting, np.empty(22, dtype=np.int64), np.empty(2, dtype=np.int64)
        )
