"""A sequence-length warmup with a mixture: epoch 0's first tokens are pieces under the
growing cap, source by source, composed stage after stage, so that no step holds a sequence
above the cap at its end, the steps still hold every source's share, and the pieces tile
their uses. Counted again from the rows (`_mixture_recount`), then by validate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _mixture_recount import (
    assert_planned_tokens_add_up,
    assert_repetition_in_order,
    assert_shares_hold,
    assert_warmup_caps_hold,
    recount,
    warmup_cap,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplan import PlanConfig
from batchplan.errors import ConfigError, DatasetError
from batchplan.formats.mixture_file import read_mixture, read_mixture_lengths
from batchplan.formats.opening import open_plan
from batchplan.kernels.interleave import compose_segments, compose_steps
from batchplan.operations.build_mixture import build_mixture_plan_file
from batchplan.operations.replan_mixture import replan_mixture_file
from batchplan.operations.validate import validate_plan
from batchplan.planning.mixture_steps import step_sizing
from batchplan.planning.mixture_warmup import carry_bound

DATA = Path(__file__).resolve().parent.parent / "data"
DEMO = DATA / "mixture.yaml"
WARMUP = {"seqlen_warmup_min": 512, "seqlen_warmup_tokens": 20_000_000}


@pytest.fixture(scope="module")
def lengths() -> np.ndarray:
    return read_mixture_lengths(read_mixture(DEMO)).lengths


@pytest.fixture(scope="module")
def warmed(tmp_path_factory) -> Path:
    """The demo mixture with a warmup over its first 20M tokens, 8 ranks x 4 micro-batches."""
    path = tmp_path_factory.mktemp("warmup") / "plan.arrow"
    config = PlanConfig(max_tokens=8192, world_size=8, micro_batches=4, oversize="split", epochs=2, **WARMUP)
    build_mixture_plan_file(DEMO, path, config)
    return path


def weights_due(counted) -> np.ndarray:
    weights = np.array([source["weight"] for source in counted.meta["mixture"]["sources"]])
    return counted.per_step.sum(axis=1)[:, None] * weights[None, :]


def test_a_mixture_plan_with_a_warmup_passes_validate(warmed):
    assert validate_plan(warmed, mixture=DEMO) == []


def test_no_step_holds_a_sequence_above_the_cap_at_its_end(warmed, lengths):
    assert_warmup_caps_hold(recount(warmed, lengths))


def test_the_warmup_trains_short_sequences_first(warmed, lengths):
    """The cap is not only held but used: the warmup's first steps hold nothing near
    max_tokens, and its pieces grow towards it."""
    counted = recount(warmed, lengths)
    ends = counted.tokens_before() + counted.per_step.sum(axis=1)
    early = ends <= 2_000_000
    assert counted.longest[early].max() <= warmup_cap(2_000_000, 512, 20_000_000, 8192)
    assert counted.longest[ends > 25_000_000].max() > 4096


def test_warmup_steps_hold_every_sources_share(warmed, lengths):
    counted = recount(warmed, lengths)
    assert_shares_hold(counted, weights_due(counted))


def test_warmup_pieces_tile_their_uses_in_order(warmed, lengths):
    counted = recount(warmed, lengths)
    uses = np.bincount(counted.use_sample, minlength=lengths.shape[0])
    assert (counted.covered == uses * lengths.astype(np.int64)).all()
    assert_repetition_in_order(counted)
    assert_planned_tokens_add_up(counted)


def test_after_the_warmup_samples_are_whole(warmed, lengths):
    """Once the warmup is over, entries are whole samples (or, over max_tokens, split as
    oversize="split" splits them)."""
    plan = open_plan(warmed)
    ends = np.cumsum(plan.metadata["steps_per_epoch"])
    for rank in range(plan.world_size):
        for row in plan.read_rank(1, rank).to_pylist():
            for sample, start, length in zip(row["samples"], row["starts"], row["lengths"]):
                assert length == min(int(lengths[sample]) - start, 8192), (sample, start, length)
    assert ends[-1] == plan.num_steps


@pytest.mark.parametrize(
    "options",
    [
        {"tokens_per_step": 300_000, "drop_last": True},
        {"micro_batches": 2, "mode": "pad"},
        {"micro_batches": 4, "rampup_start": 8 * 8192, "rampup_tokens": 30_000_000},
        {"micro_batches": 1, "world_size": 2},
    ],
)
def test_warmup_with_token_targets_ramps_padding_and_drop_last(tmp_path, lengths, options):
    path = tmp_path / "plan.arrow"
    config = PlanConfig(**{"max_tokens": 8192, "world_size": 8, "oversize": "split", **WARMUP, **options})
    build_mixture_plan_file(DEMO, path, config)
    assert validate_plan(path, mixture=DEMO) == []
    counted = recount(path, lengths)
    assert_warmup_caps_hold(counted)
    assert_shares_hold(counted, weights_due(counted))
    assert_planned_tokens_add_up(counted)


def test_a_warmup_longer_than_epoch_0_is_one_error(tmp_path):
    config = PlanConfig(
        max_tokens=8192,
        world_size=8,
        oversize="split",
        epochs=2,
        seqlen_warmup_min=512,
        seqlen_warmup_tokens=60_000_000,
    )
    with pytest.raises(DatasetError, match="more tokens than the mixture's epoch 0 holds") as error:
        build_mixture_plan_file(DEMO, tmp_path / "plan.arrow", config)
    assert "\n" not in str(error.value)


def test_replanning_inside_the_warmup_is_refused_and_after_it_holds(tmp_path, warmed):
    steps = open_plan(warmed).metadata["steps_per_epoch"]
    with pytest.raises(ConfigError, match="inside the plan's sequence-length warmup"):
        replan_mixture_file(warmed, tmp_path / "early.arrow", DATA / "mixture-anneal.yaml", from_step=5)
    replan_mixture_file(warmed, tmp_path / "late.arrow", DATA / "mixture-anneal.yaml", from_step=steps[0] - 3)
    assert validate_plan(tmp_path / "late.arrow", mixture=DATA / "mixture-anneal.yaml") == []


def test_rebuild_with_a_warmup_is_byte_identical_and_a_directory_holds_the_same_plan(tmp_path):
    config = PlanConfig(max_tokens=8192, world_size=4, micro_batches=2, oversize="split", epochs=2, **WARMUP)
    build_mixture_plan_file(DEMO, tmp_path / "a.arrow", config)
    build_mixture_plan_file(DEMO, tmp_path / "b.arrow", config)
    assert (tmp_path / "a.arrow").read_bytes() == (tmp_path / "b.arrow").read_bytes()
    build_mixture_plan_file(DEMO, tmp_path / "dir", config, layout="directory")
    assert validate_plan(tmp_path / "dir", mixture=DEMO) == []


def test_a_source_with_too_few_tokens_for_its_share_of_the_warmup(tmp_path):
    """A source far smaller in epoch 0 than its weight of the warmup gives all it has; the
    others give more, so the rest of the epoch still begins after the warmup."""
    rng = np.random.default_rng(1)
    values = {"small": rng.integers(1, 200, 40), "large": rng.integers(1, 1024, 4000)}
    for name, array in values.items():
        pq.write_table(pa.table({"length": array.astype(np.int32)}), tmp_path / f"{name}.parquet")
    total = int(values["large"].sum())
    spec = {
        "sources": [
            {"name": "small", "paths": ["small.parquet"], "epochs": 1},
            {"name": "large", "paths": ["large.parquet"], "epochs": 1},
        ]
    }
    (tmp_path / "mix.json").write_text(json.dumps(spec))
    config = PlanConfig(
        max_tokens=1024, world_size=2, micro_batches=2, seqlen_warmup_min=64, seqlen_warmup_tokens=total // 2
    )
    build_mixture_plan_file(tmp_path / "mix.json", tmp_path / "plan.arrow", config)
    assert validate_plan(tmp_path / "plan.arrow", mixture=tmp_path / "mix.json") == []
    counted = recount(tmp_path / "plan.arrow", np.concatenate([values["small"], values["large"]]))
    assert_warmup_caps_hold(counted)


def random_sizing(rng, world_size: int, per_step: int | None, ramp: bool, max_tokens: int, total: int) -> PlanConfig:
    """A config of ``per_step`` micro-batches per rank or a token target, with or without a ramp-up."""
    full = (per_step or int(rng.integers(1, 6))) * world_size * max_tokens
    sizing: dict[str, int] = {"micro_batches": per_step} if per_step else {"tokens_per_step": full}
    if ramp and world_size * max_tokens < full:
        sizing |= {"rampup_start": world_size * max_tokens, "rampup_tokens": total // 2 + 1}
    return PlanConfig(max_tokens=max_tokens, world_size=world_size, **sizing)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    num_sources=st.integers(1, 5),
    num_segments=st.integers(1, 6),
    world_size=st.integers(1, 6),
    per_step=st.one_of(st.none(), st.integers(1, 4)),
    ramp=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_segment_joins_only_where_what_the_earlier_ones_left_fits_in_a_step(
    num_sources, num_segments, world_size, per_step, ramp, seed
):
    """`compose_segments` against a recount: every micro-batch once, each source's in its
    queue's order, and a micro-batch of segment g taken in a step that begins after every
    token of segments 0..g-1 but at most `carry_bound` (what the warmup's caps are lowered
    by), whether it joins where the earlier ones' rest fits in a step or early, where a
    source runs short of its share."""
    rng = np.random.default_rng(seed)
    max_tokens = 64
    sizes = rng.integers(0, 25, (num_segments, num_sources))
    sizes[0, 0] += 1
    tokens = rng.integers(1, max_tokens + 1, int(sizes.sum())).astype(np.int64)
    config = random_sizing(rng, world_size, per_step, ramp, max_tokens, int(tokens.sum()))
    offsets = np.concatenate([[0], np.cumsum(sizes.sum(axis=0))]).astype(np.int64)
    limits = offsets[:-1] + np.cumsum(sizes, axis=0)
    segment_of = np.zeros(tokens.shape[0], dtype=np.int64)
    for source in range(num_sources):
        bounds = np.concatenate([[offsets[source]], limits[:, source]])
        for segment in range(num_segments):
            segment_of[bounds[segment] : bounds[segment + 1]] = segment
    shares = np.array([tokens[a:b].sum() for a, b in zip(offsets[:-1], offsets[1:])], dtype=np.float64)
    shares /= shares.sum()
    out = np.empty(tokens.shape[0], dtype=np.int64)
    steps = np.empty(tokens.shape[0] + 1, dtype=np.int64)
    before_segment = np.concatenate([[0], np.cumsum(np.bincount(segment_of, weights=tokens, minlength=num_segments))])
    joins = before_segment[:-1] - carry_bound(config)
    count = compose_segments(
        offsets,
        limits,
        joins,
        tokens,
        np.zeros(1),
        shares[None, :],
        shares,
        world_size,
        float(max_tokens),  # the planner's type: one compiled version
        step_sizing(config, 0, float(tokens.mean())),
        out,
        steps,
    )
    steps = steps[: count + 1]
    assert sorted(out.tolist()) == list(range(tokens.shape[0]))
    for source in range(num_sources):
        mine = out[(out >= offsets[source]) & (out < offsets[source + 1])]
        assert (np.diff(mine) == 1).all()
    step_of = np.repeat(np.arange(count), np.diff(steps))
    begins = np.concatenate([[0], np.cumsum(tokens[out])])[steps[:-1]][step_of]
    assert (begins >= before_segment[segment_of[out]] - carry_bound(config)).all()
    if per_step and not ramp:
        assert (np.diff(steps)[:-1] == world_size * per_step).all()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    num_sources=st.integers(1, 5),
    world_size=st.integers(1, 6),
    per_step=st.one_of(st.none(), st.integers(1, 4)),
    ramp=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_last_composed_step_holds_at_most_the_carry_bound(num_sources, world_size, per_step, ramp, seed):
    """What a composition's last step holds (what is left when it fits in a step) is at most
    `carry_bound`."""
    rng = np.random.default_rng(seed)
    max_tokens = 64
    sizes = rng.integers(0, 60, num_sources)
    sizes[0] += 1
    tokens = rng.integers(1, max_tokens + 1, int(sizes.sum())).astype(np.int64)
    config = random_sizing(rng, world_size, per_step, ramp, max_tokens, int(tokens.sum()))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    shares = np.array([tokens[a:b].sum() for a, b in zip(offsets[:-1], offsets[1:])], dtype=np.float64)
    shares /= shares.sum()
    out = np.empty(tokens.shape[0], dtype=np.int64)
    steps = np.empty(tokens.shape[0] + 1, dtype=np.int64)
    before = int(rng.integers(0, 2 * int(tokens.sum())))
    count = compose_steps(
        offsets,
        tokens,
        np.zeros(1),
        shares[None, :],
        shares,
        world_size,
        float(max_tokens),
        step_sizing(config, before, float(tokens.mean())),
        out,
        steps,
    )
    assert tokens[out[steps[count - 1] : steps[count]]].sum() <= carry_bound(config)
