"""`batchplan reshard` of a mixture's plan: the rest of the run on another world size, still a
mixture's plan.

A parent of three sources (one repeated five times, one cut) on 4 ranks, two epochs, split
samples and a compute cost, resharded inside epoch 0 (where a source's passes cross the
step) and inside epoch 1, to 2, 3 and 8 ranks, from a plan file and from a plan directory:
- the new plan keeps the ``mixture`` metadata and the ``source`` column, and validate's
  checks pass: coverage, mixture_sources, mixture_shares, mixture_drift;
- from step S on, each step holds exactly the parent's micro-batches, so the same tokens,
  tokens per source and uses; the uses before S plus the new plan's repeat in order;
- what the new plan records of the run before S is the parent's (steps, tokens, samples,
  each source's uses); a resharded plan reshards again;
- a parent's sampler state at S resumes on it, and `MixtureDataset` and the records' loss
  tokens by source give each step's loss tokens per source as the parent's.

Sources, tokens and uses are counted here from each row's samples and the sources' offsets,
not from the ``source`` column.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _plan_views import WithMetadata
from typer.testing import CliRunner

from batchplan import ConfigError, PlanConfig
from batchplan.formats.bitmap import decode_bitmap
from batchplan.formats.opening import open_plan
from batchplan.operations.build_mixture import build_mixture_plan_file
from batchplan.operations.reshard import reshard_plan_file
from batchplan.operations.validate import validate_plan
from batchplan_cli.main import app

CONFIG = dict(max_tokens=256, world_size=4, micro_batches=2, epochs=2, seed=4, oversize="split", hidden_size=64)


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> dict:
    """The sources, their mixture file, and its plan as a file and as a directory."""
    directory = tmp_path_factory.mktemp("reshard_mixture")
    rng = np.random.default_rng(0)
    sources = []
    for index, (size, weight) in enumerate(zip([40, 300, 120], [0.5, 0.2, 0.3])):
        lengths = rng.integers(1, 300, size).astype(np.int32)  # some above max_tokens: split
        pq.write_table(pa.table({"length": lengths}), directory / f"s{index}.parquet")
        sources.append({"name": f"s{index}", "paths": [f"s{index}.parquet"], "weight": weight})
    (directory / "mix.json").write_text(json.dumps({"sources": sources, "tokens": 60_000}))
    config = PlanConfig(**CONFIG)
    build_mixture_plan_file(directory / "mix.json", directory / "parent.arrow", config)
    build_mixture_plan_file(directory / "mix.json", directory / "parent", config, layout="directory")
    return {"directory": directory, "file": directory / "mix.json", "parent": directory / "parent.arrow"}


@pytest.fixture(scope="module")
def reshard(mixture):
    """``reshard(world_size, where, parent=None)``: the parent resharded to ``world_size`` ranks
    at a step ``where`` (``"first"``: its first step; ``"epoch 0"``: the middle of epoch 0;
    ``"epoch 1"``: the second step of epoch 1), and that step; each made once."""
    made: dict[tuple, Path] = {}

    def _reshard(world_size: int, where: str, parent: Path | None = None) -> tuple[Path, int]:
        parent = parent or mixture["parent"]
        from_step = step_at(parent, where)
        key = (str(parent), world_size, from_step)
        if key not in made:
            made[key] = mixture["directory"] / f"child-{len(made)}.arrow"
            reshard_plan_file(parent, made[key], world_size=world_size, from_step=from_step)
        return made[key], from_step

    return _reshard


def step_at(path: Path, where: str) -> int:
    meta = open_plan(path).metadata
    first, per_epoch = meta.get("first_step", 0), meta["steps_per_epoch"]
    return first + {"first": 0, "epoch 0": per_epoch[0] // 2, "epoch 1": per_epoch[0] + 1}[where]


CASES = [(2, "epoch 0"), (3, "epoch 0"), (8, "epoch 0"), (3, "epoch 1")]


# --------------------------------------------------------------------------- reading plans back


def bounds_of(path: Path) -> np.ndarray:
    """The sources' first samples, and the end of the last, from the parent's metadata."""
    sources = open_plan(path).metadata["mixture"]["sources"]
    return np.array([s["offset"] for s in sources] + [sources[-1]["offset"] + sources[-1]["num_samples"]])


def rows_of(path: Path) -> list[dict]:
    plan = open_plan(path)
    return [row for epoch in range(plan.num_epochs) for row in plan.read_epoch(epoch).to_pylist()]


def source_of(samples: list[int], bounds: np.ndarray) -> int:
    """The one source of a micro-batch's samples (-1 when empty)."""
    owners = {int(np.searchsorted(bounds, sample, side="right") - 1) for sample in samples}
    assert len(owners) <= 1, "a micro-batch holds samples of two sources"
    return owners.pop() if owners else -1


