"""The runtime's own checks: damaged rows are refused when a rank reads them, drift between
plan and data stops replay at the first micro-batch it touches, and a sampler state resumes
on either layout of the same plan."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _ddp_plans import make_dataset, sample_lengths, write_test_plan
from torch.utils.data import DataLoader

from batchplan.config import PlanConfig
from batchplan.errors import PlanFormatError, PlanMismatchError
from batchplan.formats.opening import open_plan
from batchplan.formats.plan_format import METADATA_KEY
from batchplan.operations.build import build_plan_file
from batchplan.runtime import PackCollator, PadCollator, PlanDataset, PlanSampler
from batchplan.runtime.records import MicroBatch, PlannedItems, PlannedRows, SpanItem

DRIFT = (
    r"the dataset does not match the plan: rebuild the plan on this dataset, or compare the plan with the "
    r"dataset's lengths: `batchplan\.validate_plan\(PLAN, DATA\)`"
)
DAMAGED = r"the plan is damaged: rebuild it, or run `batchplan validate .*` to see what else is"


pytestmark = pytest.mark.usefixtures("no_launcher_environment")


def whole_plan(tmp_path, mode: str = "pack"):
    """A plan of whole samples (no spans): 50 samples up to 150 tokens, two ranks."""
    options = {"micro_batches": 2} if mode == "pad" else {"tokens_per_step": 600}
    config = dict(max_tokens=160, world_size=2, mode=mode, epochs=2, seed=11, **options)
    return write_test_plan(tmp_path / f"{mode}.arrow", sample_lengths(), **config)


def rewrite(path, out, epoch: int, rank: int, column: str, change) -> None:
    """Copy the plan at ``path`` to ``out`` with ``change(values)`` applied, in place, to the
    values of list ``column`` (or the scalar ``column``) of one rank's rows of one epoch."""
    plan = open_plan(path)
    batches = []
    for e in range(plan.num_epochs):
        for r in range(plan.world_size):
            batch = plan.read_rank(e, r)
            if (e, r) == (epoch, rank):
                index = batch.schema.get_field_index(column)
                array = batch.column(index)
                if pa.types.is_list(array.type):
                    values = array.values.to_numpy().copy()
                    change(values)
                    array = pa.ListArray.from_arrays(array.offsets, pa.array(values, array.type.value_type))
                else:
                    values = array.to_numpy().copy()
                    change(values)
                    array = pa.array(values, array.type)
                batch = batch.set_column(index, batch.schema.field(index), array.cast(batch.schema.field(index).type))
            batches.append(batch)
    with pa.ipc.new_file(out, plan.schema.with_metadata({METADATA_KEY: plan.schema.metadata[METADATA_KEY]})) as w:
        for batch in batches:
            w.write_batch(batch)


def flip_byte(path, epoch: int, rank: int, entry: int, byte: int) -> None:
    """Flip one byte of the ``entry``-th sample index of one rank's rows, in the file itself."""
    with pa.memory_map(str(path)) as source:
        base = source.read_buffer().address
        source.seek(0)
        reader = pa.ipc.open_file(source)
        world_size = open_plan(path).world_size
        values = reader.get_batch(epoch * world_size + rank).column("samples").values
        offset = values.buffers()[1].address - base + (values.offset + entry) * values.type.byte_width + byte
    with open(path, "r+b") as file:
        file.seek(offset)
        old = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([old ^ 0xFF]))


def drain(sampler: PlanSampler) -> None:
    for epoch in range(sampler.num_epochs):
        sampler.set_epoch(epoch)
        for _ in sampler:
            pass


# -- damaged rows: refused by the rank that reads them --------------------------------------


def test_a_flipped_byte_in_a_sample_index_is_refused_by_the_rank_whose_rows_it_touches(plans, tmp_path):
    path = tmp_path / "flipped.arrow"
    path.write_bytes(plans["pack"].read_bytes())
    flip_byte(path, epoch=1, rank=1, entry=5, byte=2)
    drain(PlanSampler(path, rank=0, world_size=2))  # rank 0's rows are untouched
    sampler = PlanSampler(path, rank=1, world_size=2)
    list(sampler)  # epoch 0 of rank 1 is untouched
    # The rows' own checksum finds it first (the index check catches what a batch without
    # one holds: test_an_index_outside_the_dataset_is_refused_before_any_row_is_served).
    message = r"flipped.arrow: epoch 1 rank 1 does not match the recorded checksum of its rows .* the file is corrupt"
    with pytest.raises(PlanFormatError, match=message):
        next(iter(sampler))


