"""Batch-size ramp-up (``--rampup START:TOKENS``) and sequence-length warmup
(``--seqlen-warmup MIN:TOKENS``): steps grow as specified, pieces tile samples under a
growing cap, every DESIGN.md guarantee still holds (`check_plan` and the independent
`reference.check_guarantees`), rebuilds are byte-identical, the LR helper follows the
tokens, and bad options fail with one clear error.

Plans cross pack/pad, world sizes 1, 8 and 64, a token target or micro-batches,
drop_last, several epochs, ramps that end inside the first epoch or run past it.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import reference as ref
from conftest import build_and_write, dataset_lengths
from typer.testing import CliRunner

from batchplan import PlanConfig
from batchplan.errors import ConfigError, DatasetError
from batchplan.formats.opening import open_plan
from batchplan.operations.validate import check_plan
from batchplan.reports.summary import summarize_plan
from batchplan.runtime.lr_schedule import read_step_tokens, token_lr_factor, token_lr_lambda
from batchplan_cli.main import app

LENGTHS = dataset_lengths("lognormal")  # 3,000 samples, ~2.5 M tokens, some above 2,048
CAP = 2048

CASES = {
    "pack-w8-tokens": dict(
        world_size=8,
        tokens_per_step=8 * CAP * 4,
        rampup_start=8 * CAP,
        rampup_tokens=1_500_000,
        epochs=2,
        oversize="split",
    ),
    "pack-w8-micro-droplast": dict(
        world_size=8,
        micro_batches=4,
        rampup_start=8 * CAP,
        rampup_tokens=1_500_000,
        epochs=3,
        oversize="split",
        drop_last=True,
    ),
    "pad-w1-micro-past-epoch": dict(
        mode="pad",
        world_size=1,
        micro_batches=4,
        rampup_start=CAP,
        rampup_tokens=4_000_000,
        epochs=3,
        oversize="drop",
        drop_last=True,
    ),
    "pad-w64-tokens-past-epoch": dict(
        mode="pad",
        world_size=64,
        tokens_per_step=64 * CAP * 2,
        rampup_start=64 * CAP,
        rampup_tokens=3_000_000,
        epochs=2,
        oversize="truncate",
    ),
    "warmup-pack-w1": dict(
        world_size=1, seqlen_warmup_min=16, seqlen_warmup_tokens=2_000_000, epochs=2, oversize="split", hidden_size=256
    ),
    "warmup-pad-w8": dict(
        mode="pad",
        world_size=8,
        seqlen_warmup_min=64,
        seqlen_warmup_tokens=1_000_000,
        epochs=2,
        oversize="split",
        batch_multiple=4,
    ),
    "both-pack-w64-droplast": dict(
        world_size=64,
        tokens_per_step=64 * CAP * 3,
        rampup_start=64 * CAP,
        rampup_tokens=1_000_000,
        seqlen_warmup_min=64,
        seqlen_warmup_tokens=2_000_000,
        epochs=2,
        oversize="truncate",
        drop_last=True,
    ),
    "both-pad-w8-micro": dict(
        mode="pad",
        world_size=8,
        micro_batches=3,
        rampup_start=8 * CAP,
        rampup_tokens=800_000,
        seqlen_warmup_min=128,
        seqlen_warmup_tokens=500_000,
        epochs=2,
        oversize="split",
    ),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``built(name) -> (path, plan, config)``, each plan built and written once."""
    cache = {}
    folder = tmp_path_factory.mktemp("rampup")

    def get(name):
        if name not in cache:
            config = PlanConfig(max_tokens=CAP, seed=3, **CASES[name])
            path = folder / f"{name}.arrow"
            cache[name] = (path, build_and_write(LENGTHS, config, path), config)
        return cache[name]

    return get


def step_table(path):
    """``(tokens_before_step, step_tokens, micro-batches per rank)`` of every global step."""
    plan = open_plan(path)
    before, tokens = read_step_tokens(plan)
    micro = np.concatenate(
        [
            plan.read_rank(e, 0).column("num_micro").to_numpy()[plan.read_rank(e, 0).column("micro").to_numpy() == 0]
            for e in range(plan.num_epochs)
        ]
    )
    return before, tokens, micro


def ramp_goal(config: PlanConfig, done, full):
    done = np.asarray(done, dtype=np.float64)
    start = config.rampup_start
    return np.where(done >= config.rampup_tokens, full, start + (full - start) * done / config.rampup_tokens)


# --------------------------------------------------------------------------- every guarantee


