"""The cutting-stock bound and packer against slow references: the bound never exceeds
an exhaustive optimum, packings are valid and never worse than best fit decreasing, and
real files pack within max(bound + 1, bound x 1.0001)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplan.kernels.pack import pack_bins
from batchplan.kernels.patterns import histogram_bounds
from batchplan.planning import cutting_stock
from batchplan.planning.cutting_stock import lower_bound, pack_histogram, slack

DATA = Path(__file__).resolve().parent.parent / "data"


def to_histogram(lengths: list[int], max_tokens: int) -> np.ndarray:
    return np.bincount(np.asarray(lengths, dtype=np.int64), minlength=max_tokens + 1).astype(np.int64)


def split_histogram(lengths: np.ndarray, max_tokens: int) -> np.ndarray:
    """A sample of length L as L // C pieces of C and one of L % C (none when 0)."""
    histogram = np.bincount(lengths % max_tokens, minlength=max_tokens + 1).astype(np.int64)
    histogram[0] = 0
    histogram[max_tokens] += int((lengths // max_tokens).sum())
    return histogram


def optimum_bins(lengths: list[int], max_tokens: int) -> int:
    """The fewest bins, by exhaustive search (longest first; a new bin only as the last choice)."""
    items = sorted(lengths, reverse=True)
    best = len(items)

    def place(i: int, residuals: list[int]) -> None:
        nonlocal best
        if len(residuals) >= best:
            return
        if i == len(items):
            best = len(residuals)
            return
        for b, residual in enumerate(residuals):
            if items[i] <= residual and residual not in residuals[:b]:
                residuals[b] -= items[i]
                place(i + 1, residuals)
                residuals[b] += items[i]
        place(i + 1, [*residuals, max_tokens - items[i]])

    place(0, [])
    return best


def reference_bounds(lengths: list[int], max_tokens: int) -> tuple[int, int]:
    """Volume and Martello and Toth's L2, straight from their definitions."""
    volume = -(-sum(lengths) // max_tokens)
    best = volume
    for k in range(max_tokens // 2 + 1):
        alone = [s for s in lengths if s > max_tokens - k]
        big = [s for s in lengths if max_tokens / 2 < s <= max_tokens - k]
        small = [s for s in lengths if k <= s <= max_tokens / 2]
        spill = sum(small) - (len(big) * max_tokens - sum(big))
        best = max(best, len(alone) + len(big) + max(0, -(-spill // max_tokens)))
    return volume, best


def check_packing(histogram: np.ndarray, max_tokens: int, slot_bin, offsets, tokens) -> None:
    """Every slot in a bin, slots longest first, tokens and sizes right, no bin over the cap."""
    slot_lengths = np.repeat(np.arange(max_tokens, 0, -1), histogram[max_tokens:0:-1])
    num_bins = tokens.shape[0]
    assert slot_bin.shape == slot_lengths.shape
    assert offsets.shape == (num_bins + 1,) and offsets[0] == 0
    assert slot_bin.min(initial=0) >= 0 and slot_bin.max(initial=-1) < num_bins
    assert np.array_equal(np.diff(offsets), np.bincount(slot_bin, minlength=num_bins))
    sums = np.bincount(slot_bin, weights=slot_lengths, minlength=num_bins).astype(np.int64)
    assert np.array_equal(sums, tokens)
    assert (tokens <= max_tokens).all() and (tokens > 0).all()


def best_fit_bins(histogram: np.ndarray, max_tokens: int) -> int:
    start = np.concatenate([[0], np.cumsum(histogram)]).astype(np.int64)
    items = np.arange(start[-1], dtype=np.int64)
    return pack_bins(items, start, max_tokens)[1].shape[0] - 1


tiny_cases = st.integers(2, 24).flatmap(
    lambda cap: st.tuples(st.just(cap), st.lists(st.integers(1, cap), min_size=0, max_size=9))
)


@settings(max_examples=300, deadline=None)
@given(tiny_cases)
def test_bound_and_packing_against_the_optimum(case):
    max_tokens, lengths = case
    histogram = to_histogram(lengths, max_tokens)
    optimum = optimum_bins(lengths, max_tokens)
    bound = lower_bound(histogram, max_tokens)
    assert bound.bins <= optimum
    assert histogram_bounds(histogram, max_tokens) == reference_bounds(lengths, max_tokens)
    packing = pack_histogram(histogram, max_tokens)
    check_packing(histogram, max_tokens, *packing[:3])
    assert packing.bound.bins <= optimum <= packing.tokens.shape[0]


@settings(max_examples=150, deadline=None)
@given(tiny_cases)
def test_lp_rounding_is_a_valid_packing(monkeypatch_case):
    # With no slack every packing that misses the cheap bounds goes through the LP.
    max_tokens, lengths = monkeypatch_case
    histogram = to_histogram(lengths, max_tokens)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cutting_stock, "slack", lambda bins: bins)
        packing = pack_histogram(histogram, max_tokens)
    check_packing(histogram, max_tokens, *packing[:3])
    assert packing.bound.bins <= optimum_bins(lengths, max_tokens) <= packing.tokens.shape[0]


histograms = st.integers(8, 600).flatmap(
    lambda cap: st.tuples(
        st.just(cap),
        st.dictionaries(st.integers(1, cap), st.integers(1, 60), max_size=40),
    )
)


@settings(max_examples=120, deadline=None)
@given(histograms)
def test_never_worse_than_best_fit_decreasing(case):
    max_tokens, counts = case
    histogram = np.zeros(max_tokens + 1, dtype=np.int64)
    for length, count in counts.items():
        histogram[length] = count
    packing = pack_histogram(histogram, max_tokens)
    check_packing(histogram, max_tokens, *packing[:3])
    assert packing.bound.bins <= packing.tokens.shape[0] <= best_fit_bins(histogram, max_tokens)
    again = pack_histogram(histogram, max_tokens)
    for first, second in zip(packing[:3], again[:3]):
        assert np.array_equal(first, second)


@pytest.mark.parametrize(
    ("name", "max_tokens"),
    [
        ("squad11_bert384", 384),
        ("squad11_bert384", 512),
        ("sharegpt_dialogues_cl100k", 2048),
        ("sharegpt_dialogues_cl100k", 4096),
        ("sharegpt_segments_cl100k", 2048),
        ("sharegpt_segments_cl100k", 4096),
    ],
)
def test_real_files_reach_the_bound(name, max_tokens):
    lengths = pq.read_table(DATA / f"{name}.parquet", columns=["length"]).column("length").to_numpy()
    histogram = split_histogram(lengths.astype(np.int64), max_tokens)
    packing = pack_histogram(histogram, max_tokens)
    check_packing(histogram, max_tokens, *packing[:3])
    bound = max(packing.bound.bins, lower_bound(histogram, max_tokens).bins)
    assert bound <= packing.tokens.shape[0] <= slack(bound)
    assert packing.tokens.shape[0] <= best_fit_bins(histogram, max_tokens)


def test_squad_lp_bound():
    lengths = pq.read_table(DATA / "squad11_bert384.parquet", columns=["length"]).column("length").to_numpy()
    histogram = split_histogram(lengths.astype(np.int64), 384)
    bound = lower_bound(histogram, 384)
    assert (bound.bins, bound.kind) == (40_195, "lp")
    assert bound.fill == pytest.approx(0.98800, abs=5e-5)


def test_histogram_shape_is_checked():
    with pytest.raises(ValueError, match="max_tokens \\+ 1 = 9"):
        pack_histogram(np.zeros(5, dtype=np.int64), 8)


def test_plans_record_each_epochs_packing_and_its_bound(tmp_path):
    """A pack plan's metadata holds, per epoch, the micro-batches as packed and the bound;
    `summarize_plan` reports both fills; epochs still pack different samples together."""
    from batchplan import PlanConfig, build_plan_file, open_plan
    from batchplan.reports.summary import summarize_plan

    path = tmp_path / "plan.arrow"
    build_plan_file(DATA / "squad11_bert384.parquet", path, PlanConfig(max_tokens=384, world_size=4, epochs=2))
    plan = open_plan(path)
    packing = plan.metadata["packing"]
    assert [p["kind"] for p in packing] == ["lp", "lp"] and [p["bound"] for p in packing] == [40_195, 40_195]
    assert all(p["micro_batches"] <= slack(p["bound"]) for p in packing)
    summary = summarize_plan(plan)["packing"]
    assert summary["bound"] == 80_390 and summary["fill"] <= summary["bound_fill"] < 0.99
    first, second = (plan.read_rank(epoch, 0).column("samples").to_pylist() for epoch in (0, 1))
    assert {tuple(s) for s in first} != {tuple(s) for s in second}


def test_pad_plans_record_no_packing(tmp_path):
    from batchplan import PlanConfig, build_plan_file, open_plan

    path = tmp_path / "plan.arrow"
    build_plan_file(DATA / "squad11_bert384.parquet", path, PlanConfig(max_tokens=384, mode="pad"))
    assert open_plan(path).metadata["packing"] == [None]
