"""The plan file: layout, metadata, atomic writes, refusing what it cannot read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import batchplan.formats.plan_format as plan_format
import batchplan.formats.plan_writer as plan_writer
from batchplan.config import PlanConfig
from batchplan.errors import PlanFormatError
from batchplan.formats.opening import open_plan
from batchplan.formats.plan_format import METADATA_KEY
from batchplan.formats.plan_writer import write_plan
from batchplan.planning.epochs import build_plan

LENGTHS = np.random.default_rng(7).integers(1, 100, size=500).astype(np.int32)


@pytest.fixture
def plan_path(tmp_path):
    path = tmp_path / "plan.arrow"
    write_plan(build_plan(LENGTHS, PlanConfig(max_tokens=256, world_size=3, epochs=2)), path)
    return path


def test_one_record_batch_per_epoch_and_rank(plan_path):
    plan = open_plan(plan_path)
    assert plan.world_size == 3 and plan.num_epochs == 2
    for epoch in range(2):
        for rank in range(3):
            rows = plan.read_rank(epoch, rank)
            assert set(rows.column("rank").to_pylist()) == {rank}
            assert set(rows.column("epoch").to_pylist()) == {epoch}
            assert rows.num_rows == plan.metadata["rows_per_rank"][epoch]
    plan.verify()


def test_metadata_records_how_the_plan_was_made(plan_path):
    meta = open_plan(plan_path).metadata
    assert meta["format_version"] == plan_format.FORMAT_VERSION
    assert PlanConfig.from_dict(meta["config"]) == PlanConfig(max_tokens=256, world_size=3, epochs=2)
    assert set(meta["versions"]) == {"batchplan", "numpy", "numba", "pyarrow", "highspy"}
    assert meta["num_samples"] == 500 and meta["dropped"] == {}


def test_failed_write_keeps_the_previous_plan_and_leaves_no_temporary(plan_path, monkeypatch):
    before = plan_path.read_bytes()

    def explode(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(plan_writer, "batch_crc", explode)
    with pytest.raises(KeyboardInterrupt):
        write_plan(build_plan(LENGTHS, PlanConfig(max_tokens=512)), plan_path)
    assert plan_path.read_bytes() == before
    assert [p.name for p in plan_path.parent.iterdir()] == ["plan.arrow"]


def test_content_hash_is_the_same_written_beside_or_before_the_file(tmp_path):
    """The hash is computed while the file is written and put over a placeholder; metadata
    that holds the placeholder's text itself (a caller's dict) gets it written up front.
    Either way the file verifies and keeps the caller's metadata."""
    plan = build_plan(np.arange(1, 250, dtype=np.int32), PlanConfig(max_tokens=256, world_size=2))
    plain, tricky = tmp_path / "plain.arrow", tmp_path / "tricky.arrow"
    write_plan(plan, plain, dataset={"name": "x"})
    odd = {"name": "x", "note": {"content_hash": "crc32:????????"}}
    write_plan(plan, tricky, dataset=odd)
    for path in (plain, tricky):
        opened = open_plan(path)
        opened.verify()
        assert opened.metadata["content_hash"].startswith("crc32:") and "?" not in opened.metadata["content_hash"]
    assert open_plan(tricky).metadata["dataset"] == odd
    assert b"????????" not in plain.read_bytes()


def test_missing_output_directory(tmp_path):
    with pytest.raises(PlanFormatError, match="does not exist"):
        write_plan(build_plan(LENGTHS, PlanConfig(max_tokens=512)), tmp_path / "nope" / "p.arrow")


def read_batches(path) -> list[pa.RecordBatch]:
    """Every record batch, read into memory (the file is about to be overwritten)."""
    reader = pa.ipc.open_file(pa.BufferReader(path.read_bytes()))
    return [reader.get_batch(i) for i in range(reader.num_record_batches)]


def rewrite(path, batches: list[pa.RecordBatch], metadata=None) -> None:
    schema = batches[0].schema if metadata is None else batches[0].schema.with_metadata(metadata)
    with pa.ipc.new_file(str(path), schema) as writer:
        for batch in batches:
            writer.write_batch(batch.replace_schema_metadata(schema.metadata))


def rewrite_metadata(path, change):
    batches = read_batches(path)
    meta = json.loads(batches[0].schema.metadata[METADATA_KEY])
    change(meta)
    rewrite(path, batches, {METADATA_KEY: json.dumps(meta).encode()})