@pytest.mark.parametrize("name", list(CASES))
def test_every_guarantee_holds(built, name):
    path, _, config = built(name)
    assert check_plan(open_plan(path), LENGTHS) == []
    assert ref.check_guarantees(path, LENGTHS, config=config) == []


@pytest.mark.parametrize("name", ["pack-w8-micro-droplast", "both-pack-w64-droplast"])
def test_rebuild_is_byte_identical_for_any_thread_count(built, name, tmp_path, monkeypatch):
    path, _, config = built(name)
    monkeypatch.setenv("BATCHPLAN_THREADS", "1")
    build_and_write(LENGTHS, config, tmp_path / "again.arrow")
    assert (tmp_path / "again.arrow").read_bytes() == path.read_bytes()


# --------------------------------------------------------------------------- ramp-up


@pytest.mark.parametrize("name", ["pack-w8-tokens", "pad-w64-tokens-past-epoch"])
def test_token_steps_follow_the_ramp(built, name):
    """Each step's tokens are within half a round of the ramp's target at its start; the
    first steps are near START, the steps past the ramp near tokens_per_step."""
    path, _, config = built(name)
    before, tokens, _ = step_table(path)
    goal = ramp_goal(config, before, config.tokens_per_step)
    half_chunk = config.world_size * CAP / 2
    assert (tokens <= goal + half_chunk).all()
    last_of_epoch = np.cumsum(open_plan(path).metadata["steps_per_epoch"]) - 1
    inner = np.setdiff1d(np.arange(tokens.size), last_of_epoch)
    assert (tokens[inner] >= goal[inner] - half_chunk).all()
    assert tokens[0] <= config.rampup_start + half_chunk
    inside = before < config.rampup_tokens
    assert inside[0] and inside.sum() >= 10, "the ramp spans many steps"
    # Steps grow: the mean of each quarter of the ramp exceeds the previous quarter's.
    quarters = [q.mean() for q in np.array_split(tokens[inside], 4)]
    assert all(a < b for a, b in zip(quarters, quarters[1:]))


