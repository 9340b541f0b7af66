"""Training on a mixture's plan in every path, and the loss per source.

`MixtureDataset` over three ``datasets`` folders feeds the plain loop, torchdata's
``StatefulDataLoader`` (0 and 2 workers), Accelerate, `PlanTrainer` and Lightning, each on 2
real gloo processes (`_mixture_training_worker`). For each path: each rank trains exactly the
plan's micro-batches, step by step, with the token ids of the (source, row) each sample index
names; a run stopped inside epoch 2 and resumed from the path's own checkpoint trains exactly
the rest and ends with the plain loop's parameters. `SourceLosses` gives each step's loss
tokens per source as the plan holds them (counted here from the samples, not from the plan's
``source`` column), and `PlanTrainer` logs each source's loss.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from _mixture_training_worker import RUNS, SOURCES, ids_of, run_paths, write_mixture

from batchplan import PlanConfig
from batchplan.errors import ConfigError, PlanMismatchError
from batchplan.formats.opening import open_plan
from batchplan.operations.build_mixture import build_mixture_plan_file
from batchplan.runtime import PlanSampler, SourceLoss, SourceLosses

pytest.importorskip("datasets")
pytestmark = pytest.mark.usefixtures("no_launcher_environment")

NAMES = [name for name, _, _ in SOURCES]
OFFSETS = np.cumsum([0] + [rows for _, rows, _ in SOURCES])[:-1]


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> dict:
    return write_mixture(tmp_path_factory.mktemp("mixture"))


@pytest.fixture(scope="module")
def one_rank_plan(mixture) -> Path:
    """The same mixture planned for 1 rank: one process is every rank."""
    plan = Path(mixture["plan"]).parent / "one-rank.arrow"
    config = PlanConfig(max_tokens=64, world_size=1, micro_batches=2, epochs=1, oversize="split", seed=2)
    build_mixture_plan_file(Path(mixture["plan"]).parent / "mix.json", plan, config)
    return plan


def locate(index: int) -> tuple[int, int]:
    """(source, row) of a global sample index, from the sources' sizes."""
    source = int(np.searchsorted(OFFSETS, index, side="right")) - 1
    return source, int(index - OFFSETS[source])


def plan_rows(plan: str, rank: int) -> list[dict]:
    opened = open_plan(plan)
    return [row for epoch in range(opened.num_epochs) for row in opened.read_rank(epoch, rank).to_pylist()]


def source_of(row: dict) -> int:
    sources = {locate(index)[0] for index in row["samples"]}
    assert len(sources) <= 1, row
    return sources.pop() if sources else -1


def planned_loss_tokens(plan: str) -> dict[int, dict[str, int]]:
    """Each step's loss tokens per source over both ranks (sources without any left out)."""
    steps: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for rank in range(2):
        for row in plan_rows(plan, rank):
            if row["samples"] and row["loss_tokens"]:
                steps[row["step"]][NAMES[source_of(row)]] += row["loss_tokens"]
    return {step: dict(by_source) for step, by_source in steps.items()}


def records(plan: str, rank: int, world_size: int = 2) -> list:
    sampler = PlanSampler(plan, rank=rank, world_size=world_size)
    out = []
    while not sampler.finished:
        out += [rows.record for rows in sampler]
    return out


# -- the record and SourceLosses, in one process ----------------------------------------------------------


def test_each_record_gives_its_loss_tokens_under_its_source(mixture):
    for rank in range(2):
        rows = plan_rows(mixture["plan"], rank)
        got = records(mixture["plan"], rank)
        assert len(got) == len(rows)
        for record, row in zip(got, rows):
            source = source_of(row)
            assert record.source == source
            assert record.loss_tokens_by_source == ({source: row["loss_tokens"]} if source >= 0 else {})


def one_dataset_record(directory: Path):
    from _ddp_plans import sample_lengths, write_test_plan

    plan = write_test_plan(directory / "one.arrow", sample_lengths(), max_tokens=64, world_size=1, oversize="split")
    return plan, records(plan, 0, world_size=1)[0]


def test_a_plan_of_one_dataset_has_no_sources_to_count(tmp_path):
    plan, record = one_dataset_record(tmp_path)
    assert record.source is None and record.loss_tokens_by_source is None
    with pytest.raises(PlanMismatchError, match="not a mixture"):
        SourceLosses(plan)


def test_source_losses_refuse_a_record_without_a_source(mixture, tmp_path):
    _, record = one_dataset_record(tmp_path)
    with pytest.raises(ConfigError, match="mixture's plan"):
        SourceLosses(mixture["plan"]).add(1.0, record)


