"""``drop_last`` with a mixture: an epoch's incomplete last step is dropped instead of
completed, as for one dataset; what it drops is listed (a sample once per dropped use), counts
as used for repetition order and as planned for each source's tokens, and every other
guarantee holds. Counted again from the rows (`_mixture_recount`), then by validate."""

from __future__ import annotations

import dataclasses
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
    recount,
)
from _plan_views import WithMetadata
from typer.testing import CliRunner

from batchplan import PlanConfig
from batchplan.errors import ConfigError, DatasetError
from batchplan.formats.mixture_file import read_mixture, read_mixture_lengths
from batchplan.formats.opening import open_plan
from batchplan.mixture import Mixture, MixturePhase, MixtureSource
from batchplan.operations.build_mixture import build_mixture_plan_file
from batchplan.operations.mixture_checks import check_mixture
from batchplan.operations.replan_mixture import replan_mixture_file
from batchplan.operations.reshard import reshard_plan_file
from batchplan.operations.validate import validate_plan
from batchplan_cli.main import app

DATA = Path(__file__).resolve().parent.parent / "data"
DEMO = DATA / "mixture.yaml"
runner = CliRunner()


def demo_lengths() -> np.ndarray:
    return read_mixture_lengths(read_mixture(DEMO)).lengths


def weights_due(counted) -> np.ndarray:
    weights = np.array([source["weight"] for source in counted.meta["mixture"]["sources"]])
    return counted.per_step.sum(axis=1)[:, None] * weights[None, :]


@pytest.fixture(scope="module")
def lengths() -> np.ndarray:
    return demo_lengths()


@pytest.fixture(scope="module")
def fixed(tmp_path_factory) -> Path:
    """The demo mixture in two epochs of 8 ranks x 4 micro-batches, ``drop_last``."""
    path = tmp_path_factory.mktemp("drop") / "fixed.arrow"
    config = PlanConfig(max_tokens=8192, world_size=8, micro_batches=4, oversize="split", epochs=2, drop_last=True)
    build_mixture_plan_file(DEMO, path, config)
    return path


def test_drop_last_keeps_only_whole_steps_of_micro_batches(fixed, lengths):
    counted = recount(fixed, lengths)
    assert (counted.rows_per_step == 4).all() and counted.empty_rows == 0
    assert counted.dropped_tokens.sum() > 0
    dropped = open_plan(fixed).metadata["dropped"]["drop_last"]
    assert sorted(dropped) == ["0", "1"]


def test_drop_last_drops_less_than_a_step_of_each_epoch(fixed, lengths):
    """What each epoch drops is its incomplete last step: fewer micro-batches than a step's."""
    plan = open_plan(fixed)
    for epoch, pieces in plan.metadata["dropped"]["drop_last_spans"].items():
        assert 0 < sum(length for _, _, length in pieces) < 8 * 4 * 8192, epoch


def test_a_mixture_plan_with_drop_last_passes_validate(fixed):
    assert validate_plan(fixed, mixture=DEMO) == []


def test_drop_last_holds_shares_and_repetition_counting_the_dropped_uses(fixed, lengths):
    counted = recount(fixed, lengths)
    assert_shares_hold(counted, weights_due(counted))
    assert_repetition_in_order(counted)
    assert_planned_tokens_add_up(counted)


def test_dropped_pieces_and_planned_pieces_tile_every_use(fixed, lengths):
    counted = recount(fixed, lengths)
    uses = np.bincount(counted.use_sample, minlength=lengths.shape[0])
    assert (counted.covered == uses * lengths.astype(np.int64)).all()


def test_validate_needs_the_dropped_uses(fixed):
    """Without the list of what drop_last drops, the uses do not add up: validate fails."""
    plan = open_plan(fixed)
    meta = json.loads(json.dumps(plan.metadata))
    del meta["dropped"]["drop_last"], meta["dropped"]["drop_last_spans"]
    found = check_mixture(WithMetadata(plan, meta))
    assert {violation.guarantee for violation in found} & {"mixture_repetition", "mixture_planned"}


def test_validate_finds_planned_tokens_that_do_not_add_up(fixed, lengths):
    plan = open_plan(fixed)
    meta = json.loads(json.dumps(plan.metadata))
    meta["mixture"]["sources"][1]["planned_tokens"] += 1
    found = check_mixture(WithMetadata(plan, meta), lengths)
    assert [violation.guarantee for violation in found] == ["mixture_planned"]


