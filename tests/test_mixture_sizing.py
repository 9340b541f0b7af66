"""Mixture sizing: each source's planned tokens lie within one document of its target, its samples
repeat in order (whole seeded passes, then a seeded prefix of one more), and its order depends on
the seed and its own name only. Every check recounts from the orders and lengths."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchplan.errors import DatasetError
from batchplan.formats.mixture_file import read_mixture, read_mixture_lengths
from batchplan.mixture import Mixture, MixtureSource
from batchplan.planning.mixture_sizing import draw_sources, select_sources, with_shares

DATA = Path(__file__).resolve().parent.parent / "data"
MAX_PASSES = 40  # keeps the examples fast: at most this many passes of any source


@st.composite
def mixtures(draw, by_epochs=False):
    """2-20 sources of 1-60 samples (some of length 0), weights 1e-3..1 (and some 0) or epochs 0..6;
    the budget from a thousandth of the data to ``MAX_PASSES`` passes of the most repeated source."""
    count = draw(st.integers(2, 20))
    parts = []
    for _ in range(count):
        size = draw(st.integers(1, 60))
        lengths = draw(st.lists(st.integers(0, 300), min_size=size, max_size=size))
        lengths[draw(st.integers(0, size - 1))] = draw(st.integers(1, 300))  # every source has tokens
        parts.append(np.asarray(lengths, dtype=np.uint16))
    lengths = np.concatenate(parts)
    offsets = np.concatenate([[0], np.cumsum([len(part) for part in parts])])
    names = [f"s{index}" for index in range(count)]
    if by_epochs:
        epochs = [draw(st.sampled_from([0.0, 1.0, 2.0]) | st.floats(0, 6)) for _ in range(count)]
        epochs[0] = max(epochs[0], 0.5)
        sources = [MixtureSource(name=n, paths=("x",), epochs=e) for n, e in zip(names, epochs)]
        return Mixture(sources=tuple(sources)), lengths, offsets
    weights = [draw(st.just(0.0) | st.floats(1e-3, 1)) for _ in range(count)]
    weights[0] = max(weights[0], 1e-3)
    shares = np.asarray(weights) / sum(weights)
    tokens = np.asarray([part.sum(dtype=np.int64) for part in parts])
    most = min(MAX_PASSES * tokens[s] / shares[s] for s in range(count) if shares[s] > 0)  # budget at MAX_PASSES
    budget = max(1, int(most * draw(st.floats(1e-3, 1))))
    sources = [MixtureSource(name=n, paths=("x",), weight=w) for n, w in zip(names, weights)]
    return Mixture(sources=tuple(sources), tokens=budget), lengths, offsets


def expected_target(mixture: Mixture, lengths, offsets, index: int) -> float:
    part = lengths[offsets[index] : offsets[index + 1]]
    source = mixture.sources[index]
    if mixture.by_epochs:
        return source.epochs * float(part.sum(dtype=np.int64))
    return source.weight / sum(s.weight for s in mixture.sources) * mixture.tokens


def check_within_one_document(mixture, lengths, offsets, selections):
    for index, selection in enumerate(selections):
        part = lengths[offsets[index] : offsets[index + 1]]
        planned = int(lengths[selection.order].sum(dtype=np.int64))
        assert planned == selection.planned_tokens
        # within one document (+1 for the target's rounding to whole tokens)
        assert abs(planned - expected_target(mixture, lengths, offsets, index)) <= int(part.max()) + 1
        assert selection.passes == pytest.approx(planned / part.sum(dtype=np.int64))


def check_repetition_order(offsets, selections):
    """Consecutive blocks of a source's size are permutations of it; the last block has no repeats:
    no sample is used a (k+1)-th time before every sample of its source was used k times."""
    for index, selection in enumerate(selections):
        first, count = int(offsets[index]), int(offsets[index + 1] - offsets[index])
        local = selection.order.astype(np.int64) - first
        assert local.size == 0 or (local.min() >= 0 and local.max() < count)
        whole = local.size // count
        blocks = np.sort(local[: whole * count].reshape(whole, count), axis=1)
        assert (blocks == np.arange(count)).all()
        assert np.bincount(local[whole * count :], minlength=count).max(initial=0) <= 1


@given(mixtures())
def test_planned_tokens_are_within_one_document_of_the_target(case):
    mixture, lengths, offsets = case
    check_within_one_document(mixture, lengths, offsets, select_sources(mixture, lengths, offsets, seed=3))


@given(mixtures(by_epochs=True))
def test_epochs_give_whole_passes_then_a_part_of_one(case):
    mixture, lengths, offsets = case
    selections = select_sources(mixture, lengths, offsets, seed=3)
    check_within_one_document(mixture, lengths, offsets, selections)
    check_repetition_order(offsets, selections)
    for source, selection in zip(mixture.sources, selections):
        count = selection.num_samples
        assert selection.order.size >= int(source.epochs) * count  # the whole passes are all there
    planned = np.asarray([selection.planned_tokens for selection in selections], dtype=np.float64)
    shares = planned / planned.sum() if planned.sum() else planned  # nothing planned: every share 0
    assert [s.weight for s in selections] == pytest.approx(shares)


@given(mixtures())
def test_samples_repeat_in_order_within_each_source(case):
    mixture, lengths, offsets = case
    check_repetition_order(offsets, select_sources(mixture, lengths, offsets, seed=11))


@given(mixtures(), st.integers(0, 2**32))
def test_unshuffled_whole_passes_are_in_sample_order_and_the_rest_is_as_shuffled(case, seed):
    """``shuffled=False`` (a one-epoch run without a warmup) changes only the whole passes:
    each is the source's samples in order; the sizes and the partial pass are the same."""
    mixture, lengths, offsets = case
    shuffled = select_sources(mixture, lengths, offsets, seed=seed)
    in_order = with_shares(mixture, tuple(draw_sources(mixture, lengths, offsets, seed=seed, shuffled=False)))
    for one, other in zip(shuffled, in_order):
        assert dataclasses.replace(one, order=None, shuffled=False) == dataclasses.replace(other, order=None)
        whole = slice(other.head, other.head + other.num_samples * other.whole_passes)
        samples = list(range(other.offset, other.offset + other.num_samples))
        assert other.order[whole].tolist() == samples * other.whole_passes
        np.testing.assert_array_equal(one.order[: whole.start], other.order[: whole.start])  # the head
        np.testing.assert_array_equal(one.order[whole.stop :], other.order[whole.stop :])  # the partial pass