def test_newer_format_version_is_refused(plan_path):
    rewrite_metadata(plan_path, lambda meta: meta.update(format_version=99))
    with pytest.raises(PlanFormatError, match="format version 99 is newer"):
        open_plan(plan_path)


def test_not_a_plan(tmp_path):
    junk = tmp_path / "junk.arrow"
    junk.write_bytes(b"hello")
    with pytest.raises(PlanFormatError, match="not an Arrow IPC file"):
        open_plan(junk)
    other = tmp_path / "other.arrow"
    with pa.ipc.new_file(str(other), pa.schema([("x", pa.int32())])) as writer:
        writer.write_table(pa.table({"x": pa.array([1], pa.int32())}))
    with pytest.raises(PlanFormatError, match="without batchplan metadata"):
        open_plan(other)


def test_padded_tokens_only_in_pad_mode(tmp_path):
    """Pack plans leave out ``padded_tokens`` (it would equal ``tokens``); pad plans hold it."""
    for mode, has_padded in (("pack", False), ("pad", True)):
        path = tmp_path / f"{mode}.arrow"
        write_plan(build_plan(LENGTHS, PlanConfig(max_tokens=256, world_size=3, mode=mode)), path)
        assert ("padded_tokens" in open_plan(path).schema.names) == has_padded


def test_pack_plans_of_format_version_1_with_padded_tokens_still_read(tmp_path, monkeypatch):
    """Format version 1 has ``padded_tokens`` in pack mode too: such plans open, verify,
    validate, summarize, replay and reshard like version 2 plans."""
    from batchplan.operations.reshard import reshard_plan_file
    from batchplan.operations.validate import check_plan
    from batchplan.reports.summary import summarize_plan
    from batchplan.runtime import PlanSampler

    config = PlanConfig(max_tokens=256, world_size=3, epochs=2)
    current, earlier = tmp_path / "current.arrow", tmp_path / "earlier.arrow"
    write_plan(build_plan(LENGTHS, config), current)
    monkeypatch.setattr(plan_writer, "_has_padded", lambda config: True)
    monkeypatch.setattr(plan_writer, "FORMAT_VERSION", 1)
    write_plan(build_plan(LENGTHS, config), earlier)
    monkeypatch.undo()
    plan = open_plan(earlier)
    assert "padded_tokens" in plan.schema.names and plan.metadata["format_version"] == 1
    plan.verify()
    assert check_plan(plan, LENGTHS) == []
    assert summarize_plan(plan) == summarize_plan(open_plan(current))
    sampler = PlanSampler(earlier, rank=1, world_size=3)
    assert [record.padded_tokens for record in sampler.schedule()] == [record.tokens for record in sampler.schedule()]
    reshard_plan_file(earlier, tmp_path / "from_earlier.arrow", world_size=2, from_step=1)
    reshard_plan_file(current, tmp_path / "from_current.arrow", world_size=2, from_step=1)
    # The same rows (the metadata names its parent, by content hash).
    resharded = [open_plan(tmp_path / f"from_{name}.arrow").read_all() for name in ("earlier", "current")]
    assert resharded[0].equals(resharded[1])


def test_missing_required_column(plan_path):
    batches = [batch.drop_columns(["step_loss_tokens"]) for batch in read_batches(plan_path)]
    rewrite(plan_path, batches)
    with pytest.raises(PlanFormatError, match="step_loss_tokens"):
        open_plan(plan_path)


def test_rank_and_epoch_out_of_range(plan_path):
    plan = open_plan(plan_path)
    with pytest.raises(PlanFormatError, match="rank 3 is outside"):
        plan.read_rank(0, 3)
    with pytest.raises(PlanFormatError, match="epoch 2 is outside"):
        plan.read_rank(2, 0)


def test_altered_content_fails_verification(plan_path):
    batches = read_batches(plan_path)
    tokens = batches[0].column("tokens").to_numpy().copy()
    tokens[1] += 1
    column = batches[0].schema.get_field_index("tokens")
    batches[0] = batches[0].set_column(column, batches[0].schema.field("tokens"), pa.array(tokens))
    rewrite(plan_path, batches)
    with pytest.raises(PlanFormatError, match="content hash"):
        open_plan(plan_path).verify()