def test_source_losses_sum_each_sources_loss_and_tokens_until_reduced(mixture):
    """One process, one rank's records: each reduce gives the sums since the one before."""
    losses = SourceLosses(PlanSampler(mixture["plan"], rank=1, world_size=2))
    assert losses.names == NAMES
    expected: dict[str, list] = {}
    for record in records(mixture["plan"], 1):
        loss_sum = 0.5 * record.loss_tokens + 100 * (record.source + 1)
        losses.add(loss_sum, record)
        if record.source >= 0 and record.loss_tokens:
            total = expected.setdefault(NAMES[record.source], [0.0, 0])
            total[0] += loss_sum
            total[1] += record.loss_tokens
        if record.is_last and record.step % 3 == 2:
            assert losses.reduce() == {name: SourceLoss(*total) for name, total in expected.items()}
            expected = {}
    assert losses.reduce() == {name: SourceLoss(*total) for name, total in expected.items()}
    assert losses.reduce() == {}
    assert SourceLoss(3.0, 2).mean == 1.5 and SourceLoss(0.0, 0).mean == 0.0


def test_source_losses_refuse_whole_steps_without_a_planned_micro_batch(one_rank_plan):
    """On a 1-rank plan, one process is every rank: whole steps must hold the plan's loss tokens."""
    plan = one_rank_plan
    losses = SourceLosses(plan)
    steps = defaultdict(list)
    for record in records(plan, 0, world_size=1):
        steps[record.step].append(record)
    for record in steps[0]:
        losses.add(1.0, record)
    assert sum(loss.loss_tokens for loss in losses.reduce().values()) == steps[0][0].step_loss_tokens
    whole = next(step for step in steps.values() if len(step) == 2 and step[0].loss_tokens)
    losses.add(1.0, whole[0])
    losses.reduce()  # inside a step: nothing to check
    losses.add(1.0, whole[1])
    losses.reduce()
    for record in whole[1:]:  # the step's first micro-batch left out: not a whole step, not checked
        losses.add(1.0, record)
    losses.reduce()
    losses.add(1.0, whole[0]._replace(loss_tokens=whole[0].loss_tokens - 1))
    losses.add(1.0, whole[1])
    with pytest.raises(PlanMismatchError, match="other micro-batches than planned"):
        losses.reduce()


# -- the dataset's lengths ---------------------------------------------------------------------------------


def source_lengths(mixture: dict) -> list[np.ndarray]:
    return [np.array([len(ids) for ids in _dataset(mixture["sources"][name])["input_ids"]]) for name in NAMES]


def test_check_dataset_compares_each_sources_lengths_with_its_own_fingerprint(mixture):
    from batchplan.runtime.mixture import MixtureDataset

    sampler = PlanSampler(mixture["plan"], rank=0, world_size=2)
    dataset = MixtureDataset(mixture["plan"], {name: _dataset(folder) for name, folder in mixture["sources"].items()})
    lengths = source_lengths(mixture)
    sampler.check_dataset(dataset, np.concatenate(lengths))
    lengths[1][7] += 1
    with pytest.raises(PlanMismatchError, match=r"source 'code' \(samples 30\.\.109\) has lengths of fingerprint"):
        sampler.check_dataset(dataset, np.concatenate(lengths))
    with pytest.raises(ConfigError, match="no source of the mixture has a loss-tokens column"):
        sampler.check_dataset(dataset, np.concatenate(lengths), loss_tokens=np.concatenate(lengths) - 1)
    with pytest.raises(ConfigError, match="one per sample of the mixture"):
        sampler.check_dataset(dataset, np.concatenate(lengths)[1:])


@pytest.mark.parametrize("form", ["MixtureDataset", "concatenated"])
def test_plan_trainer_takes_a_mixture_as_one_dataset_or_its_sources_concatenated(
    mixture, one_rank_plan, tmp_path, monkeypatch, form
):
    """A concatenated ``datasets.Dataset`` has its lengths checked, source by source."""
    pytest.importorskip("transformers")
    import datasets
    import transformers
    from _integration_worker import make_model

    from batchplan.integrations.transformers import PlanTrainer
    from batchplan.runtime.mixture import MixtureDataset

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    sources = [_dataset(mixture["sources"][name]) for name in NAMES]
    if form == "MixtureDataset":
        dataset = MixtureDataset(one_rank_plan, dict(zip(NAMES, sources)))
    else:
        dataset = datasets.concatenate_datasets(sources)
    args = transformers.TrainingArguments(str(tmp_path / "out"), use_cpu=True, report_to=[])
    trainer = PlanTrainer(model=make_model(), args=args, train_dataset=dataset, plan=str(one_rank_plan))
    assert trainer.plan_source_losses.names == NAMES
    if form == "concatenated":
        reordered = sources[2].select(range(len(sources[2]) - 1, -1, -1)).flatten_indices()  # same rows, other order
        changed = datasets.concatenate_datasets([sources[0], sources[1], reordered])
        with pytest.raises(PlanMismatchError, match="source 'math'"):
            PlanTrainer(model=make_model(), args=args, train_dataset=changed, plan=str(one_rank_plan))