def micro_batches_by_step(path: Path, bounds: np.ndarray, keep=lambda step: True) -> dict[int, Counter]:
    """Per step, the multiset of its non-empty micro-batches: (source, samples, starts, tokens, loss tokens)."""
    found: dict[int, Counter] = defaultdict(Counter)
    for row in rows_of(path):
        if row["samples"] and keep(row["step"]):
            found[row["step"]][
                (
                    source_of(row["samples"], bounds),
                    tuple(row["samples"]),
                    tuple(row["starts"]),
                    row["tokens"],
                    row["loss_tokens"],
                )
            ] += 1
    return found


def tokens_by_step_and_source(path: Path, bounds: np.ndarray, keep=lambda step: True) -> dict[tuple[int, int], int]:
    found: dict[tuple[int, int], int] = defaultdict(int)
    for row in rows_of(path):
        if row["samples"] and keep(row["step"]):
            found[row["step"], source_of(row["samples"], bounds)] += row["tokens"]
    return dict(found)


def uses(path: Path, keep=lambda step: True) -> list[tuple[int, int]]:
    """Every use as (step, sample): each entry that starts a sample (a split sample's first piece)."""
    return [
        (row["step"], sample)
        for row in rows_of(path)
        if keep(row["step"])
        for sample, start in zip(row["samples"], row["starts"])
        if start == 0
    ]


def assert_repetition_in_order(steps_and_samples: list[tuple[int, int]], meta: dict) -> None:
    """Within a source, kept samples are used k or k+1 times, and no (k+1)-th use comes in a
    step before the last k-th use."""
    never = set(meta["dropped"].get("empty", [])) | set(meta["dropped"].get("oversize", []))
    for source in meta["mixture"]["sources"]:
        lo, hi = source["offset"], source["offset"] + source["num_samples"]
        seen: Counter = Counter()
        last_use = defaultdict(int)  # k -> the last step of a k-th use
        first_use = {}  # k -> the first step of a k-th use
        for step, sample in sorted(u for u in steps_and_samples if lo <= u[1] < hi):
            k = seen[sample]
            seen[sample] += 1
            last_use[k] = max(last_use[k], step)
            first_use.setdefault(k, step)
        counts = [seen[s] for s in range(lo, hi) if s not in never]
        assert max(counts) - min(counts) <= 1, source["name"]
        for k in range(1, max(counts)):
            assert first_use[k] >= last_use[k - 1], (source["name"], k)


# --------------------------------------------------------------------------- what the file says


@pytest.mark.parametrize(("world_size", "where"), CASES)
def test_the_new_plan_keeps_the_mixture_metadata_and_the_source_column(mixture, reshard, world_size, where):
    child, _ = reshard(world_size, where)
    parent_meta, plan = open_plan(mixture["parent"]).metadata, open_plan(child)
    assert plan.metadata["mixture"] == parent_meta["mixture"]
    assert plan.metadata["lengths_fingerprint"] == parent_meta["lengths_fingerprint"]
    assert "source" in plan.schema.names
    bounds = bounds_of(mixture["parent"])
    rows = rows_of(child)
    assert [row["source"] for row in rows] == [source_of(row["samples"], bounds) for row in rows]
    assert any(row["source"] == -1 for row in rows) == any(not row["samples"] for row in rows)


