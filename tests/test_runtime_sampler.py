"""PlanSampler in one process: plan order, placement, epochs, strict state dicts, resume."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _ddp_plans import make_dataset, sample_lengths, write_test_plan
from torch.utils.data import DataLoader

from batchplan.config import PlanConfig
from batchplan.errors import ConfigError, PlanFormatError, PlanMismatchError
from batchplan.formats.lengths import fingerprint_lengths
from batchplan.formats.opening import open_plan
from batchplan.formats.plan_file import PlanFile
from batchplan.operations.build import build_plan_file
from batchplan.runtime import MicroBatch, PackCollator, PlanDataset, PlanSampler, SpanIndex

pytestmark = pytest.mark.usefixtures("no_launcher_environment")


def as_ints(batches):
    return [[int(i) for i in batch] for batch in batches]


# -- order and records -------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("epoch", [0, 1])
def test_iteration_yields_this_ranks_rows_in_plan_order(plans, rank, epoch):
    sampler = PlanSampler(plans["pack"], rank=rank, world_size=2)
    sampler.set_epoch(epoch)
    rows = open_plan(plans["pack"]).read_rank(epoch, rank).to_pylist()
    assert len(sampler) == len(rows)
    records = list(sampler.schedule())
    drawn = list(sampler)
    assert as_ints(drawn) == [row["samples"] for row in rows]
    assert [planned.record for planned in drawn] == records  # each batch's rows carry their record
    assert len(records) == len(rows)
    for position, (record, row) in enumerate(zip(records, rows)):
        assert isinstance(record, MicroBatch)
        assert record.position == position
        assert record.indices == row["samples"]
        assert (record.starts, record.lengths) == (row["starts"], row["lengths"])
        assert record.spans == list(zip(row["starts"], row["lengths"]))
        for field in (
            "epoch",
            "step",
            "micro",
            "num_micro",
            "tokens",
            "loss_tokens",
            "step_loss_tokens",
            "tokens_before_step",
            "step_tokens",
        ):
            assert getattr(record, field) == row[field], field
        assert "padded_tokens" not in row  # a pack plan: no padding, the record says tokens
        assert record.padded_tokens == row["tokens"]
        assert record.is_last == (row["micro"] == row["num_micro"] - 1)


def test_spans_travel_as_span_indices(plans):
    sampler = PlanSampler(plans["pack"], rank=0, world_size=2)
    for batch, record in zip(sampler, PlanSampler(plans["pack"], rank=0, world_size=2).schedule()):
        assert batch.record == record
        assert all(isinstance(i, SpanIndex) and isinstance(i, int) for i in batch)
        assert [(i.start, i.length) for i in batch] == record.spans
        assert pickle.loads(pickle.dumps(batch)) == batch
        assert [(i.start, i.length) for i in pickle.loads(pickle.dumps(batch))] == record.spans


def test_a_plan_without_spans_yields_plain_ints(tmp_path):
    path = write_test_plan(tmp_path / "plain.arrow", np.arange(1, 40, dtype=np.int32), max_tokens=64)
    sampler = PlanSampler(path)
    assert not sampler.has_spans
    batches = list(sampler)
    assert all(type(i) is int for batch in batches for i in batch)
    assert all(record.starts is None and record.spans is None for record in sampler.schedule())


def test_an_empty_micro_batch_is_a_record_with_no_indices(plans):
    records = [list(PlanSampler(plans["single"], rank=r, world_size=2).schedule()) for r in (0, 1)]
    assert sorted(len(r[0].indices) for r in records) == [0, 1]
    empty = next(r[0] for r in records if not r[0].indices)
    assert empty.is_empty and empty.tokens == 0 and empty.is_last and empty.step_loss_tokens == 19


def test_properties_describe_the_plan(plans):
    sampler = PlanSampler(plans["pad"], rank=1, world_size=2)
    assert (sampler.rank, sampler.world_size, sampler.mode, sampler.max_tokens) == (1, 2, "pad", 96)
    assert sampler.num_epochs == 1 and sampler.num_steps == sum(sampler.steps_per_epoch)
    assert "rank=1" in repr(sampler)


# -- placement ------------------------------------------------------------------


def test_rank_and_world_size_come_from_the_environment(plans, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    sampler = PlanSampler(plans["pack"])
    assert (sampler.rank, sampler.world_size) == (1, 2)


def test_a_single_process_on_a_two_rank_plan_names_both_world_sizes(plans):
    with pytest.raises(PlanMismatchError, match=r"world_size 2 .*world_size 1"):
        PlanSampler(plans["pack"])


def test_explicit_world_size_must_match_the_plan(plans):
    with pytest.raises(PlanMismatchError, match=r"built for world_size 2 but this run has world_size 4"):
        PlanSampler(plans["pack"], rank=0, world_size=4)


@pytest.mark.parametrize(("rank", "world_size"), [(2, 2), (-1, 2), ("0", 2)])
def test_invalid_rank_is_a_config_error(plans, rank, world_size):
    with pytest.raises(ConfigError):
        PlanSampler(plans["pack"], rank=rank, world_size=world_size)


def test_a_rank_out_of_range_names_the_valid_ranks_and_where_it_came_from(plans, monkeypatch):
    with pytest.raises(ConfigError, match=r"rank must be in 0\.\.1 for world_size 2, got 2 \(from arguments\)"):
        PlanSampler(plans["pack"], rank=2, world_size=2)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"got 5 \(from RANK/WORLD_SIZE environment\)"):
        PlanSampler(plans["pack"])


def test_half_set_environment_is_a_config_error(plans, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="WORLD_SIZE is not set"):
        PlanSampler(plans["pack"])


# -- epochs -----------------------------------------------------------------------


def test_an_epoch_beyond_the_plan_is_a_clear_error(plans):
    sampler = PlanSampler(plans["pack"], rank=0, world_size=2)
    with pytest.raises(PlanMismatchError, match=r"epoch 2 is beyond the plan, which has epochs 0\.\.1; .*`epochs=3`"):
        sampler.set_epoch(2)
    with pytest.raises(ConfigError):
        sampler.set_epoch("1")


def test_epochs_differ_and_repeat_identically(plans):
    sampler = PlanSampler(plans["pack"], rank=0, world_size=2)
    first = as_ints(sampler)
    sampler.set_epoch(1)
    second = as_ints(sampler)
    sampler.set_epoch(0)
    assert as_ints(sampler) == first != second


def test_opening_reads_no_rows_and_an_epoch_reads_only_this_rank(plans, monkeypatch):
    calls = []
    original = PlanFile.read_rank
    monkeypatch.setattr(
        PlanFile, "read_rank", lambda self, e, r, **kw: calls.append((e, r)) or original(self, e, r, **kw)
    )
    sampler = PlanSampler(plans["pack"], rank=1, world_size=2)
    assert calls == []
    sampler.set_epoch(1)
    list(zip(sampler.schedule(), sampler))
    assert calls == [(1, 1)]


# -- state dicts and resume ------------------------------------------------------


def test_state_dict_is_small_plain_and_versioned(plans):
    sampler = PlanSampler(plans["pack"], rank=1, world_size=2)
    state = sampler.state_dict()
    assert len(json.dumps(state)) < 400
    assert state["version"] == 1 and state["kind"] == "batchplan.PlanSampler"
    assert (state["rank"], state["world_size"], state["epoch"], state["position"]) == (1, 2, 0, 0)


@pytest.mark.parametrize("taken", [0, 1, 5, 11, 12])
def test_resume_continues_with_exactly_the_remaining_micro_batches(plans, taken):
    expected = list(PlanSampler(plans["pack"], rank=0, world_size=2).schedule())
    before = PlanSampler(plans["pack"], rank=0, world_size=2)
    loader_side = iter(before)
    drawn = [next(loader_side) for _ in range(min(taken + 3, len(expected)))]  # the loader prefetches ahead
    state = before.state_dict(after=drawn[taken - 1].record) if taken else before.state_dict(after=None)
    if not taken:
        state["position"] = 0  # nothing trained yet: what a sampler that drew nothing saves
    state = json.loads(json.dumps(state))
    after = PlanSampler(plans["pack"], rank=0, world_size=2)
    after.load_state_dict(state)
    after.set_epoch(0)  # a loop that calls set_epoch with the saved epoch keeps the resumed position
    assert len(after) == len(expected) - taken
    assert list(after.schedule()) == expected[taken:]
    assert as_ints(after) == [r.indices for r in expected[taken:]]
    after.set_epoch(1)
    assert len(after) == len(expected) and list(after.schedule())[0].epoch == 1


def test_a_state_at_the_end_of_an_epoch_continues_with_the_next(plans):
    source = PlanSampler(plans["pack"], rank=0, world_size=2)
    list(source)
    assert source.state_dict()["epoch"] == 0  # all of epoch 0 drawn
    for call_set_epoch in (None, 0, 1):
        sampler = PlanSampler(plans["pack"], rank=0, world_size=2)
        sampler.load_state_dict(source.state_dict())
        assert sampler.epoch == 1
        if call_set_epoch == 0:  # the loop's counter says epoch 0: it has nothing left
            sampler.set_epoch(0)
            assert list(sampler) == []
        elif call_set_epoch == 1:
            sampler.set_epoch(1)
        assert [p.record.epoch for p in sampler] == [1] * len(PlanSampler(plans["pack"], rank=0, world_size=2))


def test_a_state_loaded_after_the_iterators_were_created_is_honoured(plans):
    """What a stateful loader does: iter(sampler) first, then it restores itself."""
    expected = list(PlanSampler(plans["pack"], rank=0, world_size=2).schedule())
    source = PlanSampler(plans["pack"], rank=0, world_size=2)
    taken = iter(source)
    for _ in range(3):
        next(taken)
    sampler = PlanSampler(plans["pack"], rank=0, world_size=2)
    batches = iter(sampler)
    sampler.load_state_dict(source.state_dict())
    assert [planned.record for planned in batches] == expected[3:]


def test_the_state_counts_what_the_loader_drew(plans):
    sampler = PlanSampler(plans["pack"], rank=0, world_size=2)
    batches = iter(sampler)
    first, second = next(batches), next(batches)
    assert sampler.state_dict()["position"] == 2
    assert sampler.state_dict(after=first.record)["position"] == 1
    assert sampler.state_dict(after=second.record) == sampler.state_dict()


def test_state_after_a_record_the_sampler_did_not_draw_is_refused(plans):
    sampler = PlanSampler(plans["pack"], rank=0, world_size=2)
    batches = iter(sampler)
    next(batches)
    later = list(PlanSampler(plans["pack"], rank=0, world_size=2).schedule())[3]
    with pytest.raises(ConfigError, match="micro-batch 3 was not drawn by this sampler"):
        sampler.state_dict(after=later)
    with pytest.raises(ConfigError, match="MicroBatch record"):
        sampler.state_dict(after={"position": 0})


def test_set_epoch_after_a_load_must_be_the_loaded_epoch(plans):
    source = PlanSampler(plans["pack"], rank=0, world_size=2)
    source.set_epoch(1)
    batches = iter(source)
    next(batches), next(batches)
    sampler = PlanSampler(plans["pack"], rank=0, world_size=2)
    sampler.load_state_dict(source.state_dict())
    with pytest.raises(PlanMismatchError, match=r"set_epoch\(0\) right after loading a state at epoch 1.*replay"):
        sampler.set_epoch(0)  # e.g. a framework whose epoch counter restarted at 0
    sampler.set_epoch(1)
    assert len(sampler) == open_plan(plans["pack"]).metadata["rows_per_rank"][1] - 2
    assert [p.record.position for p in sampler][0] == 2


def test_resume_in_the_second_epoch(plans):
    sampler = PlanSampler(plans["pack"], rank=1, world_size=2)
    sampler.set_epoch(1)
    expected = list(sampler.schedule())
    batches = iter(sampler)
    for _ in range(4):
        next(batches)
    resumed = PlanSampler(plans["pack"], rank=1, world_size=2)
    resumed.load_state_dict(sampler.state_dict())
    assert resumed.epoch == 1
    assert list(resumed.schedule()) == expected[4:]


# -- epochs without set_epoch -------------------------------------------------------


def test_iterating_again_walks_the_next_epoch_and_never_repeats_one(plans):
    sampler = PlanSampler(plans["pack"], rank=0, world_size=2)
    plan = open_plan(plans["pack"])
    walked = []
    while not sampler.finished:
        walked.append([(p.record.epoch, p.record.step, p.record.micro) for p in sampler])
    assert len(walked) == plan.num_epochs == 2
    for epoch, batches in enumerate(walked):
        rows = plan.read_rank(epoch, 0).to_pylist()
        assert batches == [(epoch, row["step"], row["micro"]) for row in rows]
    assert sampler.epoch == 1 and len(sampler) == 0
    with pytest.raises(PlanMismatchError, match=r"all 2 epoch\(s\) of the plan are done.*`epochs=3`"):
        list(sampler)


def test_a_loader_without_set_epoch_trains_each_epoch_once(plans):
    sampler = PlanSampler(plans["pack"], rank=0, world_size=2)
    loader = DataLoader(PlanDataset(make_dataset()), batch_sampler=sampler, collate_fn=PackCollator())
    epochs = [[batch.record.epoch for batch in loader] for _ in range(2)]
    assert [set(e) for e in epochs] == [{0}, {1}]
    with pytest.raises(PlanMismatchError, match="are done"):
        next(iter(loader))


def test_set_epoch_with_the_current_epoch_every_epoch_changes_nothing(plans):
    """A loop that calls set_epoch(epoch) at each epoch start (Trainer, Accelerate) walks the plan."""
    sampler = PlanSampler(plans["pack"], rank=0, world_size=2)
    for epoch in range(sampler.num_epochs):
        sampler.set_epoch(epoch)
        assert {p.record.epoch for p in sampler} == {epoch}
    assert sampler.finished


def mismatch_cases(plans):
    return {
        "another plan": (PlanSampler(plans["pad"], rank=0, world_size=2).state_dict(), "content hash"),
        "another rank": (PlanSampler(plans["pack"], rank=1, world_size=2).state_dict(), r"rank 1 .* rank 0"),
    }


def test_state_of_another_plan_or_rank_is_rejected_naming_both_values(plans):
    sampler = PlanSampler(plans["pack"], rank=0, world_size=2)
    mine = sampler.state_dict()
    for state, pattern in mismatch_cases(plans).values():
        with pytest.raises(PlanMismatchError, match=pattern):
            sampler.load_state_dict(state)
    other = PlanSampler(plans["pad"], rank=0, world_size=2).state_dict()
    with pytest.raises(PlanMismatchError, match=f"{other['content_hash']}.*{mine['content_hash']}"):
        sampler.load_state_dict(other)
    for key, value, pattern in (
        ("world_size", 4, r"world_size 4 but this sampler has world_size 2"),
        ("config_fingerprint", "0" * 16, "config fingerprint '0000000000000000'"),
        ("epoch", 2, r"epoch 2 .* epochs 0\.\.1"),
        ("position", 99, r"micro-batch 99 of epoch 0 .* has 12"),
    ):
        with pytest.raises(PlanMismatchError, match=pattern):
            sampler.load_state_dict({**mine, key: value})


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"kind": "other"}, "expected a batchplan.PlanSampler state"),
        ({"version": 2}, "newer than this batchplan reads"),
        ({"extra": 1}, r"unknown keys \['extra'\]"),
    ],
)
def test_malformed_state_is_a_format_error(plans, change, pattern):
    sampler = PlanSampler(plans["pack"], rank=0, world_size=2)
    with pytest.raises(PlanFormatError, match=pattern):
        sampler.load_state_dict({**sampler.state_dict(), **change})
    with pytest.raises(PlanFormatError):
        sampler.load_state_dict([1, 2])


def test_a_pickled_sampler_reopens_the_plan_at_the_same_place(plans):
    sampler = PlanSampler(plans["pack"], rank=0, world_size=2)
    batches = iter(sampler)
    next(batches), next(batches)
    copy = pickle.loads(pickle.dumps(sampler))
    assert copy.state_dict() == sampler.state_dict()
    assert list(copy.schedule()) == list(PlanSampler(plans["pack"], rank=0, world_size=2).schedule())[2:]
    planned = next(iter(copy))
    assert pickle.loads(pickle.dumps(planned)).record == planned.record


# -- loaders and files -------------------------------------------------------------


@pytest.mark.slow
def test_loader_workers_give_the_same_batches(plans):
    sampler = PlanSampler(plans["pack"], rank=0, world_size=2)
    dataset, collate = PlanDataset(make_dataset()), PackCollator()
    plain = [b["input_ids"] for b in DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)]
    workers = DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate, num_workers=2, multiprocessing_context="fork"
    )
    sampler.set_epoch(0)
    records = list(sampler.schedule())
    together = list(workers)
    assert len(together) == len(plain) == len(records)
    for batch, expected, record in zip(together, plain, records):
        assert torch.equal(batch["input_ids"], expected)
        assert batch.record == record and batch["input_ids"].shape[1] == record.tokens
    for picklable in (dataset, collate):  # what spawn-started workers receive
        pickle.loads(pickle.dumps(picklable))


def test_a_plan_without_runtime_columns_is_a_format_error(plans, tmp_path):
    plan = open_plan(plans["single"])
    batches = [plan.read_rank(0, r).drop_columns(["num_micro"]) for r in range(2)]
    path = tmp_path / "old.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, batches[0].schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    with pytest.raises(PlanFormatError, match="num_micro"):  # PlanFile or the runtime names it
        PlanSampler(path, rank=0, world_size=2)


def test_a_missing_file_is_a_format_error(tmp_path):
    with pytest.raises(PlanFormatError, match="no such plan file"):
        PlanSampler(tmp_path / "nope.arrow", rank=0, world_size=1)


# -- the dataset a plan was built for ------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Plans made by `build_plan_file` (which records the lengths fingerprint), with and
    without a loss-tokens column, and the dataset's lengths."""
    root = tmp_path_factory.mktemp("built")
    lengths = sample_lengths()
    data = root / "data.parquet"
    pq.write_table(pa.table({"length": lengths, "loss": lengths // 2}), data)
    config = PlanConfig(max_tokens=256, world_size=2)
    build_plan_file(data, root / "plain.arrow", config)
    build_plan_file(data, root / "loss.arrow", config, loss_tokens_column="loss")
    return {"lengths": lengths, "plain": root / "plain.arrow", "loss": root / "loss.arrow"}


def test_check_dataset_accepts_the_dataset_the_plan_was_built_for(built):
    lengths = built["lengths"]
    sampler = PlanSampler(built["plain"], rank=0, world_size=2)
    sampler.check_dataset(make_dataset(lengths))
    sampler.check_dataset(PlanDataset(make_dataset(lengths)), lengths)
    sampler.check_dataset(np.int64(50), lengths.tolist())
    PlanSampler(built["loss"], rank=1, world_size=2).check_dataset(50, lengths, loss_tokens=lengths // 2)


def test_check_dataset_names_both_row_counts(built):
    sampler = PlanSampler(built["plain"], rank=0, world_size=2)
    message = r"plain.arrow: the plan was built for a dataset of 50 rows but this dataset has 49; rebuild the plan"
    with pytest.raises(PlanMismatchError, match=message):
        sampler.check_dataset(make_dataset(built["lengths"][:49]))
    with pytest.raises(PlanMismatchError, match="50 rows but this dataset has 1,000"):
        sampler.check_dataset(1000)


@pytest.mark.parametrize("change", ["one length", "row order"])
def test_check_dataset_with_lengths_names_both_fingerprints(built, change):
    lengths = built["lengths"].copy()
    if change == "one length":
        lengths[7] += 1
    else:
        lengths = np.roll(lengths, 1)
    sampler = PlanSampler(built["plain"], rank=0, world_size=2)
    found, recorded = fingerprint_lengths(lengths), fingerprint_lengths(built["lengths"])
    message = (
        f"the dataset's lengths have fingerprint {found} but the plan was built for {recorded}; "
        "same row count, other data"
    )
    with pytest.raises(PlanMismatchError, match=message):
        sampler.check_dataset(50, lengths)
    with pytest.raises(PlanMismatchError, match="lengths and loss tokens have fingerprint"):
        PlanSampler(built["loss"], rank=0, world_size=2).check_dataset(50, built["lengths"], loss_tokens=lengths // 3)


def test_check_dataset_refuses_what_it_cannot_compare(built, plans):
    lengths = built["lengths"]
    with pytest.raises(ConfigError, match="built with loss-tokens column 'loss'; pass loss_tokens="):
        PlanSampler(built["loss"], rank=0, world_size=2).check_dataset(50, lengths)
    with pytest.raises(ConfigError, match="built without a loss-tokens column; drop loss_tokens="):
        PlanSampler(built["plain"], rank=0, world_size=2).check_dataset(50, lengths, loss_tokens=lengths)
    with pytest.raises(ConfigError, match=r"lengths has shape \(49,\), expected \(50,\)"):
        PlanSampler(built["plain"], rank=0, world_size=2).check_dataset(50, lengths[:49])
    with pytest.raises(ConfigError, match="needs a dataset with len\\(\\) or its row count, got generator"):
        PlanSampler(built["plain"], rank=0, world_size=2).check_dataset(i for i in range(50))
    sampler = PlanSampler(plans["pack"], rank=0, world_size=2)  # written by write_plan without a fingerprint
    sampler.check_dataset(make_dataset())  # the row count is still checked
    with pytest.raises(PlanFormatError, match="records no lengths fingerprint"):
        sampler.check_dataset(make_dataset(), sample_lengths())
