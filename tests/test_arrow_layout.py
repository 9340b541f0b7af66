"""The Arrow IPC file layout batchplan relies on (`batchplan.formats.arrow_layout`), checked
against the installed pyarrow: a release that lays files out otherwise fails here, not in a
user's build."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from batchplan.config import PlanConfig
from batchplan.formats.arrow_layout import ARROW_MAGIC, SMALLEST_ARROW_FILE, replace_in_schema
from batchplan.formats.plan_format import METADATA_KEY, dump_json
from batchplan.formats.plan_writer import write_plan
from batchplan.planning.epochs import build_plan

OLD, NEW = b'"content_hash":"crc32:????????"', b'"content_hash":"crc32:0123abcd"'


def write_arrow(path: Path, metadata: bytes, num_batches: int, custom: bool) -> None:
    """An Arrow IPC file as the plan writer writes one: schema metadata, record batches each
    with custom metadata (``custom``)."""
    schema = pa.schema(
        [pa.field("step", pa.int64(), nullable=False), pa.field("samples", pa.list_(pa.int32()), nullable=False)],
        metadata={METADATA_KEY: b'{"a":1,' + metadata + b',"z":[2,3]}'},
    )
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for index in range(num_batches):
            steps = pa.array(np.arange(index * 3, index * 3 + 3, dtype=np.int64))
            samples = pa.array([[index], [], [1, 2, 3]], pa.list_(pa.int32()))
            batch = pa.RecordBatch.from_arrays([steps, samples], schema=schema)
            writer.write_batch(batch, custom_metadata={"batchplan_crc": f"crc32:{index:08x}"} if custom else None)


@pytest.mark.parametrize(("num_batches", "custom"), [(0, False), (1, False), (3, True)])
def test_replacing_in_the_schema_gives_the_file_written_with_it_from_the_start(tmp_path, num_batches, custom):
    replaced, direct = tmp_path / "replaced.arrow", tmp_path / "direct.arrow"
    write_arrow(replaced, OLD, num_batches, custom)
    write_arrow(direct, NEW, num_batches, custom)
    replace_in_schema(replaced, OLD, NEW)
    assert replaced.read_bytes() == direct.read_bytes()
    data = replaced.read_bytes()
    assert NEW in pa.ipc.open_file(pa.BufferReader(data)).schema.metadata[METADATA_KEY]  # the footer's copy
    assert NEW in pa.ipc.open_stream(pa.BufferReader(data[8:])).schema.metadata[METADATA_KEY]  # the message's


def test_a_written_plan_is_the_file_written_with_its_content_hash_from_the_start(tmp_path):
    """`write_plan` computes the hash while it writes, then writes it over a placeholder: the
    bytes are those of writing the final metadata up front (what rebuilds compare)."""
    path, direct = tmp_path / "plan.arrow", tmp_path / "direct.arrow"
    lengths = np.random.default_rng(5).integers(1, 300, 400).astype(np.int32)
    write_plan(build_plan(lengths, PlanConfig(max_tokens=512, world_size=2, epochs=2)), path)
    reader = pa.ipc.open_file(pa.BufferReader(path.read_bytes()))
    assert b"????????" not in reader.schema.metadata[METADATA_KEY]
    with pa.OSFile(str(direct), "wb") as sink, pa.ipc.new_file(sink, reader.schema) as writer:
        for index in range(reader.num_record_batches):
            batch, custom = reader.get_batch_with_custom_metadata(index)
            writer.write_batch(batch, custom_metadata=custom)
    assert path.read_bytes() == direct.read_bytes()


def test_a_file_begins_and_ends_with_the_magic(tmp_path):
    path = tmp_path / "empty.arrow"
    write_arrow(path, b'"k":0', 0, False)
    data = path.read_bytes()
    assert data.startswith(ARROW_MAGIC + b"\0\0") and data.endswith(ARROW_MAGIC)
    assert len(data) >= SMALLEST_ARROW_FILE


def test_text_not_once_in_each_copy_of_the_schema_is_refused(tmp_path):
    path = tmp_path / "plain.arrow"
    write_arrow(path, b'"k":0', 1, False)
    before = path.read_bytes()
    with pytest.raises(AssertionError, match="not once in the schema"):
        replace_in_schema(path, OLD, NEW)
    with pytest.raises(AssertionError, match="not as long"):
        replace_in_schema(path, b'"k":0', b'"k":10')
    assert path.read_bytes() == before


def test_metadata_json_is_compact_with_sorted_keys():
    """The placeholder is found in the schema as `dump_json` writes it."""
    assert dump_json({"z": 1, "content_hash": "crc32:????????"}) == b"{" + OLD + b',"z":1}'