@given(mixtures(), st.integers(0, 2**32))
def test_the_same_seed_gives_the_same_orders(case, seed):
    mixture, lengths, offsets = case
    first = select_sources(mixture, lengths, offsets, seed=seed)
    again = select_sources(mixture, lengths, offsets, seed=seed)
    for one, other in zip(first, again):
        np.testing.assert_array_equal(one.order, other.order)
        assert dataclasses.replace(one, order=None) == dataclasses.replace(other, order=None)


def test_another_seed_gives_other_orders():
    lengths = np.arange(1, 201, dtype=np.uint16)
    mixture = Mixture(sources=(MixtureSource(name="a", paths=("x",), weight=1),), tokens=int(lengths.sum()) * 2)
    first, second = (select_sources(mixture, lengths, [0, 200], seed=seed)[0].order for seed in (0, 1))
    assert not np.array_equal(first, second)
    assert not np.array_equal(first[:200], first[200:])  # each pass is a fresh order


@given(mixtures(), st.data())
def test_a_sources_order_does_not_change_when_another_source_is_removed(case, data):
    """Epochs size each source alone, so removing one keeps the others' targets: their local orders
    (indices minus the source's offset) are unchanged."""
    mixture, lengths, offsets = case
    mixture = Mixture(sources=tuple(MixtureSource(name=s.name, paths=s.paths, epochs=1.5) for s in mixture.sources))
    removed = data.draw(st.integers(0, len(mixture.sources) - 1))
    kept = [index for index in range(len(mixture.sources)) if index != removed]
    smaller = Mixture(sources=tuple(mixture.sources[index] for index in kept))
    parts = [lengths[offsets[index] : offsets[index + 1]] for index in kept]
    smaller_offsets = np.concatenate([[0], np.cumsum([len(part) for part in parts])])
    before = select_sources(mixture, lengths, offsets, seed=5)
    after = select_sources(smaller, np.concatenate(parts), smaller_offsets, seed=5)
    for index, selection in zip(kept, after):
        np.testing.assert_array_equal(before[index].order - before[index].offset, selection.order - selection.offset)


