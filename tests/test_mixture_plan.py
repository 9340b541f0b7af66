"""Plans of mixtures: the interleaving kernel against its reference, repetition order, shares,
drift, the guarantees of a single-dataset plan, byte-identical rebuilds, and validate.

Shares, uses and sources are counted here from each row's samples and the sources'
offsets in the plan's metadata, not from the planner's arrays or the ``source`` column."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _mixture_recount import assert_planned_tokens_add_up, assert_warmup_caps_hold, recount
from _mixture_recount import assert_repetition_in_order as assert_counted_repetition_in_order
from _plan_views import WithMetadata
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchplan import PlanConfig
from batchplan.errors import DatasetError
from batchplan.formats.opening import open_plan
from batchplan.kernels.interleave import compose_steps
from batchplan.mixture import Mixture, MixtureSource
from batchplan.operations.build_mixture import build_mixture_plan_file
from batchplan.operations.validate import validate_plan

DATA = Path(__file__).resolve().parent.parent / "data"
DEMO = DATA / "mixture.yaml"


# --------------------------------------------------------------------------- the kernel


def compose(sizes, tokens, shares, world_size, max_tokens, rounds):
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    out = np.empty(int(offsets[-1]), dtype=np.int64)
    steps = np.empty(out.shape[0] + 1, dtype=np.int64)
    sizing = np.array([rounds, 0, 0, 0, 0, 0], dtype=np.float64)
    shares = np.asarray(shares, dtype=np.float64) / np.sum(shares)
    count = compose_steps(
        offsets,
        np.asarray(tokens, dtype=np.int64),
        np.zeros(1),
        shares[None, :],
        shares,
        world_size,
        float(max_tokens),  # the planner's type: one compiled version
        sizing,
        out,
        steps,
    )
    return offsets, out, steps[: count + 1], shares


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    world_size=st.integers(1, 4),
    rounds=st.integers(1, 4),
    data=st.data(),
)
def test_composed_steps_take_every_micro_batch_once_in_each_sources_order(sizes, world_size, rounds, data):
    total = sum(sizes)
    tokens = data.draw(st.lists(st.integers(1, 64), min_size=total, max_size=total))
    shares = data.draw(st.lists(st.floats(0.01, 1.0), min_size=len(sizes), max_size=len(sizes)))
    offsets, out, steps, _ = compose(sizes, tokens, shares, world_size, 64, rounds)
    assert sorted(out.tolist()) == list(range(total))
    for s in range(len(sizes)):
        mine = out[(out >= offsets[s]) & (out < offsets[s + 1])]
        assert (np.diff(mine) == 1).all()
    assert steps[0] == 0 and steps[-1] == total
    assert (np.diff(steps)[:-1] == world_size * rounds).all()  # all but the last: the fixed step


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    num_sources=st.integers(2, 6),
    world_size=st.integers(1, 8),
    rounds=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_composed_steps_hold_shares_within_max_tokens(num_sources, world_size, rounds, seed):
    """Micro-batches of 1..64 tokens; shares are the sources' shares of all tokens (as the
    planner gives them): every step but the last holds each source within max_tokens (64) of
    its share of the step's tokens."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 400, num_sources)
    tokens = rng.integers(1, 65, int(sizes.sum()))
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    shares = np.array([tokens[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:])], dtype=np.float64)
    offsets, out, steps, shares = compose(sizes, tokens, shares, world_size, 64, rounds)
    source_of = np.searchsorted(offsets, out, side="right") - 1
    for first, last in zip(steps[:-2], steps[1:-1]):
        taken = np.bincount(source_of[first:last], weights=tokens[out[first:last]], minlength=num_sources)
        assert (np.abs(taken - shares * taken.sum()) <= 64).all()


# --------------------------------------------------------------------------- plans


def write_sources(tmp_path: Path, lengths: list[np.ndarray]) -> list[str]:
    paths = []
    for index, values in enumerate(lengths):
        path = tmp_path / f"source{index}.parquet"
        pq.write_table(pa.table({"length": values.astype(np.int32)}), path)
        paths.append(str(path))
    return paths


