"""Training on a mixture's plan: MixtureDataset maps global indices to (source, row), records
say their source, and two gloo processes replay the plan exactly, resume included."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _mixture_worker import code_of, replay
from _spawn import run_ranks

from batchplan import PlanConfig
from batchplan.errors import PlanMismatchError
from batchplan.formats.opening import open_plan
from batchplan.operations.build_mixture import build_mixture_plan_file
from batchplan.runtime import PlanSampler
from batchplan.runtime.mixture import MixtureDataset, source_names

pytestmark = pytest.mark.usefixtures("no_launcher_environment")


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> dict:
    """Three sources (one repeated, one cut), their plan for 2 ranks, and their lengths."""
    directory = tmp_path_factory.mktemp("mixture")
    rng = np.random.default_rng(0)
    sizes, weights = [40, 300, 120], [0.5, 0.2, 0.3]
    sources = []
    for index, (size, weight) in enumerate(zip(sizes, weights)):
        lengths = rng.integers(1, 60, size).astype(np.int32)
        pq.write_table(pa.table({"length": lengths}), directory / f"s{index}.parquet")
        np.save(directory / f"s{index}.npy", lengths)
        sources.append(
            {
                "name": f"s{index}",
                "paths": [f"s{index}.parquet"],
                "weight": weight,
                "lengths": str(directory / f"s{index}.npy"),
            }
        )
    spec = {"sources": [{k: v for k, v in s.items() if k != "lengths"} for s in sources], "tokens": 12_000}
    (directory / "mix.json").write_text(json.dumps(spec))
    (directory / "sources.json").write_text(json.dumps({"sources": sources}))
    plan = directory / "plan.arrow"
    config = PlanConfig(max_tokens=128, world_size=2, micro_batches=2, epochs=2, seed=4)
    build_mixture_plan_file(directory / "mix.json", plan, config)
    return {"plan": plan, "sources": directory / "sources.json", "directory": directory}


def datasets_of(mixture) -> dict[str, list[dict]]:
    from _mixture_worker import source_datasets

    return source_datasets(json.loads(Path(mixture["sources"]).read_text()))


def test_global_indices_map_to_their_source_and_row(mixture):
    dataset = MixtureDataset(mixture["plan"], datasets_of(mixture))
    sources = open_plan(mixture["plan"]).metadata["mixture"]["sources"]
    for index, source in enumerate(sources):
        first, last = source["offset"], source["offset"] + source["num_samples"] - 1
        assert dataset.locate(first) == (index, 0) and dataset.locate(last) == (index, source["num_samples"] - 1)
        assert dataset[last]["input_ids"][0] == code_of(index, source["num_samples"] - 1)
    assert len(dataset) == open_plan(mixture["plan"]).num_samples
    with pytest.raises(IndexError):
        dataset.locate(len(dataset))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("s1"), "source 's1' has no dataset"),
        (lambda d: d["s2"].pop(), "source 's2' was planned for 120 rows but its dataset has 119"),
        (lambda d: d.update(extra=[]), "the plan has no source named 'extra'"),
    ],
)
def test_a_dataset_that_does_not_fit_its_source_is_refused(mixture, change, message):
    datasets = datasets_of(mixture)
    change(datasets)
    with pytest.raises(PlanMismatchError, match=message):
        MixtureDataset(mixture["plan"], datasets)


def test_reading_a_sample_of_a_source_left_without_a_dataset_names_it(tmp_path):
    """A source of weight 0 may be given no dataset; reading one of its samples anyway (one by one
    or in a batch) is an error that names the source."""
    sources = []
    for name, weight in (("a", 1.0), ("b", 0.0)):
        pq.write_table(pa.table({"length": np.full(20, 10, dtype=np.int32)}), tmp_path / f"{name}.parquet")
        sources.append({"name": name, "paths": [f"{name}.parquet"], "weight": weight})
    spec = {"sources": sources, "tokens": 100}
    (tmp_path / "mix.json").write_text(json.dumps(spec))
    build_mixture_plan_file(tmp_path / "mix.json", tmp_path / "plan.arrow", PlanConfig(max_tokens=64))
    dataset = MixtureDataset(tmp_path / "plan.arrow", {"a": list(range(20))})
    assert dataset[19] == 19 and dataset.__getitems__([0, 1]) == [0, 1]
    for read in (lambda: dataset[20], lambda: dataset.__getitems__([20, 21]), lambda: dataset.__getitems__([0, 20])):
        with pytest.raises(PlanMismatchError, match="sample 20 is in source 'b', which has no dataset"):
            read()


def test_records_say_their_source_and_hold_only_its_samples(mixture):
    dataset = MixtureDataset(mixture["plan"], datasets_of(mixture))
    names = source_names(mixture["plan"])
    loss = dict.fromkeys(names, 0)
    for rank in range(2):
        sampler = PlanSampler(mixture["plan"], rank=rank, world_size=2)
        while not sampler.finished:
            for rows in sampler:
                record = rows.record
                assert {dataset.locate(i)[0] for i in record.indices} <= {record.source}
                if record.indices:
                    loss[names[record.source]] += record.loss_tokens
                else:
                    assert record.source == -1
    assert sum(loss.values()) == sum(
        batch.column("loss_tokens").to_numpy().sum()
        for plan in [open_plan(mixture["plan"])]
        for e in range(plan.num_epochs)
        for r in range(2)
        for batch in [plan.read_rank(e, r)]
    )


@pytest.mark.slow
def test_two_gloo_processes_replay_the_mixture_exactly_with_resume(mixture, tmp_path):
    """Each rank's micro-batches, through MixtureDataset and PackCollator, are the plan's rows in
    order, and every token carries the (source, row) its global index names; a state saved
    after 5 micro-batches resumes on a fresh sampler with exactly the rest."""
    seen = run_ranks(replay, (str(mixture["plan"]), str(mixture["sources"]), 5), tmp_path)
    plan = open_plan(mixture["plan"])
    dataset = MixtureDataset(mixture["plan"], datasets_of(mixture))
    for rank, rows in enumerate(seen):
        expected = [row for e in range(plan.num_epochs) for row in plan.read_rank(e, rank).to_pylist()]
        assert [(r["epoch"], r["step"], r["micro"]) for r in rows] == [
            (r["epoch"], r["step"], r["micro"]) for r in expected
        ]
        for got, want in zip(rows, expected):
            located = [list(dataset.locate(i)) for i in want["samples"]]
            assert got["located"] == located and got["source"] == want["source"]
            assert got["codes"] == [code_of(source, row) for source, row in located]