@pytest.mark.parametrize(("world_size", "where"), [*CASES, (3, "first")])
def test_coverage_sources_shares_and_drift_pass_validate(mixture, reshard, world_size, where):
    child, _ = reshard(world_size, where)
    found = validate_plan(child, mixture=mixture["file"])
    # mixture_repetition: `test_uses_before_the_first_step_and_after_it_repeat_in_order`
    assert [str(v) for v in found if v.guarantee != "mixture_repetition"] == []


def test_a_mixture_resharded_at_its_first_step_passes_validate(mixture, reshard):
    child, _ = reshard(3, "first")
    assert validate_plan(child, mixture=mixture["file"]) == []


def test_a_mixture_resharded_mid_run_passes_validate(mixture, reshard):
    child, _ = reshard(3, "epoch 0")
    assert validate_plan(child, mixture=mixture["file"]) == []


def test_validate_counts_the_uses_before_the_first_step(mixture, reshard):
    """The same rows checked against a record that says the samples of s0 not yet used more
    were used once more before the first step: the plan's next uses of them come too early."""
    from batchplan.formats.bitmap import encode_bitmap
    from batchplan.operations.mixture_checks import check_mixture

    child, _ = reshard(3, "epoch 0")
    plan = open_plan(child)
    moved = json.loads(json.dumps(plan.metadata))
    record = moved["consumed"]["mixture"]
    more = decode_bitmap(record["uses_more"], plan.num_samples)
    s0 = plan.metadata["mixture"]["sources"][0]
    part = slice(s0["offset"], s0["offset"] + s0["num_samples"])
    more[part] = ~more[part]
    record["uses_more"] = encode_bitmap(more)

    assert check_mixture(plan) == []
    found = check_mixture(WithMetadata(plan, moved))
    assert found and found[0].guarantee == "mixture_repetition"


# --------------------------------------------------------------------------- the steps are the parent's


