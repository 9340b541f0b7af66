"""`batchplan.plan_batch`: one batch planned in the training loop, with the offline plan's guarantees.

Each guarantee is a named test on hypothesis-generated batches (world_size above the number of
sequences, a sequence at the cap, groups larger than a micro-batch, oversize sequences split),
then on the adversarial batches of the peers' issue trackers. The kernels it adds are checked
against slow references first.
"""

from __future__ import annotations

import heapq
import itertools
import re
from pathlib import Path

import numpy as np
import pytest
import reference
from _modules import loaded_after
from hypothesis import example, given
from hypothesis import strategies as st

import batchplan
from batchplan.errors import ConfigError, DatasetError
from batchplan.kernels.balance import place_decreasing
from batchplan.kernels.batch import split_batch
from batchplan.kernels.even_counts import even_out_counts
from batchplan.kernels.exchange import exchange_items
from batchplan.kernels.pack import pack_runs
from batchplan.planning.batch import plan_batch

# ---------------------------------------------------------------- kernels against references


@st.composite
def runs(draw):
    max_tokens = draw(st.integers(1, 40))
    sizes = draw(st.lists(st.integers(0, 25), min_size=1, max_size=6))
    lengths = [sorted(draw(st.lists(st.integers(1, max_tokens), min_size=k, max_size=k)), reverse=True) for k in sizes]
    return lengths, max_tokens


@given(runs())
@example(([[5, 5, 5], [], [5]], 5))  # every length at the cap
def test_pack_runs_packs_each_run_as_the_reference_packs_it_alone(case):
    run_lengths, max_tokens = case
    flat = np.array([x for run in run_lengths for x in run], dtype=np.int64)
    run_offsets = np.concatenate(([0], np.cumsum([len(run) for run in run_lengths]))).astype(np.int64)
    members, bin_offsets, bin_tokens, run_bins = pack_runs(flat, run_offsets, max_tokens)
    for run, lengths in enumerate(run_lengths):
        offsets, items = reference.pack_segments(lengths, range(len(lengths)), max_tokens)
        bins = range(run_bins[run], run_bins[run + 1])
        got = [list(members[bin_offsets[b] : bin_offsets[b + 1]] - run_offsets[run]) for b in bins]
        want = [items[offsets[k] : offsets[k + 1]] for k in range(len(offsets) - 1)]
        assert got == want
        assert [int(bin_tokens[b]) for b in bins] == [sum(lengths[i] for i in bin_) for bin_ in want]


def test_pack_runs_refuses_a_run_not_longest_first():
    with pytest.raises(ValueError, match="longest first"):
        pack_runs(np.array([1, 2], dtype=np.int64), np.array([0, 2], dtype=np.int64), 4)


def place_by_scan(costs, per_rank, world_size):
    """Decreasing cost (stable), each to the least-loaded rank with room; ties: lowest rank."""
    load, taken, rank = [0.0] * world_size, [0] * world_size, [-1] * len(costs)
    for item in sorted(range(len(costs)), key=lambda i: -costs[i]):
        best = min((r for r in range(world_size) if taken[r] < per_rank), key=lambda r: (load[r], r))
        rank[item] = best
        taken[best] += 1
        load[best] += costs[item]
    return rank