def mixture_of(paths: list[str], weights: list[float], tokens: int) -> Mixture:
    sources = tuple(MixtureSource(name=f"s{i}", paths=(p,), weight=w) for i, (p, w) in enumerate(zip(paths, weights)))
    return Mixture(sources=sources, tokens=tokens)


@dataclasses.dataclass
class Uses:
    """A plan read back: per step and source, tokens; every use as (step, sample)."""

    per_step: np.ndarray  # shape (steps, sources)
    epoch_of_step: np.ndarray
    steps: np.ndarray
    samples: np.ndarray
    meta: dict


def read_uses(path: Path) -> Uses:
    plan = open_plan(path)
    meta = plan.metadata
    sources = meta["mixture"]["sources"]
    bounds = np.array([s["offset"] for s in sources] + [sources[-1]["offset"] + sources[-1]["num_samples"]])
    num_steps = sum(meta["steps_per_epoch"])
    per_step = np.zeros((num_steps, len(sources)), dtype=np.int64)
    epoch_of_step = np.repeat(np.arange(plan.num_epochs), meta["steps_per_epoch"])
    steps, samples = [], []
    for epoch in range(plan.num_epochs):
        for rank in range(plan.world_size):
            rows = plan.read_rank(epoch, rank).to_pylist()
            for row in rows:
                starts = row.get("starts") or [0] * len(row["samples"])
                owners = {int(np.searchsorted(bounds, s, side="right") - 1) for s in row["samples"]}
                assert len(owners) <= 1, "a micro-batch holds two sources"
                if owners:
                    per_step[row["step"], owners.pop()] += row["tokens"]
                for sample, start in zip(row["samples"], starts):
                    if start == 0:
                        steps.append(row["step"])
                        samples.append(sample)
    return Uses(per_step, epoch_of_step, np.array(steps), np.array(samples), meta)


def assert_repetition_in_order(uses: Uses) -> None:
    """Within a source, no sample's (k+1)-th use comes in a step before the last k-th use."""
    for source in uses.meta["mixture"]["sources"]:
        lo, hi = source["offset"], source["offset"] + source["num_samples"]
        mine = (uses.samples >= lo) & (uses.samples < hi)
        steps, samples = uses.steps[mine], uses.samples[mine]
        order = np.argsort(steps, kind="stable")
        seen: dict[int, int] = {}
        nth = np.empty(order.shape[0], dtype=np.int64)
        for position in order:
            nth[position] = seen.get(int(samples[position]), 0)
            seen[int(samples[position])] = nth[position] + 1
        counts = np.bincount(samples - lo, minlength=hi - lo)
        assert counts.max() - counts.min() <= 1, source["name"]
        for k in range(int(nth.max(initial=0))):
            assert steps[nth == k + 1].min() >= steps[nth == k].max(), (source["name"], k)


def assert_no_drift(uses: Uses, max_tokens: int) -> None:
    """After every step, each source's tokens since its epoch began are within one step (the
    epoch's mean step, or max_tokens) of weight x the epoch's tokens so far, plus what the
    epoch's own tokens of the source miss weight x the epoch's tokens by."""
    weights = np.array([source["weight"] for source in uses.meta["mixture"]["sources"]])
    for epoch in np.unique(uses.epoch_of_step):
        per_step = uses.per_step[uses.epoch_of_step == epoch].astype(np.float64)
        totals = per_step.sum(axis=1)
        drift = np.abs(np.cumsum(per_step, axis=0) - weights * np.cumsum(totals)[:, None])
        own_miss = np.abs(per_step.sum(axis=0) - weights * totals.sum())
        assert (drift <= max(totals.mean(), max_tokens) + own_miss + 1e-6).all(), epoch