@pytest.mark.parametrize("bad", [50, -3, 2**31 - 1])
def test_an_index_outside_the_dataset_is_refused_before_any_row_is_served(tmp_path, bad):
    path = whole_plan(tmp_path)
    rewrite(path, tmp_path / "bad.arrow", 0, 0, "samples", lambda v: v.__setitem__(-1, bad))
    sampler = PlanSampler(tmp_path / "bad.arrow", rank=0, world_size=2)
    with pytest.raises(PlanFormatError, match=f"epoch 0, rank 0: .* holds sample index {bad:,} but the plan has 50"):
        next(iter(sampler))
    with pytest.raises(PlanFormatError, match="holds sample index"):
        list(sampler.schedule())


@pytest.mark.parametrize(
    ("column", "change", "pattern"),
    [
        ("starts", lambda v: v.__setitem__(0, -1), "has a span of .* tokens from token -1 of sample"),
        ("lengths", lambda v: v.__setitem__(0, 0), "has a span of 0 tokens"),
        ("lengths", lambda v: v.__setitem__(0, v[0] + 1), r"counts [0-9,]+ tokens but its entries hold"),
        ("tokens", lambda v: v.__setitem__(2, v[2] + 7), r"counts [0-9,]+ tokens but its entries hold"),
    ],
)
def test_a_damaged_span_or_token_count_is_refused(plans, tmp_path, column, change, pattern):
    rewrite(plans["pack"], tmp_path / "bad.arrow", 0, 1, column, change)
    with pytest.raises(PlanFormatError, match=pattern + ".*" + DAMAGED):
        next(iter(PlanSampler(tmp_path / "bad.arrow", rank=1, world_size=2)))
    next(iter(PlanSampler(tmp_path / "bad.arrow", rank=0, world_size=2)))  # the other rank reads its rows


def test_with_the_datasets_lengths_spans_and_token_counts_are_checked_against_them(tmp_path):
    lengths = sample_lengths()
    data = tmp_path / "data.parquet"
    pq.write_table(pa.table({"length": lengths}), data)
    build_plan_file(data, tmp_path / "split.arrow", PlanConfig(max_tokens=64, world_size=2, oversize="split"))
    build_plan_file(data, tmp_path / "whole.arrow", PlanConfig(max_tokens=160, world_size=2))
    for name in ("split", "whole"):
        sampler = PlanSampler(tmp_path / f"{name}.arrow", rank=0, world_size=2)
        sampler.check_dataset(50, lengths)
        drain(sampler)
    # A swapped index stays inside the dataset but not inside the lengths the plan was built on.
    shortest = int(np.argmin(lengths))  # one token
    swap = {
        "split": lambda v: v.__setitem__(np.flatnonzero(v == 3)[-1], shortest),  # a piece of 150-token sample 3
        "whole": lambda v: v.__setitem__(0, 3 if v[0] != 3 else 4),
    }
    patterns = {
        "split": rf"takes tokens \[\d+, \d+\) of sample {shortest}, which has 1;",
        "whole": r"the micro-batch at step \d+, micro \d+ counts [0-9,]+ tokens but its entries hold",
    }
    for name in ("split", "whole"):
        rewrite(tmp_path / f"{name}.arrow", tmp_path / "bad.arrow", 0, 0, "samples", swap[name])
        next(iter(PlanSampler(tmp_path / "bad.arrow", rank=0, world_size=2)))  # without the lengths: plausible
        sampler = PlanSampler(tmp_path / "bad.arrow", rank=0, world_size=2)
        sampler.check_dataset(50, lengths)
        with pytest.raises(PlanFormatError, match=patterns[name] + ".*" + DAMAGED):
            next(iter(sampler))


# -- drift between plan and data: stops replay at the first affected micro-batch ------------


def lengthened(sample: int, extra: int = 500) -> np.ndarray:
    lengths = sample_lengths().astype(np.int64)
    lengths[sample] += extra
    return lengths


def replay(path, lengths, collator, rank: int = 0, check_in_dataset: bool = True):
    """Every batch of ``rank``'s epochs through a DataLoader, one at a time."""
    sampler = PlanSampler(path, rank=rank, world_size=2)
    dataset = PlanDataset(make_dataset(lengths), input_key="input_ids" if check_in_dataset else None)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collator)
    for epoch in range(sampler.num_epochs):
        sampler.set_epoch(epoch)
        yield from loader


