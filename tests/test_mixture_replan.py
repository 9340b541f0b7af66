"""`batchplan reshard PLAN --from-step S --mixture NEW`: the rest of a mixture's run re-planned
with another mixture (weights changed, a source added, one left out, a phase after S).

Checked here from the rows and the mixtures as the test wrote them: the new plan starts at S
where the parent stops (steps and tokens run on), a kept source keeps its samples' indices,
an added one comes after the parent's samples, a left-out one is not used again; across the
change no sample is used a (k+1)-th time before the rest of its source was used k times
(the parent's uses before S counted); every step from S on holds the new weights (per
phase); validate agrees; the same re-plan is byte-identical; a parent's sampler state at S
resumes on the new plan, on two real gloo processes too.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _ddp_plans import free_port
from _ddp_reshard_worker import resume_on, train_until
from _spawn import launch
from test_mixture_phases import assert_phases_hold, per_step_tokens
from typer.testing import CliRunner

from batchplan import ConfigError, DatasetError, PlanConfig
from batchplan.formats.opening import open_plan
from batchplan.mixture import Mixture
from batchplan.operations.build_mixture import build_mixture_plan_file
from batchplan.operations.replan_mixture import replan_mixture_file
from batchplan.operations.validate import validate_plan
from batchplan.runtime import PlanSampler
from batchplan_cli.main import app

CONFIG = dict(max_tokens=128, world_size=2, micro_batches=2, epochs=2, seed=7, oversize="split")
SIZES = {"a": 60, "b": 200, "c": 400, "d": 150}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """Sources a..d (d not in the parent), the parent's mixture (a, b, c) and its plan, and
    the new mixture: b left out, d added, weights changed, a phase after the re-plan."""
    directory = tmp_path_factory.mktemp("replan")
    rng = np.random.default_rng(1)
    lengths = {}
    for name, size in SIZES.items():
        lengths[name] = rng.integers(1, 160, size).astype(np.int32)
        pq.write_table(pa.table({"length": lengths[name]}), directory / f"{name}.parquet")
    old = {
        "sources": [{"name": n, "paths": [f"{n}.parquet"], "weight": w} for n, w in zip("abc", (0.2, 0.3, 0.5))],
        "tokens": 60_000,
    }
    (directory / "old.json").write_text(json.dumps(old))
    parent = directory / "parent.arrow"
    build_mixture_plan_file(directory / "old.json", parent, PlanConfig(**CONFIG))
    from_step = open_plan(parent).num_steps * 3 // 5  # inside epoch 1
    new = {
        "sources": [
            {"name": "c", "paths": ["c.parquet"], "weight": 0.3},
            {"name": "a", "paths": ["a.parquet"], "weight": 0.3},
            {"name": "d", "paths": ["d.parquet"], "weight": 0.4},
        ],
        "tokens": 80_000,
        "phases": [{"from_tokens": 70_000, "weights": {"a": 0.6, "c": 0.0, "d": 0.4}}],
    }
    (directory / "new.json").write_text(json.dumps(new))
    child = directory / "child.arrow"
    replan_mixture_file(parent, child, directory / "new.json", from_step=from_step)
    return {
        "directory": directory,
        "parent": parent,
        "child": child,
        "from_step": from_step,
        "lengths": lengths,
        "new": Mixture.from_dict(new),
    }


def uses_of(path: Path, keep=lambda step: True) -> list[tuple[int, int]]:
    """(step, sample) of every use (a split sample once, by its piece at token 0)."""
    plan = open_plan(path)
    found = []
    for epoch in range(plan.num_epochs):
        for rank in range(plan.world_size):
            for row in plan.read_rank(epoch, rank).to_pylist():
                starts = row.get("starts") or [0] * len(row["samples"])
                found += [
                    (row["step"], s) for s, start in zip(row["samples"], starts) if start == 0 and keep(row["step"])
                ]
    return found


def test_the_new_plan_starts_where_the_parent_stops(run):
    parent, child = open_plan(run["parent"]), open_plan(run["child"])
    meta = child.metadata
    assert meta["first_step"] == run["from_step"]
    at = [row for row in parent.read_rank(1, 0).to_pylist() if row["step"] == run["from_step"]][0]
    assert meta["tokens_before_first_step"] == at["tokens_before_step"]
    first = child.read_rank(1, 0).to_pylist()[0]
    assert (first["step"], first["tokens_before_step"]) == (run["from_step"], at["tokens_before_step"])
    assert meta["steps_per_epoch"][0] == 0 and child.read_rank(0, 0).num_rows == 0  # epoch 0: trained on the parent
    assert meta["mixture"]["replanned"]["from_step"] == run["from_step"]


def test_sources_keep_their_indices_and_the_added_one_comes_after_the_parents(run):
    parent, child = open_plan(run["parent"]), open_plan(run["child"])
    old = {s["name"]: s for s in parent.metadata["mixture"]["sources"]}
    new = child.metadata["mixture"]["sources"]
    assert [s["name"] for s in new] == ["a", "b", "c", "d"]
    for source in new[:3]:
        assert (source["offset"], source["num_samples"]) == (old[source["name"]]["offset"], SIZES[source["name"]])
    assert new[3]["offset"] == parent.num_samples and child.num_samples == parent.num_samples + SIZES["d"]
    bounds = np.array([s["offset"] for s in new] + [child.num_samples])
    used = np.array([sample for _, sample in uses_of(run["child"])])
    per_source = np.bincount(np.searchsorted(bounds, used, side="right") - 1, minlength=4)
    assert per_source[1] == 0 and per_source[[0, 2, 3]].min() > 0  # b left out; a, c, d used


def test_a_rows_lengths_are_its_sources_own(run):
    """Each entry's length (whole samples) is the length of its source's row."""
    child = open_plan(run["child"])
    sources = child.metadata["mixture"]["sources"]
    bounds = np.array([s["offset"] for s in sources] + [child.num_samples])
    for epoch in range(child.num_epochs):
        for row in child.read_rank(epoch, 0).to_pylist():
            if row["samples"] and not row.get("starts"):
                source = sources[int(np.searchsorted(bounds, row["samples"][0], side="right") - 1)]
                own = run["lengths"][source["name"]][np.array(row["samples"]) - source["offset"]]
                assert row["tokens"] == int(own.sum())


def test_repetition_order_holds_across_the_change(run):
    """Per kept source, the parent's uses before S and the new plan's: counts differ by at most
    one, and no (k+1)-th use comes in a step before the last k-th."""
    meta = open_plan(run["child"]).metadata["mixture"]
    uses = uses_of(run["parent"], keep=lambda step: step < run["from_step"]) + uses_of(run["child"])
    for source in meta["sources"]:
        lo, hi = source["offset"], source["offset"] + source["num_samples"]
        mine = sorted((step, sample) for step, sample in uses if lo <= sample < hi)
        if not mine:
            continue
        seen: dict[int, int] = defaultdict(int)
        last_of, first_of = defaultdict(int), {}
        for step, sample in mine:
            k = seen[sample]
            seen[sample] += 1
            last_of[k] = max(last_of[k], step)
            first_of.setdefault(k, step)
        counts = [seen[s] for s in range(lo, hi)]
        assert max(counts) - min(counts) <= 1, source["name"]
        for k in first_of:
            if k > 0:
                assert first_of[k] >= last_of[k - 1], (source["name"], k)


def test_every_step_from_the_change_holds_the_new_weights(run):
    """Shares per phase of the new mixture, recounted (the run's tokens: the parent's before S)."""
    child = open_plan(run["child"])
    per_step, epoch_of_step = per_step_tokens(run["child"], 4)
    names = [s["name"] for s in child.metadata["mixture"]["sources"]]
    spec = run["new"].to_dict()
    spec["sources"] = [
        next((s for s in spec["sources"] if s["name"] == n), {"name": n, "paths": ["-"], "weight": 0}) for n in names
    ]
    for phase in spec["phases"]:
        phase["weights"] = {n: phase["weights"].get(n, 0) for n in names}
    assert_phases_hold(
        per_step,
        epoch_of_step,
        Mixture.from_dict(spec),
        max_tokens=128,
        tokens_before=child.metadata["tokens_before_first_step"],
    )


def test_validate_passes_with_the_new_mixture_and_refuses_the_old(run):
    assert validate_plan(run["child"], mixture=run["directory"] / "new.json") == []
    found = validate_plan(run["child"], mixture=run["directory"] / "old.json")
    assert found and found[0].guarantee == "dataset" and "'d'" in found[0].message


def test_the_same_replan_is_byte_identical(run, tmp_path):
    again = tmp_path / "again.arrow"
    replan_mixture_file(run["parent"], again, run["directory"] / "new.json", from_step=run["from_step"])
    assert again.read_bytes() == run["child"].read_bytes()


def test_a_parent_state_at_the_change_resumes_on_the_new_plan(run):
    """Rank 0 of the parent runs to S and saves; a sampler of the new plan loads that state and
    yields the new plan's rows from S on."""
    parent, state = PlanSampler(run["parent"], rank=0, world_size=2), None
    while state is None and not parent.finished:
        for rows in parent:
            if rows.record.step == run["from_step"] - 1 and rows.record.is_last:
                state = parent.state_dict(after=rows.record)
                break
    child = PlanSampler(run["child"], rank=0, world_size=2)
    child.load_state_dict(state)
    first = next(iter(child)).record
    row = open_plan(run["child"]).read_rank(1, 0).to_pylist()[0]
    assert (first.step, list(first.indices)) == (run["from_step"], row["samples"])