@given(st.lists(st.sampled_from([0.0, 1.0, 2.0, 2.5, 7.0, 100.0]), max_size=80), st.integers(1, 40), st.booleans())
def test_place_decreasing_matches_a_linear_scan(costs, world_size, limited):
    """Both of its ways: the scan up to SCAN_UP_TO ranks, the winner tree above."""
    per_rank = max(-(-len(costs) // world_size), 1) if limited else max(len(costs), 1)
    array = np.array(costs, dtype=np.float64)
    order = np.argsort(-array, kind="stable")
    rank = np.empty(len(costs), dtype=np.int64)
    micro = np.empty(len(costs), dtype=np.int64)
    place_decreasing(array, order, np.int64(per_rank), np.int64(world_size), rank, micro)
    assert list(rank) == place_by_scan(costs, per_rank, world_size)


def even_out_by_hand(bins, costs, num_micro):
    """The slow form of `even_out_counts` for one rank: ``bins`` are lists of items."""
    bins = [list(b) for b in bins]
    while len(bins) < num_micro:
        splittable = [k for k, b in enumerate(bins) if len(b) >= 2]
        if not splittable:
            break
        widest = max(splittable, key=lambda k: (sum(costs[i] for i in bins[k]), -k))
        first, second, first_cost, second_cost = [], [], 0.0, 0.0
        for position, item in enumerate(bins[widest]):
            if position != 1 and first_cost <= second_cost:
                first.append(item)
                first_cost += costs[item]
            else:
                second.append(item)
                second_cost += costs[item]
        bins[widest] = first
        bins.append(second)
    bins.sort(key=lambda b: -sum(costs[i] for i in b))  # stable, as the kernel's mergesort
    return bins + [[]] * (num_micro - len(bins))


@given(
    st.lists(st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=5), max_size=4), min_size=1, max_size=4),
    st.integers(0, 6),
)
def test_even_out_counts_matches_the_slow_form(rank_bins, extra):
    item_costs, members, bin_offsets, run_bins, wanted = [], [], [0], [0], []
    for bins in rank_bins:
        ids = []
        for bin_ in bins:
            ids.append(list(range(len(item_costs), len(item_costs) + len(bin_))))
            item_costs += [float(c) for c in bin_]
            members += ids[-1]
            bin_offsets.append(len(members))
        run_bins.append(len(bin_offsets) - 1)
        wanted.append(ids)
    num_micro = max(len(b) for b in rank_bins) + extra
    if num_micro == 0:
        return
    out, offsets = even_out_counts(
        np.array(members, dtype=np.int64),
        np.array(bin_offsets, dtype=np.int64),
        np.array(run_bins, dtype=np.int64),
        np.array(item_costs),
        np.int64(num_micro),
    )
    for rank, ids in enumerate(wanted):
        got = [list(out[offsets[rank * num_micro + m] : offsets[rank * num_micro + m + 1]]) for m in range(num_micro)]
        assert got == even_out_by_hand(ids, item_costs, num_micro)


# ---------------------------------------------------------------- batches