def schedule_of(path, rank: int) -> list:
    """Every record of ``rank``, all epochs."""
    sampler = PlanSampler(path, rank=rank, world_size=2)
    return [record for epoch in range(sampler.num_epochs) for record in _schedule(sampler, epoch)]


def _schedule(sampler, epoch):
    sampler.set_epoch(epoch)
    return list(sampler.schedule())


@pytest.mark.parametrize("check_in_dataset", [True, False], ids=["PlanDataset", "collator"])
@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_a_lengthened_sample_stops_replay_at_its_first_micro_batch(tmp_path, mode, check_in_dataset):
    path = whole_plan(tmp_path, mode)
    collator = PackCollator() if mode == "pack" else PadCollator()
    records = schedule_of(path, rank=0)
    assert len(list(replay(path, sample_lengths(), collator))) == len(records)  # the dataset it was built for
    sample = records[5].indices[-1]
    before = next(i for i, r in enumerate(records) if sample in r.indices)
    record, served = records[before], []
    with pytest.raises(PlanMismatchError, match=DRIFT) as raised:
        for batch in replay(path, lengthened(sample), collator, check_in_dataset=check_in_dataset):
            served.append(batch)
    assert len(served) == before  # every micro-batch before the first one holding the sample, then the error
    message = str(raised.value)
    assert message.startswith(f"step {record.step}, micro {record.micro} of rank 0 (epoch {record.epoch}): ")
    tokens = int(sample_lengths()[sample]) + 500
    assert f"sample {sample} has {tokens}" in message or f"{sample}: {tokens}" in message


def test_the_message_names_the_sample_when_the_plan_tells_which(tmp_path):
    path = whole_plan(tmp_path, "pad")
    record = next(r for r in schedule_of(path, rank=0) + schedule_of(path, rank=1) if 9 in r.indices)
    tokens = sample_lengths()[record.indices] + 500 * (np.array(record.indices) == 9)
    items = [{"input_ids": np.zeros(int(n), dtype=np.int64)} for n in tokens]
    longest = record.padded_tokens // len(record.indices)
    pattern = f"sample 9 has {sample_lengths()[9] + 500:,} tokens but the longest the plan has in this micro-batch is "
    pattern += str(longest)
    with pytest.raises(PlanMismatchError, match=pattern):
        PadCollator()(PlannedItems(items, record))
    with pytest.raises(PlanMismatchError, match=r"its \d+ samples hold [0-9,]+ tokens but the plan has"):
        PackCollator()(PlannedItems(items, record))  # a pack collator cannot tell which one


@pytest.mark.parametrize("check_in_dataset", [True, False], ids=["PlanDataset", "collator"])
def test_a_shortened_sample_of_a_span_plan_stops_replay_naming_its_span(plans, check_in_dataset):
    lengths = sample_lengths().astype(np.int64)
    lengths[3] = 100  # its pieces are [0, 64), [64, 128), [128, 150)
    pattern = r"sample 3 has 100 tokens but the plan takes tokens \[\d+, \d+\) of it"
    with pytest.raises(PlanMismatchError, match=pattern):
        rank = _rank_with(plans["pack"], 3, 128)
        list(replay(plans["pack"], lengths, PackCollator(), rank=rank, check_in_dataset=check_in_dataset))


def _rank_with(path, sample: int, start: int) -> int:
    for rank in (0, 1):
        sampler = PlanSampler(path, rank=rank, world_size=2)
        for epoch in range(sampler.num_epochs):
            if any((sample, start) in zip(r.indices, r.starts) for r in _schedule(sampler, epoch)):
                return rank
    raise AssertionError(f"no rank holds sample {sample} from token {start}")


def test_a_lengthened_sample_of_a_split_plan_stops_replay_where_its_last_piece_ends(plans):
    rank = _rank_with(plans["pack"], 3, 128)  # the 150-token sample's last piece
    pattern = (
        r"of rank \d \(epoch \d\): sample 3 has 650 tokens but the plan has 150 \(its last span, \[128, 150\), "
        r"ends there\): 500 tokens would never be trained"
    )
    with pytest.raises(PlanMismatchError, match=pattern):
        list(replay(plans["pack"], lengthened(3), PackCollator(), rank=rank))