def test_micro_batch_steps_ramp_to_the_fixed_count(built):
    """With --micro-batches M: at most M per rank during the ramp, growing from one; exactly
    M after it (drop_last: every step of every epoch)."""
    path, _, config = built("pack-w8-micro-droplast")
    before, tokens, micro = step_table(path)
    inside = before < config.rampup_tokens
    assert micro[0] == 1 and (micro[inside] <= config.micro_batches).all()
    assert (micro[~inside] == config.micro_batches).all()
    assert micro[inside][: inside.sum() // 4].mean() < micro[inside][-(inside.sum() // 4) :].mean()


def test_ramp_past_the_first_epoch_continues_from_its_tokens(built):
    """Epoch 1's first step is sized for the tokens of epoch 0 already done (not a restart)."""
    path, plan, config = built("pad-w1-micro-past-epoch")
    before, tokens, micro = step_table(path)
    first_of_epoch_1 = plan.epochs[0].num_steps
    assert 0 < before[first_of_epoch_1] < config.rampup_tokens
    assert micro[first_of_epoch_1] >= micro[:5].max() and micro[first_of_epoch_1] > 1


def test_lr_schedule_follows_the_tokens(built):
    path, _, _ = built("pack-w8-tokens")
    before, tokens, _ = step_table(path)
    assert before[0] == 0 and np.array_equal(before[1:], np.cumsum(tokens)[:-1])
    lr = token_lr_lambda(path, warmup_tokens=2_000_000, decay="linear")
    total = int(before[-1] + tokens[-1])
    for step in (0, 5, len(tokens) // 2, len(tokens) - 1):
        expected = token_lr_factor(
            int(before[step] + tokens[step]), warmup_tokens=2_000_000, total_tokens=total, decay="linear"
        )
        assert lr(step) == pytest.approx(expected)
    # Small steps early: the LR climbs per step by the step's share of the warmup tokens.
    assert lr(1) - lr(0) == pytest.approx(tokens[1] / 2_000_000)


def test_inspect_shows_the_ramp(built):
    path, _, config = built("pack-w8-tokens")
    summary = summarize_plan(open_plan(path))
    ramp = summary["rampup"]
    before, tokens, _ = step_table(path)
    assert ramp["start_tokens"] == config.rampup_start and ramp["target"] == config.tokens_per_step
    assert ramp["end_step"] == int(np.argmax(before >= config.rampup_tokens))
    assert ramp["steps_in_ramp"] == ramp["end_step"] and ramp["first_step_tokens"] == tokens[0]
    assert summary["seqlen_warmup"] is None
    result = CliRunner().invoke(app, ["inspect", str(path)])
    assert result.exit_code == 0 and "ramp-up" in result.stdout and f"step {ramp['end_step']:,}" in result.stdout


# --------------------------------------------------------------------------- sequence-length warmup


def entries_by_step(path, epoch):
    """Per row: (global step, lengths of its sequences, starts, samples) of one epoch."""
    table = open_plan(path).read_epoch(epoch).to_pydict()
    return list(zip(table["step"], table["lengths"], table["starts"], table["samples"]))


@pytest.mark.parametrize("name", ["warmup-pack-w1", "warmup-pad-w8", "both-pack-w64-droplast"])
def test_warmup_caps_grow_and_pieces_tile(built, name):
    path, plan, config = built(name)
    before, tokens, _ = step_table(path)
    end = before + tokens
    low, span = config.seqlen_warmup_min, config.seqlen_warmup_tokens
    longest = {}
    pieces = {}
    for step, lengths, starts, samples in entries_by_step(path, 0):
        longest[step] = max([longest.get(step, 0), *lengths])
        for sample, start, length in zip(samples, starts, lengths):
            pieces.setdefault(sample, []).append((start, length))
    caps = [CAP if t >= span else low + (CAP - low) * int(t) // span for t in end]
    assert all(longest[s] <= caps[s] for s in longest)
    assert longest[0] <= low + (CAP - low) * int(end[0]) // span
    # The cap grows: the early warmup holds only short sequences, the late one longer ones.
    inside = np.flatnonzero(end < span)
    assert len(inside) >= 4
    early, late = inside[: len(inside) // 4], inside[-(len(inside) // 4) :]
    assert max(longest[s] for s in early) < max(longest[s] for s in late)
    # Nothing lost: pieces tile each sample's kept tokens (drop_last pieces aside).
    kept = np.minimum(LENGTHS, CAP) if config.oversize == "truncate" else LENGTHS
    dropped = {s for s, *_ in open_plan(path).metadata["dropped"].get("drop_last_spans", {}).get("0", [])}
    for sample, got in pieces.items():
        if sample in dropped:
            continue
        got.sort()
        assert [start for start, _ in got] == list(np.cumsum([0] + [n for _, n in got])[:-1])
        assert sum(n for _, n in got) == kept[sample]
    split = sum(len(got) > 1 for s, got in pieces.items() if LENGTHS[s] <= CAP)
    assert split > 0, "the warmup split samples that fit max_tokens"


def test_warmup_touches_only_the_first_epoch(built):
    """Epoch 1 plans whole samples (oversize split aside) in random order, as without warmup."""
    path, _, _ = built("warmup-pack-w1")
    rows = entries_by_step(path, 1)
    for _, lengths, starts, samples in rows:
        for sample, start, length in zip(samples, starts, lengths):
            if LENGTHS[sample] <= CAP:
                assert start == 0 and length == LENGTHS[sample]


def test_inspect_shows_the_warmup(built):
    path, _, config = built("warmup-pad-w8")
    warmup = summarize_plan(open_plan(path))["seqlen_warmup"]
    before, _, _ = step_table(path)
    assert warmup["min_tokens"] == config.seqlen_warmup_min and warmup["warmup_tokens"] == config.seqlen_warmup_tokens
    assert warmup["end_step"] == int(np.argmax(before >= config.seqlen_warmup_tokens))
    assert warmup["first_step_longest"] <= 2 * config.seqlen_warmup_min
    result = CliRunner().invoke(app, ["inspect", str(path)])
    assert result.exit_code == 0 and "sequence-length warmup" in result.stdout


def test_warmup_plan_replays_pieces_through_the_sampler(built):
    from batchplan.runtime import PlanSampler

    path, _, config = built("warmup-pad-w8")
    sampler = PlanSampler(path, rank=3, world_size=8)
    first = next(iter(sampler.schedule()))
    assert first.spans is not None and max(n for _, n in first.spans) <= 2 * config.seqlen_warmup_min


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(rampup_start=8 * CAP, tokens_per_step=8 * CAP * 4), "give both or neither"),
        (dict(rampup_tokens=10, tokens_per_step=8 * CAP * 4), "give both or neither"),
        (dict(rampup_start=CAP, rampup_tokens=10, tokens_per_step=8 * CAP * 4), "smaller than one micro-batch"),
        (dict(rampup_start=8 * CAP * 4, rampup_tokens=10, tokens_per_step=8 * CAP * 4), "below `tokens_per_step`"),
        (dict(rampup_start=8 * CAP, rampup_tokens=10), "`micro_batches` above 1"),
        (dict(rampup_start=8 * CAP, rampup_tokens=10, micro_batches=1), "`micro_batches` above 1"),
        (dict(rampup_start=8 * CAP * 2, rampup_tokens=10, micro_batches=2), "below a full step"),
        (dict(rampup_start=8 * CAP, rampup_tokens=0, micro_batches=2), "`rampup_tokens` must be >= 1"),
        (dict(rampup_start=8.5 * CAP, rampup_tokens=10, micro_batches=2), "must be an integer"),
        (dict(seqlen_warmup_min=CAP, seqlen_warmup_tokens=10), "must be below max_tokens"),
        (dict(seqlen_warmup_min=0, seqlen_warmup_tokens=10), "`seqlen_warmup_min` must be >= 1"),
        (dict(seqlen_warmup_min=16), "give both or neither"),
    ],
)
def test_bad_options_are_clear_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        PlanConfig(max_tokens=CAP, world_size=8, **options)


def test_warmup_longer_than_an_epoch_and_loss_column_are_refused():
    from batchplan.planning.epochs import build_plan

    config = PlanConfig(max_tokens=CAP, oversize="split", seqlen_warmup_min=16, seqlen_warmup_tokens=10**9)
    with pytest.raises(DatasetError, match="lower `seqlen_warmup_tokens`"):
        build_plan(LENGTHS, config)
    config = dataclasses.replace(config, seqlen_warmup_tokens=1000)
    with pytest.raises(DatasetError, match="loss-tokens column"):
        build_plan(LENGTHS, config, loss_tokens=np.maximum(LENGTHS - 1, 0))


def test_resharding_a_ramp_up_plan_is_refused_clearly(built, tmp_path):
    from batchplan.operations.reshard import reshard_plan_file

    path, _, _ = built("pack-w8-tokens")
    with pytest.raises(ConfigError, match="a ramp-up"):
        reshard_plan_file(path, tmp_path / "new.arrow", world_size=4, from_step=3)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rampup", "16384"], "--rampup takes START:TOKENS"),
        (["--rampup", "a:b"], "--rampup takes START:TOKENS"),
        (["--seqlen-warmup", "64:1:2"], "--seqlen-warmup takes MIN:TOKENS"),
        (["--rampup", "4096:1M"], "--micro-batches above 1"),
    ],
)
def test_cli_bad_values_are_one_line(tmp_path, args, message):
    from conftest import DATA_DIR

    result = CliRunner().invoke(
        app,
        [
            "build",
            str(DATA_DIR / "squad11_bert384.parquet"),
            "-o",
            str(tmp_path / "p.arrow"),
            "--max-tokens",
            "4096",
            *args,
        ],
    )
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