def test_adding_a_source_keeps_the_others_orders():
    """Weights 1:2 of 3,000 tokens, then 1:2:3 of 6,000: the first two targets stay 1,000 and 2,000."""
    rng = np.random.default_rng(0)
    parts = [rng.integers(1, 50, size).astype(np.uint16) for size in (30, 500, 70)]
    sources = [MixtureSource(name=name, paths=("x",), weight=w) for name, w in (("a", 1), ("b", 2), ("c", 3))]
    two = select_sources(
        Mixture(sources=tuple(sources[:2]), tokens=3000), np.concatenate(parts[:2]), [0, 30, 530], seed=9
    )
    three = select_sources(
        Mixture(sources=tuple(sources), tokens=6000), np.concatenate(parts), [0, 30, 530, 600], seed=9
    )
    for before, after in zip(two, three):
        assert before.target_tokens == after.target_tokens
        np.testing.assert_array_equal(before.order, after.order)


@given(mixtures(), st.floats(1.0, 3.0))
def test_a_larger_budget_extends_each_sources_order(case, factor):
    """A source's order is a prefix of one sequence of passes: a partial pass is the start of the next."""
    mixture, lengths, offsets = case
    larger = Mixture(sources=mixture.sources, tokens=int(mixture.tokens * factor) + 1)
    for small, large in zip(*(select_sources(m, lengths, offsets, seed=2) for m in (mixture, larger))):
        assert small.order.size <= large.order.size
        np.testing.assert_array_equal(small.order, large.order[: small.order.size])


def test_a_source_with_weight_zero_has_an_empty_order():
    lengths = np.asarray([3, 4, 5, 6], dtype=np.uint16)
    mixture = Mixture(
        sources=(MixtureSource(name="a", paths=("x",), weight=1), MixtureSource(name="b", paths=("x",), weight=0)),
        tokens=100,
    )
    used, unused = select_sources(mixture, lengths, [0, 2, 4], seed=0)
    assert unused.order.size == 0 and unused.planned_tokens == 0 and unused.weight == 0.0
    assert used.weight == 1.0 and np.bincount(used.order, minlength=4)[2:].sum() == 0


def test_a_source_with_weight_zero_and_no_samples_is_allowed():
    lengths = np.asarray([3, 4], dtype=np.uint16)
    mixture = Mixture(
        sources=(MixtureSource(name="a", paths=("x",), weight=1), MixtureSource(name="b", paths=("x",), weight=0)),
        tokens=10,
    )
    assert select_sources(mixture, lengths, [0, 2, 2], seed=0)[1].order.size == 0


def test_a_source_of_empty_samples_with_a_weight_is_an_error():
    lengths = np.asarray([3, 0, 0], dtype=np.uint16)
    mixture = Mixture(
        sources=(MixtureSource(name="a", paths=("x",), weight=1), MixtureSource(name="b", paths=("x",), weight=1)),
        tokens=10,
    )
    with pytest.raises(DatasetError, match="source 'b': has 2 samples and 0 tokens but is asked for 5 tokens"):
        select_sources(mixture, lengths, [0, 1, 3], seed=0)


def test_offsets_must_bound_the_sources():
    mixture = Mixture(sources=(MixtureSource(name="a", paths=("x",), weight=1),), tokens=10)
    with pytest.raises(ValueError, match="offsets must be 2 non-decreasing bounds"):
        select_sources(mixture, np.ones(4, np.uint16), [0, 3], seed=0)


def test_orders_are_int32_below_two_to_the_31_samples():
    mixture = Mixture(sources=(MixtureSource(name="a", paths=("x",), weight=1),), tokens=10)
    assert select_sources(mixture, np.ones(4, np.uint16), [0, 4], seed=0)[0].order.dtype == np.int32


def test_the_demo_mixture_repeats_the_small_sources_and_subsets_the_large_one():
    mixture = read_mixture(DATA / "mixture.yaml")
    read = read_mixture_lengths(mixture)
    assert [s.name for s in read.sources] == ["chat", "qa", "wiki"]
    assert read.offsets.tolist() == [0, 9_457, 98_098, 1_098_098]
    selections = select_sources(mixture, read.lengths, read.offsets, seed=0)
    check_within_one_document(mixture, read.lengths, read.offsets, selections)
    check_repetition_order(read.offsets, selections)
    passes = {s.name: s.passes for s in selections}
    assert passes["chat"] > 1 and passes["qa"] > 1 and passes["wiki"] < 1
    assert sum(s.planned_tokens for s in selections) == pytest.approx(100e6, abs=200_000 + 512 + 384)