@st.composite
def batches(draw, split: bool = False):
    """A batch: lengths (some above the cap with ``split``), world size, cap, groups, cost model, seed."""
    max_tokens = draw(st.integers(1, 64))
    count = draw(st.integers(0, 90))
    top = 3 * max_tokens if split else max_tokens
    lengths = draw(st.lists(st.integers(1, top), min_size=count, max_size=count))
    groups = draw(st.none() | st.lists(st.integers(0, max(count // 3, 1)), min_size=count, max_size=count))
    return {
        "lengths": np.array(lengths, dtype=np.int64),
        "world_size": draw(st.integers(1, 9)),
        "max_tokens": max_tokens,
        "groups": None if groups is None else np.array(groups),
        "attention_coefficient": draw(st.sampled_from([0.0, 1 / 64, 1.0])),
        "seed": draw(st.integers(0, 3)),
        "oversize": "split" if split else "error",
    }


AT_THE_CAP = {
    "lengths": np.array([8]),
    "world_size": 3,
    "max_tokens": 8,
    "groups": None,
    "attention_coefficient": 0.0,
    "seed": 0,
    "oversize": "error",
}
GROUP_ABOVE_CAP = {
    "lengths": np.array([6, 6, 6, 1, 2]),
    "world_size": 2,
    "max_tokens": 8,
    "groups": np.array([0, 0, 0, 1, 1]),
    "attention_coefficient": 0.0,
    "seed": 0,
    "oversize": "error",
}


def entries_of(plan, rank, micro):
    """(sample, start, length) of each entry of a micro-batch."""
    samples = plan.ranks[rank][micro]
    if plan.rank_spans is None:
        return [(int(s), 0, None) for s in samples]
    return [(int(s), int(a), int(n)) for s, (a, n) in zip(samples, plan.rank_spans[rank][micro])]


def micro_batches_of(plan):
    return [(r, m) for r in range(plan.world_size) for m in range(plan.num_micro)]


@given(batches() | batches(split=True))
@example(AT_THE_CAP)
@example(GROUP_ABOVE_CAP)
def test_every_micro_batch_is_within_max_tokens(batch):
    plan = plan_batch(**batch)
    lengths = batch["lengths"]
    for r, m in micro_batches_of(plan):
        tokens = sum(lengths[s] if n is None else n for s, _, n in entries_of(plan, r, m))
        assert tokens == plan.tokens[r, m] <= batch["max_tokens"]


@given(batches() | batches(split=True))
@example(AT_THE_CAP)
def test_every_rank_has_the_same_number_of_micro_batches(batch):
    plan = plan_batch(**batch)
    assert len(plan.ranks) == batch["world_size"]
    assert {len(plan.ranks[r]) for r in range(batch["world_size"])} <= {plan.num_micro}
    assert plan.tokens.shape == plan.loss_tokens.shape == plan.costs.shape == (batch["world_size"], plan.num_micro)


@given(batches() | batches(split=True))
@example(AT_THE_CAP)
@example(GROUP_ABOVE_CAP)
def test_every_sample_is_in_exactly_one_micro_batch(batch):
    plan = plan_batch(**batch)
    covered: dict[int, list[tuple[int, int]]] = {}
    for r, m in micro_batches_of(plan):
        for sample, start, length in entries_of(plan, r, m):
            covered.setdefault(sample, []).append((start, length))
    lengths = batch["lengths"]
    assert sorted(covered) == list(range(len(lengths)))
    for sample, spans in covered.items():
        if plan.spans is None:
            assert spans == [(0, None)]
        else:  # pieces of max_tokens, in order, covering the sample exactly
            cap = batch["max_tokens"]
            pieces = -(-int(lengths[sample]) // cap)
            assert sorted(spans) == [(k * cap, min(cap, int(lengths[sample]) - k * cap)) for k in range(pieces)]


def test_an_oversize_sample_is_an_error_naming_it():
    with pytest.raises(DatasetError, match=r"sequence 2 has 9 tokens.*oversize='split'"):
        plan_batch(np.array([3, 8, 9, 12]), 2, 8)


@given(batches() | batches(split=True))
@example(GROUP_ABOVE_CAP)
def test_a_group_stays_in_one_micro_batch_when_it_fits_and_on_one_rank_otherwise(batch):
    plan = plan_batch(**batch)
    groups, lengths = batch["groups"], batch["lengths"]
    if groups is None:  # a split sample is a group of its pieces
        groups = np.arange(len(lengths))
    where: dict[int, set[tuple[int, int]]] = {}
    for r, m in micro_batches_of(plan):
        for sample, _, _ in entries_of(plan, r, m):
            where.setdefault(int(groups[sample]), set()).add((r, m))
    for label, places in where.items():
        if lengths[groups == label].sum() <= batch["max_tokens"]:
            assert len(places) == 1, f"group {label} fits but is in {sorted(places)}"
        else:
            assert len({r for r, _ in places}) == 1, f"group {label} is on ranks {sorted(places)}"


@given(batches() | batches(split=True))
def test_the_same_batch_and_seed_give_the_same_plan(batch):
    first, second = plan_batch(**batch), plan_batch(**batch)
    assert np.array_equal(first.samples, second.samples) and np.array_equal(first.offsets, second.offsets)
    assert (first.spans is None) == (second.spans is None)
    assert first.spans is None or np.array_equal(first.spans, second.spans)


def test_seeds_decide_among_equal_choices():
    lengths = np.full(64, 5)
    plans = {plan_batch(lengths, 4, 20, seed=seed).samples.tobytes() for seed in range(4)}
    assert len(plans) == 4


@given(batches() | batches(split=True))
def test_rank_costs_are_within_the_longest_processing_time_bound(batch):
    """Busiest rank <= mean + costliest item (Graham); >= the lower bound; <= 1.03 x mean
    whenever no item costs more than 3 % of the mean."""
    plan = plan_batch(**batch)
    lengths, cap, c = batch["lengths"], batch["max_tokens"], batch["attention_coefficient"]
    groups = batch["groups"] if batch["groups"] is not None else np.arange(len(lengths))
    pieces = np.array(
        [n if n is not None else lengths[s] for r, m in micro_batches_of(plan) for s, _, n in entries_of(plan, r, m)],
        dtype=np.float64,
    )
    assert np.isclose(plan.rank_costs.sum(), np.sum(pieces + c * pieces**2))
    mean = plan.rank_costs.sum() / batch["world_size"]
    if mean == 0:
        return
    item_costs = [
        plan_batch(lengths[groups == g], 1, cap, attention_coefficient=c, oversize=batch["oversize"]).rank_costs[0]
        for g in np.unique(groups)
    ]
    largest = max(item_costs)
    assert plan.balance <= 1 + largest / mean + 1e-9
    assert plan.balance >= plan.balance_bound - 1e-9
    if largest <= 0.03 * mean:
        assert plan.balance <= 1.03


@given(st.lists(st.integers(1, 30), min_size=1, max_size=8), st.integers(1, 3))
def test_rank_costs_are_within_four_thirds_of_the_best_assignment(lengths, world_size):
    plan = plan_batch(np.array(lengths), world_size, 30)
    best = min(
        max(sum(x for x, r in zip(lengths, assignment) if r == k) for k in range(world_size))
        for assignment in itertools.product(range(world_size), repeat=len(lengths))
    )
    assert plan.rank_costs.max() <= (4 / 3 - 1 / (3 * world_size)) * best + 1e-9
    assert plan.balance_bound * sum(lengths) / world_size <= best + 1e-9


@given(batches() | batches(split=True))
def test_step_loss_tokens_are_the_sum_of_every_micro_batch_loss_tokens(batch):
    plan = plan_batch(**batch)
    pieces = [
        n if n is not None else batch["lengths"][s]
        for r, m in micro_batches_of(plan)
        for s, _, n in entries_of(plan, r, m)
    ]
    assert plan.step_loss_tokens == int(plan.loss_tokens.sum()) == sum(int(x) - 1 for x in pieces)
    assert plan.step_tokens == int(batch["lengths"].sum())


def test_loss_tokens_given_are_summed_exactly():
    lengths = np.array([10, 20, 30, 5])
    loss = np.array([4, 0, 30, 1])
    plan = plan_batch(lengths, 2, 32, loss_tokens=loss)
    assert plan.step_loss_tokens == 35
    for r in range(2):
        for m, samples in enumerate(plan.ranks[r]):
            assert plan.loss_tokens[r, m] == loss[samples].sum()


@given(batches() | batches(split=True))
def test_a_micro_batch_is_empty_only_where_its_rank_has_fewer_units_than_micro_batches(batch):
    plan = plan_batch(**batch)
    for r in range(batch["world_size"]):
        empty = sum(len(mb) == 0 for mb in plan.ranks[r])
        if empty:  # every non-empty micro-batch holds one unit: nothing more to split
            groups = batch["groups"] if batch["groups"] is not None else np.arange(len(batch["lengths"]))
            for samples in plan.ranks[r]:
                if len(samples) > 1:
                    labels = np.unique(groups[samples])
                    assert len(labels) == 1 and batch["lengths"][groups == labels[0]].sum() <= batch["max_tokens"]


def test_micro_batches_sets_the_count_and_too_few_is_an_error_naming_the_need():
    lengths = np.full(16, 10)
    assert plan_batch(lengths, 2, 40, micro_batches=5).num_micro == 5
    with pytest.raises(DatasetError, match="needs 2 micro-batches.*micro_batches is 1"):
        plan_batch(lengths, 2, 40, micro_batches=1)


def test_read_only_strided_and_int32_lengths_plan_as_a_plain_array():
    """Whatever array comes in, the kernel sees one type (one compiled specialisation)."""
    lengths = np.random.default_rng(5).integers(1, 50, 40)
    plain = plan_batch(lengths, 3, 64, seed=1)
    read_only = lengths.copy()
    read_only.flags.writeable = False
    strided = np.repeat(lengths, 2)[::2]
    for other in (read_only, strided, lengths.astype(np.int32)):
        plan = plan_batch(other, 3, 64, seed=1)
        assert np.array_equal(plan.samples, plain.samples) and np.array_equal(plan.offsets, plain.offsets)
    assert len(split_batch.signatures) == 1


def test_hidden_size_prices_attention_as_the_offline_cost_model():
    plan = plan_batch(np.array([4096]), 1, 8192, hidden_size=4096)
    assert plan.costs[0, 0] == pytest.approx(4096 + 4096**2 / (12 * 4096))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"world_size": 0}, "world_size must be an integer >= 1"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"micro_batches": 0}, "micro_batches must be"),
        ({"oversize": "drop"}, "oversize must be one of error, split"),
        ({"hidden_size": 8, "attention_coefficient": 0.1}, "not both"),
        ({"attention_coefficient": -1.0}, "attention_coefficient must be"),
    ],
)
def test_bad_arguments_are_config_errors_naming_them(arguments, message):
    with pytest.raises(ConfigError, match=message):
        plan_batch(np.array([3, 4]), **{"world_size": 2, "max_tokens": 8, **arguments})


