"""Mixtures whose weights change during the run: phases in the file, sizing by phase, the
switch at exactly the first step whose tokens before it reach ``from_tokens``, shares held
per phase (a step in which a phase begins: each phase's weight of its tokens there), no
drift from the switch on, and what `inspect` and `validate` say about them.

The checks here recount from the rows and the mixture as the test wrote it (not from the
plan's metadata or the planner's arithmetic)."""

from __future__ import annotations

import json
import tempfile
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _mixture_recount import (
    assert_planned_tokens_add_up,
    assert_repetition_in_order,
    assert_warmup_caps_hold,
    recount,
)
from _plan_views import WithMetadata
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from batchplan import PlanConfig
from batchplan.errors import ConfigError, DatasetError
from batchplan.formats.opening import open_plan
from batchplan.kernels.interleave import compose_steps
from batchplan.mixture import Mixture, MixturePhase, MixtureSource
from batchplan.operations.build_mixture import build_mixture_plan_file
from batchplan.operations.validate import validate_plan
from batchplan.planning.mixture_sizing import select_sources
from batchplan_cli.main import app

runner = CliRunner()


def two_sources(**phase) -> dict:
    values = {
        "sources": [{"name": "a", "paths": ["x"], "weight": 1}, {"name": "b", "paths": ["y"], "weight": 3}],
        "tokens": "1M",
    }
    if phase:
        values["phases"] = [phase]
    return values


# --------------------------------------------------------------------------- the file


def test_phases_read_and_round_trip():
    mixture = Mixture.from_dict(two_sources(from_tokens="500k", weights={"a": 1, "b": 0}))
    assert mixture.phases == (MixturePhase(from_tokens=500_000, weights={"a": 1.0, "b": 0.0}),)
    assert Mixture.from_dict(mixture.to_dict()) == mixture
    assert mixture.phase_weights() == ([0, 500_000], [[0.25, 0.75], [1.0, 0.0]])


def test_a_mixture_without_phases_keeps_its_form_and_fingerprint():
    mixture = Mixture.from_dict(two_sources())
    assert "phases" not in mixture.to_dict()
    assert mixture.fingerprint() == Mixture.from_dict({**two_sources(), "phases": []}).fingerprint()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (two_sources(from_tokens=0, weights={"a": 1, "b": 1}), "from_tokens must be a whole number"),
        (two_sources(from_tokens="1M", weights={"a": 1, "b": 1}), "between the previous phase's"),
        (two_sources(from_tokens=10, weights={"a": 1}), "leave out sources ['b']"),
        (two_sources(from_tokens=10, weights={"a": 1, "b": 1, "c": 1}), "unknown sources ['c']"),
        (two_sources(from_tokens=10, weights={"a": 0, "b": 0}), "every weight is 0"),
        (two_sources(from_tokens=10, weights={"a": -1, "b": 0}), "finite number >= 0"),
        (two_sources(from_tokens=10, weights={"a": 1, "b": 1}, ramp_tokens=5), "unknown keys ['ramp_tokens']"),
        (two_sources(from_tokens=10), "key 'weights' is missing"),
        ({**two_sources(), "phases": {"from_tokens": 10}}, "phases must be a list"),
        (
            {
                "sources": [{"name": "a", "paths": ["x"], "epochs": 1}],
                "phases": [{"from_tokens": 10, "weights": {"a": 1}}],
            },
            "need the mixture's tokens",
        ),
    ],
)
def test_bad_phases_are_one_clear_error(values, message):
    with pytest.raises(ConfigError) as error:
        Mixture.from_dict(values)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_phases_out_of_order_are_refused():
    values = two_sources(from_tokens=600, weights={"a": 1, "b": 1})
    values["phases"].append({"from_tokens": 500, "weights": {"a": 1, "b": 1}})
    with pytest.raises(ConfigError, match="increasing from_tokens"):
        Mixture.from_dict(values)


# --------------------------------------------------------------------------- sizing


def test_each_source_is_sized_by_its_weight_in_every_phase():
    """a: 1/4 of the first 600 tokens, all of the last 400; b: the rest (samples of 1 token:
    the targets are met exactly)."""
    mixture = Mixture(
        sources=(MixtureSource(name="a", paths=("x",), weight=1), MixtureSource(name="b", paths=("y",), weight=3)),
        tokens=1000,
        phases=(MixturePhase(from_tokens=600, weights={"a": 1, "b": 0}),),
    )
    lengths = np.ones(2000, dtype=np.int32)
    selections = select_sources(mixture, lengths, np.array([0, 1000, 2000]), seed=0)
    assert [s.target_tokens for s in selections] == [150 + 400, 450]
    assert [s.planned_tokens for s in selections] == [550, 450]
    assert [s.weight for s in selections] == [0.55, 0.45]