def test_the_token_lr_schedule_runs_on_across_the_change(run):
    """At every step of the new plan the factor is an unchanged run's at the same tokens: the
    old plan's steps before S count, and the decay ends with the new run's last token."""
    from batchplan.runtime import read_step_tokens
    from batchplan.runtime.lr_schedule import token_lr_factor, token_lr_lambda

    before, tokens = read_step_tokens(run["child"])
    assert before[0] == open_plan(run["child"]).metadata["tokens_before_first_step"] > 0
    total = int(before[-1] + tokens[-1])
    options = {"warmup_tokens": total // 10, "decay": "cosine", "min_lr_ratio": 0.1}
    schedule = token_lr_lambda(run["child"], **options)
    for index in range(before.shape[0]):
        expected = token_lr_factor(int(before[index] + tokens[index]), total_tokens=total, **options)
        assert schedule(run["from_step"] + index) == pytest.approx(expected)


def test_a_kept_source_with_other_rows_is_refused(run, tmp_path):
    changed = run["lengths"]["a"].copy()
    changed[0] += 1
    pq.write_table(pa.table({"length": changed}), tmp_path / "a.parquet")
    spec = json.loads((run["directory"] / "new.json").read_text())
    for source in spec["sources"]:
        source["paths"] = [
            str(tmp_path / "a.parquet") if source["name"] == "a" else str(run["directory"] / source["paths"][0])
        ]
    (tmp_path / "changed.json").write_text(json.dumps(spec))
    with pytest.raises(DatasetError, match="give the changed data a new name"):
        replan_mixture_file(run["parent"], tmp_path / "x.arrow", tmp_path / "changed.json", from_step=run["from_step"])
    assert not (tmp_path / "x.arrow").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda spec: spec.update(tokens=1000) or spec.pop("phases"), "do not reach past"),
        (
            lambda spec: (
                [s.update(epochs=1.0) or s.pop("weight") for s in spec["sources"]]
                and spec.pop("tokens")
                and spec.pop("phases")
            ),
            "sized by epochs",
        ),
    ],
)
def test_bad_replans_are_one_clear_error(run, tmp_path, change, message):
    spec = json.loads((run["directory"] / "new.json").read_text())
    for source in spec["sources"]:
        source["paths"] = [str(run["directory"] / source["paths"][0])]
    change(spec)
    (tmp_path / "bad.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match=message):
        replan_mixture_file(run["parent"], tmp_path / "x.arrow", tmp_path / "bad.json", from_step=run["from_step"])


def test_a_single_dataset_plan_is_refused(tmp_path, run):
    from batchplan.operations.build import build_plan_file

    build_plan_file(run["directory"] / "a.parquet", tmp_path / "one.arrow", PlanConfig(max_tokens=512))
    with pytest.raises(ConfigError, match="not a mixture"):
        replan_mixture_file(tmp_path / "one.arrow", tmp_path / "x.arrow", run["directory"] / "new.json", from_step=1)


def test_the_cli_replans_and_asks_for_what_to_change(run, tmp_path):
    runner = CliRunner()
    out = tmp_path / "cli.arrow"
    result = runner.invoke(
        app,
        [
            "reshard",
            str(run["parent"]),
            "--from-step",
            str(run["from_step"]),
            "--mixture",
            str(run["directory"] / "new.json"),
            "--world-size",
            "3",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "phases" in result.stdout and f"steps {run['from_step']:,}.. on 3 ranks (was 2)" in result.stdout
    assert validate_plan(out, mixture=run["directory"] / "new.json") == []
    result = runner.invoke(app, ["reshard", str(run["parent"]), "--from-step", "3", "-o", str(tmp_path / "y.arrow")])
    assert result.exit_code == 1 and "give --world-size" in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.slow
def test_ddp_processes_train_to_the_change_and_resume_on_the_new_plan(run, tmp_path):
    """Two gloo ranks train the parent to S and save; the plan is re-planned; two ranks load
    the states and train the new plan: each rank runs exactly its rows of the new plan, and
    the parent's rows before S."""
    parent_lengths = np.concatenate([run["lengths"][n] for n in "abc"])
    all_lengths = np.concatenate([parent_lengths, run["lengths"]["d"]])
    launch(train_until, (2, free_port(), str(run["parent"]), parent_lengths, run["from_step"], str(tmp_path)))
    old = [torch.load(tmp_path / f"old{rank}.pt", weights_only=False) for rank in range(2)]
    torch.save([result["state"] for result in old], tmp_path / "states.pt")
    launch(resume_on, (2, free_port(), str(run["child"]), all_lengths, str(tmp_path / "states.pt"), str(tmp_path)))
    new = [torch.load(tmp_path / f"new{rank}.pt", weights_only=False) for rank in range(2)]
    for plan_path, results, keep in (
        (run["parent"], old, lambda step: step < run["from_step"]),
        (run["child"], new, lambda step: True),
    ):
        plan = open_plan(plan_path)
        for rank, result in enumerate(results):
            expected = [
                (epoch, row["step"], row["micro"], tuple(row["samples"]))
                for epoch in range(plan.num_epochs)
                for row in plan.read_rank(epoch, rank).to_pylist()
                if keep(row["step"])
            ]
            assert [entry[:4] for entry in result["seen"]] == expected