# -- every path on 2 processes ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(mixture, tmp_path_factory) -> list[dict]:
    from _spawn import run_ranks

    return run_ranks(run_paths, (list(RUNS), mixture), tmp_path_factory.mktemp("runs"))


def path_runs(runs: list[dict], path: str) -> list[dict]:
    """Each rank's runs of ``path`` (a path that raised fails the test with its traceback)."""
    for rank, result in enumerate(runs):
        if "error" in result[path]:
            pytest.fail(f"rank {rank}, {path}:\n{result[path]['error']}")
    return [result[path] for result in runs]


def assert_trained_the_plan(seen: list[dict], mixture: dict, rank: int) -> None:
    """Exactly the rank's planned micro-batches, in order, with each sample's own token ids."""
    rows = plan_rows(mixture["plan"], rank)
    expected = [(row["epoch"], row["step"], row["micro"], tuple(row["samples"]), tuple(row["starts"])) for row in rows]
    assert [batch["key"] for batch in seen] == expected
    lengths = {name: [len(ids) for ids in _dataset(folder)["input_ids"]] for name, folder in mixture["sources"].items()}
    for batch, row in zip(seen, rows):
        ids = []
        for index, start, length in zip(row["samples"], row["starts"], row["lengths"]):
            source, sample = locate(index)
            ids += ids_of(source, sample, lengths[NAMES[source]][sample])[start : start + length]
        assert (batch["source"], batch["ids"]) == (source_of(row), ids), batch["key"]


def _dataset(folder: str):
    import datasets

    return datasets.load_from_disk(folder)


def assert_resumed_to_the_plain_loop(run: dict, reference: dict, mixture: dict, rank: int) -> None:
    import torch

    assert_trained_the_plan(run["first"]["seen"] + run["rest"]["seen"], mixture, rank)
    for name, value in reference["full"]["params"].items():
        torch.testing.assert_close(run["rest"]["params"][name], value, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_the_plain_loop_trains_exactly_the_plan_and_resumes_exactly(runs, mixture):
    for rank, plain in enumerate(path_runs(runs, "plain")):
        assert_trained_the_plan(plain["full"]["seen"], mixture, rank)
        assert_resumed_to_the_plain_loop(plain, plain, mixture, rank)
        assert plain["stop"] > open_plan(mixture["plan"]).metadata["steps_per_epoch"][0]  # stopped in epoch 2


@pytest.mark.slow
@pytest.mark.parametrize("path", ["stateful", "accelerate", "trainer", "lightning"])
def test_each_path_trains_exactly_the_plan_and_resumes_from_its_checkpoint(runs, mixture, path):
    """torchdata (0 and 2 workers), Accelerate, PlanTrainer and Lightning (2 workers, loaders
    reloaded every epoch) against the plain loop."""
    plain = path_runs(runs, "plain")
    for rank, run in enumerate(path_runs(runs, path)):
        for one in run.values() if path == "stateful" else [run]:
            assert_resumed_to_the_plain_loop(one, plain[rank], mixture, rank)
            if path in ("trainer", "lightning"):
                assert one["first"]["global_step"] == one["stop"]
                assert one["rest"]["global_step"] == open_plan(mixture["plan"]).num_steps


@pytest.mark.slow
@pytest.mark.parametrize("path", ["plain", "stateful", "accelerate", "lightning"])
def test_source_losses_give_each_steps_loss_tokens_per_source_as_planned(runs, mixture, path):
    planned = planned_loss_tokens(mixture["plan"])
    plain = path_runs(runs, "plain")[0]["full"]["losses"]
    for run in path_runs(runs, path):
        for one in run.values() if path == "stateful" else [run]:
            losses = {**one["first"]["losses"], **one["rest"]["losses"]}
            assert {
                step: {name: tokens for name, (_, tokens) in by_source.items()} for step, by_source in losses.items()
            } == planned
            for step, by_source in losses.items():  # the same sums as the plain loop, on both ranks
                for name, (loss_sum, _) in by_source.items():
                    assert loss_sum == pytest.approx(plain[step][name][0], rel=1e-5)


@pytest.mark.slow
def test_plan_trainer_logs_each_sources_loss_at_every_step(runs, mixture):
    plain = path_runs(runs, "plain")[0]["full"]["losses"]
    for run in path_runs(runs, "trainer"):
        logs = {**run["first"]["logs"], **run["rest"]["logs"]}
        assert sorted(logs) == sorted(plain) == list(range(open_plan(mixture["plan"]).num_steps))
        for step, logged in logs.items():
            assert logged == pytest.approx(
                {f"loss/{name}": loss_sum / tokens for name, (loss_sum, tokens) in plain[step].items()}, rel=1e-5
            )