# --------------------------------------------------------------------------- the kernel


def due_per_step(before, totals, starts, weights):
    """Each phase's weights times the step's tokens in it (a recount, in exact fractions)."""
    ends = list(starts[1:]) + [None]
    due = np.zeros((len(before), len(weights[0])))
    for step, (first, size) in enumerate(zip(before, totals)):
        for start, end, row in zip(starts, ends, weights):
            inside = max(0, (first + size if end is None else min(first + size, end)) - max(first, start))
            for source, weight in enumerate(row):
                due[step, source] += float(Fraction(weight) * inside)
    return due


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    num_sources=st.integers(2, 5),
    world_size=st.integers(1, 4),
    rounds=st.integers(1, 3),
    num_phases=st.integers(2, 4),
    seed=st.integers(0, 2**16),
)
def test_composed_steps_switch_at_the_step_and_hold_each_phase(num_sources, world_size, rounds, num_phases, seed):
    """Micro-batches of 1..64 tokens, phases at random points of the epoch (the sources'
    micro-batches sized to what the phases ask): every step but the last holds each source
    within 64 tokens of what its step is due."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.ones(num_sources), num_phases)
    weights[rng.random(weights.shape) < 0.2] = 0.0
    weights[:, 0] += 0.05
    weights /= weights.sum(axis=1, keepdims=True)
    total = 20_000
    starts = np.concatenate([[0], np.sort(rng.choice(np.arange(1, total), num_phases - 1, replace=False))])
    spans = np.diff(np.append(starts, total))
    supply = (weights * spans[:, None]).sum(axis=0)
    tokens, sizes = [], []
    for source in range(num_sources):
        mine = []
        while sum(mine) < supply[source] - 32:
            mine.append(int(rng.integers(1, 65)))
        tokens += mine
        sizes.append(len(mine))
    tokens = np.array(tokens, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    shares = np.array([tokens[a:b].sum() for a, b in zip(offsets[:-1], offsets[1:])], dtype=np.float64)
    shares /= shares.sum()
    out = np.empty(tokens.shape[0], dtype=np.int64)
    steps = np.empty(tokens.shape[0] + 1, dtype=np.int64)
    sizing = np.array([rounds, 0, 0, 0, 0, 0], dtype=np.float64)
    count = compose_steps(
        offsets, tokens, starts.astype(np.float64), weights, shares, world_size, 64.0, sizing, out, steps
    )
    steps = steps[: count + 1]
    assert sorted(out.tolist()) == list(range(tokens.shape[0]))
    source_of = np.searchsorted(offsets, out, side="right") - 1
    per_step = np.zeros((count, num_sources))
    for step, (first, last) in enumerate(zip(steps[:-1], steps[1:])):
        np.add.at(per_step[step], source_of[first:last], tokens[out[first:last]])
    totals = per_step.sum(axis=1)
    before = np.concatenate([[0], np.cumsum(totals)[:-1]])
    due = due_per_step(before.astype(int).tolist(), totals.astype(int).tolist(), starts.tolist(), weights.tolist())
    assert (np.abs(per_step - due)[:-1] <= 64 + 1e-9).all()


# --------------------------------------------------------------------------- plans


def write_sources(directory: Path, lengths: list[np.ndarray]) -> list[str]:
    paths = []
    for index, values in enumerate(lengths):
        path = directory / f"source{index}.parquet"
        pq.write_table(pa.table({"length": values.astype(np.int32)}), path)
        paths.append(str(path))
    return paths


def per_step_tokens(path: Path, num_sources: int):
    """``(per_step, epoch_of_step)``: tokens of each source in each step, from the rows' samples."""
    plan = open_plan(path)
    sources = plan.metadata["mixture"]["sources"]
    bounds = np.array([s["offset"] for s in sources] + [plan.num_samples])
    per_step = np.zeros((plan.num_steps, num_sources), dtype=np.int64)
    first_step = plan.metadata.get("first_step", 0)
    for epoch in range(plan.num_epochs):
        for rank in range(plan.world_size):
            for row in plan.read_rank(epoch, rank).to_pylist():
                if row["samples"]:
                    source = int(np.searchsorted(bounds, row["samples"][0], side="right") - 1)
                    per_step[row["step"] - first_step, source] += row["tokens"]
    return per_step, np.repeat(np.arange(plan.num_epochs), plan.metadata["steps_per_epoch"])