@pytest.mark.parametrize(("world_size", "where"), CASES)
def test_each_step_from_the_first_holds_the_parent_micro_batches(mixture, reshard, world_size, where):
    child, from_step = reshard(world_size, where)
    bounds = bounds_of(mixture["parent"])
    expected = micro_batches_by_step(mixture["parent"], bounds, keep=lambda step: step >= from_step)
    assert micro_batches_by_step(child, bounds) == expected
    rows = rows_of(child)
    for step, batches in expected.items():  # each rank runs ceil(n / world_size) of the step's n
        micro = {row["num_micro"] for row in rows if row["step"] == step}
        assert micro == {-(-sum(batches.values()) // world_size)}


@pytest.mark.parametrize(("world_size", "where"), CASES)
def test_each_step_holds_the_parent_tokens_per_source_and_token_counts(mixture, reshard, world_size, where):
    child, from_step = reshard(world_size, where)
    bounds = bounds_of(mixture["parent"])
    later = lambda step: step >= from_step  # noqa: E731
    assert tokens_by_step_and_source(child, bounds) == tokens_by_step_and_source(mixture["parent"], bounds, later)

    def per_step(path, keep):
        return {
            (row["step"], row["step_tokens"], row["step_loss_tokens"], row["tokens_before_step"])
            for row in rows_of(path)
            if keep(row["step"])
        }

    assert per_step(child, lambda step: True) == per_step(mixture["parent"], later)


@pytest.mark.parametrize(("world_size", "where"), CASES)
def test_uses_before_the_first_step_and_after_it_repeat_in_order(mixture, reshard, world_size, where):
    child, from_step = reshard(world_size, where)
    before = uses(mixture["parent"], keep=lambda step: step < from_step)
    after = uses(child)
    assert sorted(after) == sorted(uses(mixture["parent"], keep=lambda step: step >= from_step))
    assert_repetition_in_order(before + after, open_plan(mixture["parent"]).metadata)


# --------------------------------------------------------------------------- the run before S


@pytest.mark.parametrize(("world_size", "where"), CASES)
def test_the_prefix_is_the_parents(mixture, reshard, world_size, where):
    """The new plan starts at S with the parent's counts; the epochs before S's hold nothing;
    ``consumed`` lists every sample the parent used in S's epoch before S; the parent is untouched."""
    before_bytes = mixture["parent"].read_bytes()
    child, from_step = reshard(world_size, where)
    parent, plan = open_plan(mixture["parent"]), open_plan(child)
    meta = plan.metadata
    parent_rows = rows_of(mixture["parent"])
    at_step = [row for row in parent_rows if row["step"] == from_step]
    assert meta["first_step"] == from_step == min(row["step"] for row in rows_of(child))
    assert meta["tokens_before_first_step"] == at_step[0]["tokens_before_step"]
    epoch = at_step[0]["epoch"]
    assert meta["steps_per_epoch"][:epoch] == [0] * epoch
    first_of_epoch = sum(parent.metadata["steps_per_epoch"][:epoch])
    assert meta["steps_per_epoch"][epoch:] == [
        parent.metadata["steps_per_epoch"][epoch] - (from_step - first_of_epoch),
        *parent.metadata["steps_per_epoch"][epoch + 1 :],
    ]
    used = {s for row in parent_rows if row["epoch"] == epoch and row["step"] < from_step for s in row["samples"]}
    consumed = meta["consumed"]
    assert consumed["epoch"] == epoch and consumed["spans"] == []
    assert set(np.flatnonzero(decode_bitmap(consumed["samples"], plan.num_samples)).tolist()) == used
    assert mixture["parent"].read_bytes() == before_bytes


def assert_consumed_is_the_parents(path: Path, parent: Path) -> None:
    """``consumed["mixture"]`` of ``path`` is what ``parent`` (a built plan) ran before the first
    step of ``path``: the epoch's steps and tokens per source, and each sample's uses."""
    meta, bounds = open_plan(path).metadata, bounds_of(parent)
    from_step, epoch, record = meta["first_step"], meta["consumed"]["epoch"], meta["consumed"]["mixture"]
    first_of_epoch = sum(open_plan(parent).metadata["steps_per_epoch"][:epoch])
    assert record["steps"] == from_step - first_of_epoch
    tokens = tokens_by_step_and_source(parent, bounds, lambda step: first_of_epoch <= step < from_step)
    assert record["source_tokens"] == [sum(t for (_, s), t in tokens.items() if s == k) for k in range(3)]
    counts = np.bincount([s for _, s in uses(parent, keep=lambda step: step < from_step)], minlength=int(bounds[-1]))
    recorded = decode_bitmap(record["uses_more"], int(bounds[-1])).astype(np.int64)
    for index, base in enumerate(record["uses_base"]):
        recorded[bounds[index] : bounds[index + 1]] += base
    assert np.array_equal(recorded, counts)


@pytest.mark.parametrize(("world_size", "where"), CASES)
def test_consumed_records_steps_tokens_and_uses_before_the_first_step(mixture, reshard, world_size, where):
    """What a check of the rest needs: the epoch's steps and tokens per source before S, and
    each kept sample's uses in the whole run before S as a base per source and a bitmap."""
    child, _ = reshard(world_size, where)
    assert_consumed_is_the_parents(child, mixture["parent"])
    assert max(open_plan(child).metadata["consumed"]["mixture"]["uses_base"]) >= 1  # past a whole pass


@pytest.mark.parametrize("where", ["epoch 0", "epoch 1"])
def test_a_resharded_mixture_plan_reshards_again(mixture, reshard, where):
    """Again inside the epoch the first reshard resumed (its record adds to the parent's), or in the next."""
    child, _ = reshard(3, "epoch 0")
    grandchild, from_step = reshard(2, where, parent=child)
    assert open_plan(grandchild).metadata["consumed"]["epoch"] == int(where[-1])
    bounds = bounds_of(mixture["parent"])
    later = lambda step: step >= from_step  # noqa: E731
    assert micro_batches_by_step(grandchild, bounds) == micro_batches_by_step(mixture["parent"], bounds, later)
    assert_consumed_is_the_parents(grandchild, mixture["parent"])
    found = validate_plan(grandchild, mixture=mixture["file"])
    assert [str(v) for v in found if v.guarantee != "mixture_repetition"] == []


def test_a_plan_directory_reshards_to_the_rows_of_its_file(mixture, reshard):
    from_file, _ = reshard(3, "epoch 0")
    from_directory, _ = reshard(3, "epoch 0", parent=mixture["directory"] / "parent")
    assert "source" in open_plan(from_directory).schema.names
    assert open_plan(from_directory).metadata["mixture"] == open_plan(from_file).metadata["mixture"]
    assert rows_of(from_directory) == rows_of(from_file)


# --------------------------------------------------------------------------- what cannot be chosen


def test_a_step_size_is_refused_for_a_mixture_in_one_line(mixture, tmp_path):
    for size in ({"micro_batches": 4}, {"tokens_per_step": 4096}):
        with pytest.raises(ConfigError, match="keeps its steps"):
            reshard_plan_file(mixture["parent"], tmp_path / "x.arrow", world_size=2, from_step=3, **size)
    result = CliRunner().invoke(
        app,
        [
            "reshard",
            str(mixture["parent"]),
            "--world-size",
            "2",
            "--from-step",
            "3",
            "--micro-batches",
            "4",
            "-o",
            str(tmp_path / "x.arrow"),
        ],
    )
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and "leave --micro-batches and --tokens-per-step out" in result.stderr
    assert not (tmp_path / "x.arrow").exists()


# --------------------------------------------------------------------------- training on it


def states_after(path: Path, world_size: int, steps: int) -> list[dict]:
    """Each rank's sampler state after ``steps`` optimizer steps."""
    from batchplan.runtime import PlanSampler

    states = []
    for rank in range(world_size):
        sampler, done = PlanSampler(path, rank=rank, world_size=world_size), 0
        while done < steps:
            for rows in sampler:
                done += rows.record.is_last
                if done == steps:
                    break
        states.append(sampler.state_dict())
    return states


@pytest.mark.usefixtures("no_launcher_environment")
def test_records_and_mixture_dataset_give_the_parent_loss_tokens_per_source(mixture, reshard):
    """A parent's state at S loads on every new rank; each micro-batch's items come from the
    source its record names, and its loss tokens by source summed per step over the ranks are
    the parent's."""
    from batchplan.runtime import PlanSampler
    from batchplan.runtime.mixture import MixtureDataset, source_names

    child, from_step = reshard(3, "epoch 0")
    sources = open_plan(mixture["parent"]).metadata["mixture"]["sources"]
    datasets = {s["name"]: [{"source": k, "row": r} for r in range(s["num_samples"])] for k, s in enumerate(sources)}
    dataset = MixtureDataset(child, datasets)
    assert source_names(child) == ["s0", "s1", "s2"]
    state = states_after(mixture["parent"], 4, from_step)[1]
    loss = defaultdict(int)
    for rank in range(3):
        sampler = PlanSampler(child, rank=rank, world_size=3)
        sampler.load_state_dict(state)
        first = None
        while not sampler.finished:
            for rows in sampler:
                record = rows.record
                first = record.step if first is None else first
                assert {item["source"] for item in dataset.__getitems__(record.indices)} <= {record.source}
                for source, tokens in record.loss_tokens_by_source.items():
                    loss[record.step, source] += tokens
        assert first == from_step
    bounds = bounds_of(mixture["parent"])
    expected = defaultdict(int)
    for row in rows_of(mixture["parent"]):
        if row["samples"] and row["step"] >= from_step:
            expected[row["step"], source_of(row["samples"], bounds)] += row["loss_tokens"]
    assert dict(loss) == dict(expected)