def test_cli_builds_with_both(tmp_path):
    from conftest import DATA_DIR

    plan = tmp_path / "p.arrow"
    result = CliRunner().invoke(
        app,
        [
            "build",
            str(DATA_DIR / "squad11_bert384.parquet"),
            "-o",
            str(plan),
            "--max-tokens",
            "4096",
            "--world-size",
            "4",
            "--tokens-per-step",
            "65536",
            "--rampup",
            "16_384:2M",
            "--seqlen-warmup",
            "256:1M",
            "-q",
        ],
    )
    assert result.exit_code == 0, result.output
    config = open_plan(plan).metadata["config"]
    assert (config["rampup_start"], config["rampup_tokens"]) == (16_384, 2_000_000)
    assert (config["seqlen_warmup_min"], config["seqlen_warmup_tokens"]) == (256, 1_000_000)
    summary = json.loads(CliRunner().invoke(app, ["inspect", str(plan), "--json"]).stdout)
    assert summary["rampup"]["end_step"] is not None and summary["seqlen_warmup"]["end_step"] is not None
    result = CliRunner().invoke(app, ["validate", str(plan), "--dataset", str(DATA_DIR / "squad11_bert384.parquet")])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("inside_warmup_epoch", [False, True])
def test_resharding_a_warmup_plan_keeps_every_guarantee(built, tmp_path, inside_warmup_epoch):
    """Resharding keeps the warmup's pieces (each parent micro-batch is a unit)."""
    from batchplan.operations.reshard import reshard_plan_file

    path, plan, _ = built("warmup-pad-w8")
    new = tmp_path / "new.arrow"
    from_step = 5 if inside_warmup_epoch else plan.epochs[0].num_steps + 5
    reshard_plan_file(path, new, world_size=3, from_step=from_step)
    assert check_plan(open_plan(new), LENGTHS) == []
    assert ref.check_guarantees(new, LENGTHS) == []