def assert_phases_hold(per_step, epoch_of_step, mixture: Mixture, max_tokens: int, tokens_before: int = 0) -> None:
    """Every step but each epoch's last is within max(0.5 %, max_tokens) of what it is due;
    from each switch (and each epoch's first step) on, no source drifts by more than a step
    plus what the stretch's own tokens of it miss. ``tokens_before``: the run's tokens before
    the first step."""
    starts, weights = mixture.phase_weights()
    totals = per_step.sum(axis=1)
    before = tokens_before + np.concatenate([[0], np.cumsum(totals)[:-1]])
    due = due_per_step(before.tolist(), totals.tolist(), starts, weights)
    last = np.append(epoch_of_step[1:] != epoch_of_step[:-1], True)
    allowed = np.maximum(0.005 * totals, max_tokens)
    off = (np.abs(per_step - due) > allowed[:, None] + 1e-6) & ~last[:, None]
    assert not off.any(), np.argwhere(off)[:3]
    phase = np.searchsorted(starts, before, side="right") - 1
    stretch = np.concatenate([[0], np.cumsum((np.diff(phase) != 0) | (np.diff(epoch_of_step) != 0))])
    for index in np.unique(stretch):
        mine = stretch == index
        part, owed = per_step[mine], due[mine]
        step = max(totals[epoch_of_step == epoch_of_step[mine][0]].mean(), max_tokens)
        own_miss = np.abs(part.sum(axis=0) - owed.sum(axis=0))
        drift = np.abs(np.cumsum(part, axis=0) - np.cumsum(owed, axis=0))
        assert (drift <= step + own_miss + 1e-6).all(), index


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_sources=st.integers(2, 8),
    num_phases=st.integers(1, 3),
    world_size=st.sampled_from([1, 2, 8]),
    budget=st.floats(0.3, 2.5),
    epochs=st.integers(1, 3),
    mode=st.sampled_from(["pack", "pad"]),
    rampup=st.booleans(),
    seed=st.integers(0, 2**16),
    drop_last=st.booleans(),
    warmup=st.booleans(),
)
def test_hypothesis_phased_mixtures_switch_at_the_step_and_hold_every_guarantee(
    tmp_path, num_sources, num_phases, world_size, budget, epochs, mode, rampup, seed, drop_last, warmup
):
    """Drawn with and without ``drop_last`` and a sequence-length warmup over a quarter of
    epoch 0 (`_mixture_recount` counts the dropped uses and checks the warmup's caps)."""
    rng = np.random.default_rng(seed)
    lengths = [
        np.clip(rng.lognormal(rng.uniform(3, 6), 0.8, rng.integers(50, 2000)), 1, 1024).astype(np.int32)
        for _ in range(num_sources)
    ]
    tokens = int(sum(int(values.sum()) for values in lengths) * budget)
    # switches anywhere: the run's first and last steps, epoch boundaries, and between
    points = rng.choice(
        [1, tokens // max(epochs, 2), tokens - 1, *rng.integers(1, tokens, 4)], num_phases, replace=False
    )
    phases = []
    for point in np.unique(points)[: num_phases - 1] if num_phases > 1 else []:
        row = 10 ** rng.uniform(-3, 0, num_sources)
        row[rng.random(num_sources) < 0.3] = 0.0
        row[rng.integers(num_sources)] = 1.0
        phases.append(MixturePhase(from_tokens=int(point), weights={f"s{i}": float(w) for i, w in enumerate(row)}))
    directory = Path(tempfile.mkdtemp(dir=tmp_path))
    paths = write_sources(directory, lengths)
    weights = 10 ** rng.uniform(-3, 0, num_sources)
    mixture = Mixture(
        sources=tuple(
            MixtureSource(name=f"s{i}", paths=(p,), weight=float(w)) for i, (p, w) in enumerate(zip(paths, weights))
        ),
        tokens=tokens,
        phases=tuple(phases),
    )
    ramp = dict(micro_batches=2, rampup_start=world_size * 1024, rampup_tokens=tokens // 2) if rampup else {}
    epochs = 1 if drop_last and phases else epochs  # drop_last with phases takes one epoch (test_mixture_drop_last)
    warm = dict(seqlen_warmup_min=64, seqlen_warmup_tokens=max(1, tokens // epochs // 4)) if warmup else {}
    config = PlanConfig(
        max_tokens=1024, world_size=world_size, mode=mode, seed=seed, epochs=epochs, drop_last=drop_last, **ramp, **warm
    )
    path = directory / "plan.arrow"
    try:
        build_mixture_plan_file(mixture, path, config)
    except DatasetError as error:  # a mixture of less than one step in an epoch: nothing to keep
        assert drop_last and "would drop all" in str(error)
        return
    (directory / "mix.json").write_text(json.dumps(mixture.to_dict()))
    assert validate_plan(path, mixture=directory / "mix.json") == []
    per_step, epoch_of_step = per_step_tokens(path, num_sources)
    assert_phases_hold(per_step, epoch_of_step, mixture, max_tokens=1024)
    counted = recount(path, np.concatenate(lengths))
    assert_repetition_in_order(counted)
    assert_planned_tokens_add_up(counted)
    if warmup:
        assert_warmup_caps_hold(counted)


def a_then_b(tmp_path: Path, switch: float, **options) -> tuple[Path, Mixture, int]:
    """Source a alone, then source b alone from ``switch`` of the run's tokens on."""
    rng = np.random.default_rng(5)
    lengths = [np.clip(rng.lognormal(5, 0.8, 3000), 1, 1024).astype(np.int32) for _ in range(2)]
    paths = write_sources(tmp_path, lengths)
    tokens = int(lengths[0].sum())
    mixture = Mixture(
        sources=(
            MixtureSource(name="a", paths=(paths[0],), weight=1),
            MixtureSource(name="b", paths=(paths[1],), weight=0),
        ),
        tokens=tokens,
        phases=(MixturePhase(from_tokens=max(1, int(switch * tokens)), weights={"a": 0, "b": 1}),),
    )
    config = PlanConfig(max_tokens=1024, **{"world_size": 2, "micro_batches": 2, **options})
    path = tmp_path / "plan.arrow"
    build_mixture_plan_file(mixture, path, config)
    return path, mixture, tokens


@pytest.mark.parametrize(
    ("switch", "options"),
    [
        (0.0, {}),  # in the run's first step
        (0.5, {}),
        (0.5, {"epochs": 2}),  # at the epochs' boundary
        (0.3, {"epochs": 3}),
        (0.2, {"rampup_start": 2048, "rampup_tokens": 400_000}),  # inside a ramp-up
        (0.98, {}),  # in the run's last steps
        (0.999, {}),  # in the last step: no step begins in the phase
    ],
)
def test_the_switch_happens_at_the_first_step_whose_tokens_before_reach_it(tmp_path, switch, options):
    """Steps wholly before the switch hold only a; from the first step whose tokens before it
    reach from_tokens, only b (but an epoch's last step, which takes what is left); the step
    the switch falls in holds a for its tokens before the switch (within a micro-batch)."""
    path, mixture, _ = a_then_b(tmp_path, switch, **options)
    assert validate_plan(path) == []
    per_step, epoch_of_step = per_step_tokens(path, 2)
    totals = per_step.sum(axis=1)
    before = np.concatenate([[0], np.cumsum(totals)[:-1]])
    at = mixture.phases[0].from_tokens
    last = np.append(epoch_of_step[1:] != epoch_of_step[:-1], True)
    first_b = int(np.searchsorted(before, at, side="left"))
    assert (per_step[: first_b - 1, 1] == 0).all() if first_b else True
    assert (per_step[first_b:, 0][~last[first_b:]] == 0).all()
    if first_b:
        into = first_b - 1  # the step the switch falls in
        assert abs(per_step[into, 0] - (at - before[into])) <= 1024 or last[into]
    summary = json.loads(runner.invoke(app, ["inspect", str(path), "--json"]).stdout)
    assert [p["first_step"] for p in summary["mixture_phases"]] == [0, first_b if first_b < len(totals) else None]
    assert [p["tokens"] for p in summary["mixture_phases"]] == [
        int(totals[:first_b].sum()),
        int(totals[first_b:].sum()),
    ]


def test_the_plan_records_its_phases(tmp_path):
    path, mixture, _ = a_then_b(tmp_path, 0.5)
    described = open_plan(path).metadata["mixture"]
    assert described["phases"] == [
        {"from_tokens": 0, "weights": [1.0, 0.0]},
        {"from_tokens": mixture.phases[0].from_tokens, "weights": [0.0, 1.0]},
    ]
    assert described["spec"]["phases"] == [phase.to_dict() for phase in mixture.phases]


def test_validate_finds_a_switch_at_the_wrong_step(tmp_path):
    """The plan's rows checked against phases that begin ten steps later: the steps between
    hold b where a was due."""
    from batchplan.operations.mixture_checks import check_mixture

    path, mixture, _ = a_then_b(tmp_path, 0.5)
    plan = open_plan(path)
    moved = json.loads(json.dumps(plan.metadata))
    step_tokens = plan.metadata["mixture"]["phases"][1]["from_tokens"] / sum(plan.metadata["steps_per_epoch"]) * 2
    moved["mixture"]["phases"][1]["from_tokens"] += int(10 * step_tokens)

    found = check_mixture(WithMetadata(plan, moved))
    assert found and found[0].guarantee == "mixture_shares"


def test_inspect_plot_marks_the_switch(tmp_path):
    path, _, _ = a_then_b(tmp_path, 0.5)
    result = runner.invoke(app, ["inspect", str(path), "--plot", str(tmp_path / "plan.png")])
    assert result.exit_code == 0, result.output
    assert "phases" in result.stdout and (tmp_path / "plan.png").stat().st_size > 0