@pytest.mark.parametrize(
    ("lengths", "options", "message"),
    [
        ([3, 0, 4], {}, "sequence 1: 0"),
        ([3, 4], {"loss_tokens": [1]}, "1 values for 2 lengths"),
        ([3, 4], {"loss_tokens": [1, 5]}, "sequence 1 has 5 loss tokens but 4 tokens"),
        ([3, 40], {"loss_tokens": [1, 5], "oversize": "split"}, "cannot keep an exact loss-token count"),
        ([3, 4], {"groups": [1]}, "one label per sequence"),
        ([[3, 4]], {}, "1-D array of integers"),
    ],
)
def test_bad_batches_are_dataset_errors_naming_the_sequence(lengths, options, message):
    with pytest.raises(DatasetError, match=message):
        plan_batch(np.array(lengths), 2, 8, **options)


# ---------------------------------------------------------------- the peers' issues

RNG = np.random.default_rng(31)
ADVERSARIAL = {
    # verl #6176: ranks whose shares need different micro-batch counts (one rank's share is
    # many short sequences, another's a few at the cap): unequal counts deadlock FSDP.
    "unequal-counts": (np.concatenate([np.full(6, 4096), RNG.integers(1, 64, 600)]), 4, 4096, None),
    # verl #6735: balancing micro-batches on sum of L^2 puts many short sequences beside a long
    # one's cost, past max_token_len.
    "quadratic-over-cap": (np.concatenate([[4000, 3900], np.full(200, 40)]), 2, 4096, None),
    # OpenRLHF #1296: a batch that does not divide by the ranks or micro-batches.
    "not-divisible": (RNG.integers(100, 900, 13), 8, 1024, None),
    # slime #1860: fewer sequences than ranks.
    "fewer-than-ranks": (np.array([700, 20, 3]), 8, 1024, None),
    # GRPO groups of 8 whose total exceeds a micro-batch (TRL #2469, torchtune #2631).
    "groups-above-cap": (RNG.integers(200, 1200, 64), 4, 2048, np.repeat(np.arange(8), 8)),
    # one sequence exactly at the cap, others tiny.
    "one-at-the-cap": (np.concatenate([[2048], np.full(30, 3)]), 3, 2048, None),
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_batches_keep_every_guarantee(name):
    lengths, world_size, max_tokens, groups = ADVERSARIAL[name]
    batch = {
        "lengths": lengths,
        "world_size": world_size,
        "max_tokens": max_tokens,
        "groups": groups,
        "attention_coefficient": 1 / 24576,
        "seed": 0,
        "oversize": "error",
    }
    test_every_micro_batch_is_within_max_tokens.hypothesis.inner_test(batch)
    test_every_rank_has_the_same_number_of_micro_batches.hypothesis.inner_test(batch)
    test_every_sample_is_in_exactly_one_micro_batch.hypothesis.inner_test(batch)
    test_a_group_stays_in_one_micro_batch_when_it_fits_and_on_one_rank_otherwise.hypothesis.inner_test(batch)
    test_rank_costs_are_within_the_longest_processing_time_bound.hypothesis.inner_test(batch)
    test_a_micro_batch_is_empty_only_where_its_rank_has_fewer_units_than_micro_batches.hypothesis.inner_test(batch)


# ---------------------------------------------------------------- the top level


def test_plan_batch_is_a_top_level_function():
    assert batchplan.plan_batch is plan_batch
    assert "plan_batch" in batchplan.__all__ and "BatchPlan" in batchplan.__all__


@pytest.mark.slow
def test_importing_batchplan_and_naming_plan_batch_loads_no_numba():
    assert loaded_after("import batchplan\nbatchplan.__all__") == set()


def difference_by_hand(values):
    """Karmarkar-Karp with a heap of (-value, position): each value's side (0 or 1)."""
    heap = [(-v, k) for k, v in enumerate(values)]
    heapq.heapify(heap)
    partner, merged = {}, []
    while len(heap) > 1:
        largest, u = heapq.heappop(heap)
        second, v = heapq.heappop(heap)
        partner[v] = u
        merged.append(v)
        heapq.heappush(heap, (largest - second, u))
    side = [0] * len(values)
    for v in reversed(merged):
        side[v] = 1 - side[partner[v]]
    return side


def exchange_by_hand(costs, order, rank, world_size, rounds, pool, tries, good_enough):
    """The slow form of `exchange_items`: lists per rank, the same choices and ties."""
    members = [[] for _ in range(world_size)]
    load = [0.0] * world_size
    for item in order:
        members[rank[item]].append(item)
        load[rank[item]] += costs[item]
    room = max(len(m) for m in members)
    capacity = [len(m) + room for m in members]

    def split(a, b, pool):
        pooled, kept = [], {a: load[a], b: load[b]}
        for r in (a, b):
            for item in members[r][len(members[r]) - min(pool, len(members[r])) :]:
                pooled.append((r, item))
                kept[r] -= costs[item]
        values = [costs[item] for _, item in pooled] + [abs(kept[a] - kept[b])]
        side = difference_by_hand(values)
        side_a = side[-1] if kept[a] >= kept[b] else 1 - side[-1]
        new = dict(kept)
        for (_, item), s in zip(pooled, side):
            new[a if s == side_a else b] += costs[item]
        stays = {r: len(members[r]) - sum(1 for owner, _ in pooled if owner == r) for r in (a, b)}
        to = {a: [], b: []}  # each rank's new items by decreasing cost, ties in pool order
        for k in sorted(range(len(pooled)), key=lambda k: (-values[k], k)):
            to[a if side[k] == side_a else b].append(pooled[k][1])
        if max(new[a], new[b]) >= load[a] or any(stays[r] + len(to[r]) > capacity[r] for r in (a, b)):
            return False
        for r in (a, b):
            members[r] = members[r][: stays[r]] + to[r]
            for item in to[r]:
                rank[item] = r
            load[r] = new[r]
        return True

    def with_partners(a, pool):
        by_load = sorted((r for r in range(world_size) if r != a), key=lambda r: (load[r], r))[:tries]
        return any(load[b] < load[a] and split(a, b, pool) for b in by_load)

    level = min(max(pool, 1), max(capacity))
    for _ in range(rounds):
        a = max(range(world_size), key=lambda r: (load[r], -r))
        if load[a] <= good_enough or all(load[r] == load[a] for r in range(world_size)):
            break
        helped = with_partners(a, level)
        while not helped and level < max(capacity):
            level = min(2 * level, max(capacity))
            helped = with_partners(a, level)
        if not helped:
            break
    return rank


@given(
    st.lists(st.sampled_from([0.0, 1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 40.0, 0.375, 2.625]), max_size=30),
    st.integers(1, 5),
    st.integers(0, 30),
    st.integers(0, 4),
    st.integers(1, 3),
    st.sampled_from([0.0, 1.01, 1.2]),
)
def test_exchange_items_matches_the_slow_form(costs, world_size, seed, pool, tries, within):
    rank = np.random.default_rng(seed).integers(0, world_size, len(costs))
    order = np.argsort(-np.array(costs), kind="stable")
    good_enough = sum(costs) / world_size * within
    want = exchange_by_hand(costs, order, list(rank), world_size, 4 * world_size, pool, tries, good_enough)
    got = rank.copy()
    exchange_items(
        np.array(costs, dtype=np.float64),
        order,
        got,
        np.int64(world_size),
        np.int64(4 * world_size),
        np.int64(pool),
        np.int64(tries),
        good_enough,
    )
    assert list(got) == want


@given(st.lists(st.floats(0, 100), max_size=30), st.integers(1, 5), st.integers(0, 30), st.integers(0, 6))
def test_exchange_items_never_raises_the_busiest_load(costs, world_size, seed, pool):
    rank = np.random.default_rng(seed).integers(0, world_size, len(costs))
    before = np.bincount(rank, weights=costs, minlength=world_size).max(initial=0)
    order = np.argsort(-np.array(costs), kind="stable")
    load = exchange_items(
        np.array(costs, dtype=np.float64),
        order,
        rank,
        np.int64(world_size),
        np.int64(20),
        np.int64(pool),
        np.int64(4),
        0.0,
    )
    assert np.allclose(load, np.bincount(rank, weights=costs, minlength=world_size))
    assert np.bincount(rank, weights=costs, minlength=world_size).max(initial=0) <= before + 1e-9


def ranks_by_hand(item_costs, order, world_size, exchange):
    """Longest processing time first, then the exchanges, towards `split_batch`'s target."""
    rounds, pool, tries, good_enough = exchange
    rank = np.empty(len(item_costs), dtype=np.int64)
    micro = np.empty(len(item_costs), dtype=np.int64)
    costs = np.array(item_costs, dtype=np.float64)
    place_decreasing(costs, order, np.int64(max(len(costs), 1)), np.int64(world_size), rank, micro)
    total = 0.0
    for cost in item_costs:
        total += cost
    mean = total / world_size
    whole = all(cost == np.floor(cost) for cost in item_costs)
    target = max(mean * (1.0 + good_enough), float(np.ceil(mean)) if whole else 0.0)
    exchange_items(
        costs, order, rank, np.int64(world_size), np.int64(rounds * world_size), np.int64(pool), np.int64(tries), target
    )
    return rank


def split_by_hand(lengths, loss, item_offsets, shuffled, coefficient, by_tokens, world_size, max_tokens, exchange):
    """The slow form of `split_batch` (fewest micro-batches): its stages' kernels, each checked
    against its own slow form above, joined in plain Python (sums, orders, units, lay-out)."""
    cost = [x + coefficient * float(x) ** 2 for x in lengths]
    spans = [range(item_offsets[k], item_offsets[k + 1]) for k in range(len(item_offsets) - 1)]
    item_tokens = [sum(lengths[e] for e in span) for span in spans]
    item_costs = [0.0] * len(spans)
    for k, span in enumerate(spans):
        for e in span:
            item_costs[k] += cost[e]
    key = item_tokens if by_tokens else item_costs
    order = np.array(sorted(shuffled, key=lambda k: -key[k]), dtype=np.int64)  # equal keys as shuffled
    rank = ranks_by_hand(item_costs, order, world_size, exchange)
    units = []  # (rank, entries), items in shuffled order
    for k in shuffled:
        whole = item_tokens[k] <= max_tokens
        units += [(rank[k], spans[k])] if whole else [(rank[k], range(e, e + 1)) for e in spans[k]]
    units.sort(key=lambda unit: (unit[0], -sum(lengths[e] for e in unit[1])))  # stable
    unit_costs = [0.0] * len(units)
    for u, (_, entries) in enumerate(units):
        for e in entries:
            unit_costs[u] += cost[e]
    runs = np.searchsorted([r for r, _ in units], np.arange(world_size + 1)).astype(np.int64)
    unit_lengths = np.array([sum(lengths[e] for e in entries) for _, entries in units], dtype=np.int64)
    members, bin_offsets, _, run_bins = pack_runs(unit_lengths, runs, np.int64(max_tokens))
    num_micro = int(np.diff(run_bins).max(initial=0))
    out, out_offsets = even_out_counts(members, bin_offsets, run_bins, np.array(unit_costs), np.int64(num_micro))
    micro_batches = [
        [e for u in out[out_offsets[k] : out_offsets[k + 1]] for e in units[u][1]]
        for k in range(world_size * num_micro)
    ]
    return micro_batches, item_costs, cost


@st.composite
def kernel_batches(draw):
    """`split_batch`'s input: items of 1-3 entries (some items above the cap), in a random order."""
    max_tokens = draw(st.integers(1, 30))
    sizes = draw(st.lists(st.integers(1, 3), max_size=40))
    lengths = draw(st.lists(st.integers(1, max_tokens), min_size=sum(sizes), max_size=sum(sizes)))
    shuffled = draw(st.permutations(range(len(sizes))))
    return {
        "lengths": np.array(lengths, dtype=np.int64),
        "item_offsets": np.concatenate(([0], np.cumsum(sizes))).astype(np.int64),
        "shuffled": np.array(shuffled, dtype=np.int64),
        "coefficient": draw(st.sampled_from([0.0, 1 / 16, 1.0])),
        "by_tokens": draw(st.booleans()),
        "world_size": draw(st.integers(1, 6)),
        "max_tokens": max_tokens,
        "exchange": (draw(st.integers(0, 4)), draw(st.integers(0, 4)), draw(st.integers(1, 3)), 0.0),
    }


@given(kernel_batches())
def test_split_batch_matches_the_slow_form(batch):
    loss = batch["lengths"] // 2
    entries, offsets, tokens, loss_out, costs, needed, item_costs = split_batch(
        batch["lengths"],
        loss,
        batch["item_offsets"],
        batch["shuffled"],
        batch["coefficient"],
        batch["by_tokens"],
        np.int64(batch["world_size"]),
        np.int64(batch["max_tokens"]),
        np.int64(0),
        batch["exchange"],
    )
    want, want_item_costs, cost = split_by_hand(**{**batch, "loss": loss})
    got = [list(entries[offsets[k] : offsets[k + 1]]) for k in range(len(offsets) - 1)]
    assert got == want and needed * batch["world_size"] == len(want)
    assert list(item_costs) == want_item_costs
    assert list(tokens) == [sum(batch["lengths"][e] for e in micro) for micro in want]
    assert list(loss_out) == [sum(loss[e] for e in micro) for micro in want]
    assert list(costs) == [sum((cost[e] for e in micro), 0.0) for micro in want]


# ---------------------------------------------------------------- docs/online.md


ONLINE_DOC = Path(__file__).resolve().parent.parent / "docs" / "online.md"


@pytest.mark.parametrize("index", range(3))
def test_each_python_block_of_the_online_doc_runs(index):
    blocks = re.findall(r"```python\n(.*?)```", ONLINE_DOC.read_text(), re.S)
    assert len(blocks) == 3
    exec(compile(blocks[index], f"docs/online.md block {index}", "exec"), {})  # noqa: S102 -- the doc's own code