def test_worked_example_of_the_format_doc(tmp_path):
    """docs/plan-format.md's worked example, row for row (update both together)."""
    lengths = np.array([5, 12, 3, 9, 16, 7, 2, 11, 4, 20], dtype=np.int32)
    config = PlanConfig(max_tokens=16, world_size=2, micro_batches=2, oversize="split")
    path = tmp_path / "plan.arrow"
    write_plan(build_plan(lengths, config), path)
    plan = open_plan(path)
    columns = [
        "step",
        "micro",
        "num_micro",
        "samples",
        "starts",
        "lengths",
        "tokens",
        "loss_tokens",
        "step_tokens",
        "step_loss_tokens",
        "tokens_before_step",
    ]
    rows = [[row[c] for c in columns] for rank in (0, 1) for row in plan.read_rank(0, rank).to_pylist()]
    assert rows == [
        [0, 0, 2, [7, 0], [0, 0], [11, 5], 16, 14, 57, 50, 0],
        [0, 1, 2, [9], [0], [16], 16, 15, 57, 50, 0],
        [1, 0, 1, [3, 5], [0, 0], [9, 7], 16, 14, 32, 28, 57],
        [0, 0, 2, [4], [0], [16], 16, 15, 57, 50, 0],
        [0, 1, 2, [8, 2, 6], [0, 0, 0], [4, 3, 2], 9, 6, 57, 50, 0],
        [1, 0, 1, [1, 9], [0, 16], [12, 4], 16, 14, 32, 28, 57],
    ]
    docs = (Path(__file__).resolve().parent.parent / "docs" / "plan-format.md").read_text()
    assert "| 0 | 0 | 1 | 1 | 2 | [8, 2, 6] | [0, 0, 0] | [4, 3, 2] | 9 | 6 | 57 | 50 | 0 |" in docs


@pytest.mark.parametrize("arrow_type", [pa.int32(), pa.int64(), pa.float64()])
def test_arrow_arrays_over_numpy_buffers_equal_pa_array(arrow_type):
    from batchplan.formats.arrow import arrow_array, numpy_of

    values = np.arange(-5, 20)[::2]  # strided: copied to contiguous
    array = arrow_array(values, arrow_type)
    assert array.equals(pa.array(values, type=arrow_type))
    assert numpy_of(array).tolist() == numpy_of(array.slice(0)).tolist() == values.tolist()
    assert numpy_of(array.slice(3, 4)).tolist() == values[3:7].tolist()


def rewritten_with_one_value_changed(path: Path, out: Path, index: int) -> None:
    """The plan at ``path`` written again as it is, every batch with its recorded checksum,
    except that record batch ``index`` has one more token in its first row."""
    reader = pa.ipc.open_file(path)
    with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_file(sink, reader.schema) as writer:
        for i in range(reader.num_record_batches):
            batch, custom = reader.get_batch_with_custom_metadata(i)
            if i == index:
                tokens = batch.column("tokens").to_numpy().copy()
                tokens[0] += 1
                at = batch.schema.get_field_index("tokens")
                batch = batch.set_column(at, batch.schema.field(at), pa.array(tokens))
            writer.write_batch(batch, custom_metadata=custom)


def test_every_record_batch_carries_its_own_checksum(plan_path):
    reader = pa.ipc.open_file(plan_path)
    for i in range(reader.num_record_batches):
        batch, custom = reader.get_batch_with_custom_metadata(i)
        assert custom[plan_format.BATCH_CRC_KEY.encode()].decode() == plan_format.batch_checksum(batch)


def test_a_rank_whose_rows_changed_is_refused_by_the_rank_that_reads_them(plan_path, tmp_path):
    damaged = tmp_path / "damaged.arrow"
    rewritten_with_one_value_changed(plan_path, damaged, index=1)  # epoch 0, rank 1
    plan = open_plan(damaged)
    plan.read_rank(0, 0)  # another rank's rows read as they are
    with pytest.raises(PlanFormatError, match="epoch 0 rank 1 does not match the recorded checksum"):
        plan.read_rank(0, 1)


def test_a_sampler_refuses_rows_that_changed(plan_path, tmp_path):
    from batchplan.runtime import PlanSampler

    damaged = tmp_path / "damaged.arrow"
    rewritten_with_one_value_changed(plan_path, damaged, index=1)
    assert len(list(PlanSampler(damaged, rank=0, world_size=open_plan(damaged).world_size))) > 0
    with pytest.raises(PlanFormatError, match="does not match the recorded checksum"):
        list(PlanSampler(damaged, rank=1, world_size=open_plan(damaged).world_size))