def test_a_truncated_plan_stops_on_a_lengthened_whole_sample_and_not_on_a_truncated_one(plans):
    # max_tokens 96: sample 17 (90 tokens) is whole, sample 3 (150 tokens) keeps [0, 96).
    rank = _rank_with(plans["pad"], 17, 0)
    with pytest.raises(PlanMismatchError, match=r"sample 17 has 590 tokens but the plan has 90 \(its last span"):
        list(replay(plans["pad"], lengthened(17), PadCollator(), rank=rank))
    for rank in (0, 1):  # the plan keeps the first 96 tokens of sample 3, however long it is
        list(replay(plans["pad"], lengthened(3), PadCollator(), rank=rank))


def test_a_sequence_length_warmup_plan_replays_its_pieces_without_a_false_alarm(tmp_path):
    lengths = sample_lengths()
    config = dict(max_tokens=160, world_size=2, epochs=2, seqlen_warmup_min=16, seqlen_warmup_tokens=600, seed=2)
    path = write_test_plan(tmp_path / "warmup.arrow", lengths, **config)
    records = schedule_of(path, 0) + schedule_of(path, 1)
    pieces = [(n, s) for r in records if r.epoch == 0 for s, n in zip(r.starts, r.lengths) if s > 0]
    assert pieces and min(n for n, _ in pieces) < 160  # pieces cut to a warmup cap, not their sample's end
    for rank in (0, 1):
        assert len(list(replay(path, lengths, PackCollator(), rank=rank))) == len(schedule_of(path, rank))


@pytest.mark.parametrize("spans", [True, False])
def test_an_empty_micro_batch_passes_the_checks(spans):
    no_spans = [] if spans else None
    empty = MicroBatch([], 0, 4, 1, 2, True, 0, 0, 90, 300, 90, 0, 7, no_spans, no_spans, 2, 1)
    items = PlanDataset(make_dataset()).__getitems__(PlannedRows([], empty))
    assert PackCollator()(items).record == PadCollator()(items).record == empty


def test_a_collator_given_no_record_checks_nothing_it_cannot_compare():
    batch = PackCollator()([SpanItem({"input_ids": list(range(10))}, 0, 4), {"input_ids": [1, 2]}])
    assert batch["input_ids"].shape == (1, 6) and not batch.has_record


# -- a state resumes on either layout of the same plan ---------------------------------------


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    data = root / "data.parquet"
    pq.write_table(pa.table({"length": sample_lengths()}), data)
    config = PlanConfig(max_tokens=64, world_size=2, epochs=3, oversize="split", seed=4)
    build_plan_file(data, root / "plan.arrow", config)
    build_plan_file(data, root / "plan", config, layout="directory")
    other = PlanConfig(max_tokens=64, world_size=2, epochs=3, oversize="split", seed=5)
    build_plan_file(data, root / "other", other, layout="directory")
    return root


@pytest.mark.parametrize(("saved_on", "resumed_on"), [("plan.arrow", "plan"), ("plan", "plan.arrow")])
def test_a_state_resumes_on_the_other_layout_of_the_same_plan(layouts, saved_on, resumed_on):
    before = PlanSampler(layouts / saved_on, rank=1, world_size=2)
    before.set_epoch(1)
    drawn = iter(before)
    for _ in range(3):
        next(drawn)
    state = before.state_dict()
    expected = list(before.schedule())
    after = PlanSampler(layouts / resumed_on, rank=1, world_size=2)
    assert after.plan.metadata["content_hash"] != before.plan.metadata["content_hash"]
    after.load_state_dict(state)
    assert (after.epoch, after.position) == (1, 3)
    assert list(after.schedule()) == expected


def test_a_state_of_another_plan_rank_or_world_size_is_still_refused(layouts):
    state = PlanSampler(layouts / "plan.arrow", rank=1, world_size=2).state_dict()
    with pytest.raises(PlanMismatchError, match=r"content hash .* \(plan identity .*\) but this sampler has"):
        PlanSampler(layouts / "other", rank=1, world_size=2).load_state_dict(state)
    with pytest.raises(PlanMismatchError, match=r"rank 1 but this sampler has rank 0"):
        PlanSampler(layouts / "plan", rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(PlanMismatchError, match=r"world_size 4 but this sampler has world_size 2"):
        PlanSampler(layouts / "plan", rank=1, world_size=2).load_state_dict({**state, "world_size": 4})


def test_a_state_without_a_plan_identity_matches_by_content_hash_alone(layouts):
    state = PlanSampler(layouts / "plan.arrow", rank=0, world_size=2).state_dict()
    del state["plan"]
    PlanSampler(layouts / "plan.arrow", rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(PlanMismatchError, match="content hash"):
        PlanSampler(layouts / "plan", rank=0, world_size=2).load_state_dict(state)