@pytest.fixture(scope="module")
def demo_plan(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mix") / "plan.arrow"
    config = PlanConfig(max_tokens=8192, world_size=8, micro_batches=4, oversize="split", epochs=2)
    build_mixture_plan_file(DEMO, path, config)
    return path


def test_demo_mixture_plan_passes_validate(demo_plan):
    assert validate_plan(demo_plan, mixture=DEMO) == []


def test_demo_mixture_holds_its_shares_at_every_step(demo_plan):
    uses = read_uses(demo_plan)
    weights = np.array([s["weight"] for s in uses.meta["mixture"]["sources"]])
    for epoch in range(uses.meta["epochs"]):
        per_step = uses.per_step[uses.epoch_of_step == epoch][:-1]  # an epoch's last step may be short
        totals = per_step.sum(axis=1)
        allowed = np.maximum(0.005 * totals, uses.meta["max_tokens"])
        assert (np.abs(per_step - weights * totals[:, None]) <= allowed[:, None]).all()


def test_demo_mixture_does_not_drift(demo_plan):
    uses = read_uses(demo_plan)
    weights = np.array([s["weight"] for s in uses.meta["mixture"]["sources"]])
    for epoch in range(uses.meta["epochs"]):
        per_step = uses.per_step[uses.epoch_of_step == epoch]
        drift = np.abs(np.cumsum(per_step, axis=0) - weights * np.cumsum(per_step.sum(axis=1))[:, None])
        assert drift.max() <= max(per_step.sum(axis=1).mean(), uses.meta["max_tokens"])


def test_demo_mixture_repeats_in_order_and_uses_what_was_planned(demo_plan):
    uses = read_uses(demo_plan)
    assert_repetition_in_order(uses)
    for index, source in enumerate(uses.meta["mixture"]["sources"]):
        assert uses.per_step[:, index].sum() == source["planned_tokens"]


@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_a_one_epoch_runs_passes_are_each_shuffled_and_each_differently(tmp_path, mode):
    """A one-epoch run takes its whole passes in sample order (`mixture_sizing`); forming
    shuffles each. With every sample of a source the same length, only that shuffle decides
    which samples share a micro-batch: not neighbours in the source, and not the same
    micro-batches in the next pass."""
    rng = np.random.default_rng(5)
    pq.write_table(pa.table({"length": np.full(400, 100, dtype=np.int32)}), tmp_path / "same.parquet")
    pq.write_table(pa.table({"length": rng.integers(50, 900, 3000).astype(np.int32)}), tmp_path / "other.parquet")
    spec = {
        "sources": [
            {"name": "same", "paths": ["same.parquet"], "weight": 0.1},
            {"name": "other", "paths": ["other.parquet"], "weight": 0.9},
        ],
        "tokens": 1_000_000,  # 100,000 tokens of `same`: two and a half passes
    }
    (tmp_path / "mix.json").write_text(json.dumps(spec))
    config = PlanConfig(max_tokens=1024, world_size=2, micro_batches=2, mode=mode)
    build_mixture_plan_file(tmp_path / "mix.json", tmp_path / "plan.arrow", config)
    plan = open_plan(tmp_path / "plan.arrow")
    rows = sorted(
        (row["step"], rank, row["micro"], tuple(sorted(row["samples"])))
        for rank in range(plan.world_size)
        for row in plan.read_rank(0, rank).to_pylist()
        if row["samples"] and row["samples"][0] < 400
    )
    seen = np.zeros(400, dtype=np.int64)
    by_pass: list[list[tuple[int, ...]]] = [[], [], []]
    for *_, samples in rows:
        by_pass[seen[samples[0]]].append(samples)  # a micro-batch holds one pass of one source
        seen[list(samples)] += 1
    assert [sum(map(len, batches)) for batches in by_pass[:2]] == [400, 400]
    neighbours = sum(int(np.sum(np.diff(samples) == 1)) for batches in by_pass for samples in batches)
    pairs = sum(len(samples) - 1 for batches in by_pass for samples in batches)
    assert neighbours < 0.2 * pairs  # in sample order, all would be
    assert len(set(by_pass[0]) & set(by_pass[1])) < 0.2 * len(by_pass[1])


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_sources=st.integers(2, 20),
    world_size=st.sampled_from([1, 2, 8]),
    budget=st.floats(0.2, 3.0),
    seed=st.integers(0, 2**16),
    mode=st.sampled_from(["pack", "pad"]),
    drop_last=st.booleans(),
    warmup=st.booleans(),
)
def test_hypothesis_mixtures_hold_shares_repeat_in_order_and_keep_every_single_dataset_guarantee(
    tmp_path, num_sources, world_size, budget, seed, mode, drop_last, warmup
):
    """Drawn with and without ``drop_last`` and a sequence-length warmup over a quarter of
    epoch 0 (`_mixture_recount` counts the dropped uses and checks the warmup's caps)."""
    rng = np.random.default_rng(seed)
    lengths = [
        np.clip(rng.lognormal(rng.uniform(3, 6), 0.8, rng.integers(20, 3000)), 1, 1024).astype(np.int32)
        for _ in range(num_sources)
    ]
    weights = (10 ** rng.uniform(-3, 0, num_sources)).tolist()
    tokens = int(sum(int(source.sum()) for source in lengths) * budget)
    directory = Path(tempfile.mkdtemp(dir=tmp_path))
    paths = write_sources(directory, lengths)
    mixture = mixture_of(paths, weights, tokens)
    epochs = int(rng.integers(1, 3))
    warm = dict(seqlen_warmup_min=64, seqlen_warmup_tokens=max(1, tokens // epochs // 4)) if warmup else {}
    config = PlanConfig(
        max_tokens=1024, world_size=world_size, mode=mode, seed=seed, epochs=epochs, drop_last=drop_last, **warm
    )
    path = directory / "plan.arrow"
    try:
        build_mixture_plan_file(mixture, path, config)
    except DatasetError as error:  # a mixture of less than one step in an epoch: nothing to keep
        assert drop_last and "would drop all" in str(error)
        return
    (directory / "mix.json").write_text(json.dumps(mixture.to_dict()))
    assert validate_plan(path, mixture=directory / "mix.json") == []
    counted = recount(path, np.concatenate(lengths))
    assert_counted_repetition_in_order(counted)
    assert_no_drift(counted, max_tokens=1024)
    assert_planned_tokens_add_up(counted)
    if warmup:
        assert_warmup_caps_hold(counted)


@pytest.mark.parametrize("oversize", ["drop", "truncate"])
def test_epochs_of_a_mixture_with_oversize_samples_hold_their_shares(tmp_path, oversize):
    """Each source's epochs are cut on the tokens sizing counts (oversize samples dropped or
    truncated), not on their lengths as read, so every epoch brings each source its share
    (the demo's dialogues run past 8,192 tokens; cut on raw lengths, step 762 held 12.5 % of
    a source weighted 30 %)."""
    config = PlanConfig(max_tokens=8192, world_size=8, micro_batches=2, epochs=3, oversize=oversize, seed=1)
    build_mixture_plan_file(DEMO, tmp_path / "plan.arrow", config)
    assert validate_plan(tmp_path / "plan.arrow", mixture=DEMO) == []


def test_mixture_rebuild_is_byte_identical(tmp_path):
    config = PlanConfig(max_tokens=4096, world_size=4, oversize="split", seed=3)
    build_mixture_plan_file(DEMO, tmp_path / "a.arrow", config)
    build_mixture_plan_file(DEMO, tmp_path / "b.arrow", config)
    assert (tmp_path / "a.arrow").read_bytes() == (tmp_path / "b.arrow").read_bytes()


def test_validate_finds_a_micro_batch_of_two_sources(tmp_path, demo_plan):
    from batchplan.operations.mixture_checks import check_mixture

    plan = open_plan(demo_plan)
    sources = plan.metadata["mixture"]["sources"]
    moved = json.loads(json.dumps(plan.metadata))
    moved["mixture"]["sources"][1]["offset"] = sources[1]["offset"] + 1  # a sample changes source

    found = check_mixture(WithMetadata(plan, moved))
    assert found and found[0].guarantee == "mixture_sources"