def test_inspect_shows_what_drop_last_drops_of_each_source(fixed, lengths):
    counted = recount(fixed, lengths)
    result = runner.invoke(app, ["inspect", str(fixed), "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["mixture"]
    assert [row["dropped_tokens"] for row in rows] == counted.dropped_tokens.tolist()
    for row in rows:
        assert row["tokens"] + row["dropped_tokens"] == row["planned_tokens"]
    table = runner.invoke(app, ["inspect", str(fixed)], env={"COLUMNS": "200"})
    assert "dropped" in table.stdout


@pytest.mark.parametrize(
    "options",
    [
        {"tokens_per_step": 300_000},
        {"micro_batches": 2, "rampup_start": 8 * 8192, "rampup_tokens": 30_000_000, "epochs": 2},
        {"tokens_per_step": 300_000, "rampup_start": 8 * 8192, "rampup_tokens": 30_000_000, "epochs": 3},
        {"micro_batches": 3, "mode": "pad"},
    ],
)
def test_drop_last_with_token_targets_ramps_and_padding(tmp_path, lengths, options):
    """Steps sized by tokens or ramped: every kept step is whole rounds (no micro-batch added
    to complete one), and every guarantee holds."""
    path = tmp_path / "plan.arrow"
    config = PlanConfig(**{"max_tokens": 8192, "world_size": 8, "oversize": "split", "drop_last": True, **options})
    build_mixture_plan_file(DEMO, path, config)
    assert validate_plan(path, mixture=DEMO) == []
    counted = recount(path, lengths)
    assert counted.empty_rows == 0
    assert_repetition_in_order(counted)
    assert_planned_tokens_add_up(counted)


def write_sources(directory: Path, sources: dict[str, np.ndarray]) -> dict[str, str]:
    paths = {}
    for name, values in sources.items():
        pq.write_table(pa.table({"length": values.astype(np.int32)}), directory / f"{name}.parquet")
        paths[name] = str(directory / f"{name}.parquet")
    return paths


def test_a_sample_whose_two_uses_are_dropped_is_listed_twice(tmp_path):
    """A source of three short samples, repeated hundreds of times: each of its micro-batches
    is one pass, so the dropped step drops several uses of each sample."""
    rng = np.random.default_rng(0)
    paths = write_sources(tmp_path, {"tiny": np.array([50, 60, 70]), "big": rng.integers(100, 1000, 3000)})
    sources = (
        MixtureSource(name="tiny", paths=(paths["tiny"],), weight=0.2),
        MixtureSource(name="big", paths=(paths["big"],), weight=0.8),
    )
    mixture = Mixture(sources=sources, tokens=600_000)
    path = tmp_path / "plan.arrow"
    build_mixture_plan_file(mixture, path, PlanConfig(max_tokens=1024, world_size=4, micro_batches=7, drop_last=True))
    (tmp_path / "mix.json").write_text(json.dumps(mixture.to_dict()))
    assert validate_plan(path, mixture=tmp_path / "mix.json") == []
    dropped = open_plan(path).metadata["dropped"]["drop_last"]["0"]
    tiny = [sample for sample in dropped if sample < 3]
    assert max(np.bincount(tiny, minlength=3)) >= 2
    lengths = np.concatenate([[50, 60, 70], pq.read_table(paths["big"])["length"].to_numpy()])
    counted = recount(path, lengths)
    assert_repetition_in_order(counted)
    assert_planned_tokens_add_up(counted)


def test_drop_last_that_would_drop_every_micro_batch_is_one_error(tmp_path):
    paths = write_sources(tmp_path, {"a": np.full(20, 100), "b": np.full(20, 100)})
    mixture = Mixture(
        sources=(
            MixtureSource(name="a", paths=(paths["a"],), weight=1),
            MixtureSource(name="b", paths=(paths["b"],), weight=1),
        ),
        tokens=3000,
    )
    config = PlanConfig(max_tokens=1024, world_size=8, micro_batches=4, drop_last=True)
    with pytest.raises(DatasetError, match="would drop all") as error:
        build_mixture_plan_file(mixture, tmp_path / "plan.arrow", config)
    assert "\n" not in str(error.value) and not (tmp_path / "plan.arrow").exists()


def phased(tmp_path: Path) -> tuple[Mixture, Path, np.ndarray]:
    rng = np.random.default_rng(3)
    values = {name: np.clip(rng.lognormal(5, 0.8, 4000), 1, 1024).astype(np.int32) for name in ("a", "b", "c")}
    paths = write_sources(tmp_path, values)
    tokens = int(sum(int(v.sum()) for v in values.values()) * 0.8)
    mixture = Mixture(
        sources=tuple(MixtureSource(name=n, paths=(paths[n],), weight=w) for n, w in zip("abc", (0.5, 0.3, 0.2))),
        tokens=tokens,
        phases=(MixturePhase(from_tokens=int(tokens * 0.55), weights={"a": 0.1, "b": 0.1, "c": 0.8}),),
    )
    (tmp_path / "mix.json").write_text(json.dumps(mixture.to_dict()))
    return mixture, tmp_path / "mix.json", np.concatenate(list(values.values()))


def test_drop_last_with_phases_switches_at_the_step(tmp_path):
    """In one epoch, the switch is at the first step whose tokens before it reach the phase
    (recounted here) and every step but the last holds what it is due."""
    mixture, file, lengths = phased(tmp_path)
    path = tmp_path / "plan.arrow"
    build_mixture_plan_file(mixture, path, PlanConfig(max_tokens=1024, world_size=4, micro_batches=3, drop_last=True))
    assert validate_plan(path, mixture=file) == []
    counted = recount(path, lengths)
    assert counted.dropped_tokens.sum() > 0
    starts, weights = mixture.phase_weights()
    before, totals = counted.tokens_before(), counted.per_step.sum(axis=1)
    due = np.zeros_like(counted.per_step, dtype=np.float64)
    for start, end, row in zip(starts, [*starts[1:], np.inf], weights):
        inside = np.clip(np.minimum(before + totals, end) - np.maximum(before, start), 0, None)
        due += inside[:, None] * np.array(row)[None, :]
    assert_shares_hold(counted, due)
    assert_repetition_in_order(counted)


def test_drop_last_with_phases_over_several_epochs_is_one_error(tmp_path):
    """What an epoch drops would move where a later epoch's phase begins, away from the
    part of each source that epoch holds: refused, with the fix."""
    mixture, _, _ = phased(tmp_path)
    config = PlanConfig(max_tokens=1024, world_size=4, micro_batches=3, epochs=2, drop_last=True)
    with pytest.raises(ConfigError, match="drop_last with phases takes one epoch") as error:
        build_mixture_plan_file(mixture, tmp_path / "plan.arrow", config)
    assert "\n" not in str(error.value) and "`epochs` 1" in str(error.value)


def test_epoch_ranges_built_apart_are_the_plan_of_one_build(tmp_path):
    """Under drop_last with a ramp-up, a build of epochs 2..3 plans 0..1 first (not written):
    its epoch files are those of the build of every epoch."""
    mixture, _, _ = phased(tmp_path)
    mixture = dataclasses.replace(mixture, phases=())
    config = PlanConfig(
        max_tokens=1024,
        world_size=4,
        micro_batches=3,
        epochs=4,
        drop_last=True,
        rampup_start=4 * 1024,
        rampup_tokens=int(mixture.tokens * 0.6),
    )
    build_mixture_plan_file(mixture, tmp_path / "whole", config, layout="directory")
    build_mixture_plan_file(mixture, tmp_path / "parts", config, only_epochs=range(2, 4))
    for epoch in (2, 3):
        [whole] = (tmp_path / "whole").glob(f"epoch-{epoch:05d}.*.arrow")
        [part] = (tmp_path / "parts").glob(f"epoch-{epoch:05d}.*.arrow")
        assert whole.read_bytes() == part.read_bytes()
    assert validate_plan(tmp_path / "whole") == []


def test_rebuild_with_drop_last_is_byte_identical(tmp_path):
    config = PlanConfig(max_tokens=8192, world_size=4, micro_batches=3, oversize="split", drop_last=True, epochs=2)
    build_mixture_plan_file(DEMO, tmp_path / "a.arrow", config)
    build_mixture_plan_file(DEMO, tmp_path / "b.arrow", config)
    assert (tmp_path / "a.arrow").read_bytes() == (tmp_path / "b.arrow").read_bytes()


@pytest.mark.parametrize("from_step", [5, 200, 330])
def test_reshard_and_replan_of_a_drop_last_plan_pass_validate(tmp_path, fixed, from_step):
    """A resharded plan keeps what its parent dropped; a re-planned one counts the uses its
    parent's earlier epochs dropped as used (re-planned with other weights; with phases from
    the parent's last epoch, as drop_last with phases takes one epoch)."""
    reshard_plan_file(fixed, tmp_path / "resharded.arrow", world_size=3, from_step=from_step)
    assert validate_plan(tmp_path / "resharded.arrow", mixture=DEMO) == []
    other = tmp_path / "other.yaml"
    other.write_text(DEMO.read_text().replace("weight: 0.3", "weight: 0.6").replace("paths: [", f"paths: [{DATA}/"))
    replan_mixture_file(fixed, tmp_path / "replanned.arrow", other, from_step=from_step)
    assert validate_plan(tmp_path / "replanned.arrow", mixture=other) == []
    if from_step > open_plan(fixed).metadata["steps_per_epoch"][0]:
        replan_mixture_file(fixed, tmp_path / "annealed.arrow", DATA / "mixture-anneal.yaml", from_step=from_step)
        assert validate_plan(tmp_path / "annealed.arrow", mixture=DATA / "mixture-anneal.yaml") == []


def test_cli_builds_and_validates_a_mixture_with_drop_last(tmp_path):
    out = tmp_path / "plan.arrow"
    result = runner.invoke(
        app,
        [
            "build",
            "--mixture",
            str(DEMO),
            "-o",
            str(out),
            "--max-tokens",
            "8192",
            "--world-size",
            "8",
            "--micro-batches",
            "2",
            "--oversize",
            "split",
            "--drop-last",
            "-q",
        ],
    )
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["validate", str(out), "--mixture", str(DEMO)])
    assert result.exit_code == 0 and "OK" in result.stdout, result.output
