"""`check_plan` catches corruption and names the guarantee it breaks.

Each test builds a good plan, rewrites it with one defect, and asserts exactly which
guarantees are reported. "Forged" files get a fresh content checksum (so only the
defect itself can be reported); "corrupt" files keep the old one (integrity fails too).
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import reference as ref

from batchplan import BatchPlanError, PlanConfig, PlanFormatError
from batchplan.formats.opening import open_plan
from batchplan.formats.plan_format import METADATA_KEY, content_hash
from batchplan.operations.validate import check_plan

# --------------------------------------------------------------------------- rewriting plans


def read_rows(path: Path) -> tuple[pa.Schema, dict, list[dict[str, list]]]:
    """Schema (no metadata), decoded metadata, and each record batch as a dict of lists."""
    with pa.memory_map(str(path), "r") as source:
        reader = pa.ipc.open_file(source)
        schema = reader.schema
        batches = [reader.get_batch(i).to_pydict() for i in range(reader.num_record_batches)]
    return schema.remove_metadata(), json.loads(schema.metadata[METADATA_KEY]), batches


def write_rows(path: Path, schema: pa.Schema, metadata: dict, batches: list[dict[str, list]], *, rehash: bool) -> None:
    """Write batches as a plan file; ``rehash`` records a checksum matching the new rows."""
    records = [pa.RecordBatch.from_pydict(b, schema=schema) for b in batches]
    if rehash:
        metadata = {**metadata, "content_hash": content_hash(metadata, records)}
    encoded = {METADATA_KEY: json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode()}
    final = schema.with_metadata(encoded)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, final) as writer:
        for record in records:
            writer.write_batch(record.replace_schema_metadata(encoded))


def recount(metadata: dict, batches: list[dict[str, list]], lengths: np.ndarray) -> None:
    """Recompute every derived column from ``samples`` so that rows stay self-consistent."""
    world_size = metadata["world_size"]
    pad = metadata["mode"] == "pad"
    running = 0
    for epoch in range(metadata["epochs"]):
        rows = batches[epoch * world_size : (epoch + 1) * world_size]
        step_tokens: Counter = Counter()
        step_loss: Counter = Counter()
        for batch in rows:
            micro_count = Counter((r, s) for r, s in zip(batch["rank"], batch["step"]))
            for i, samples in enumerate(batch["samples"]):
                sizes = [int(lengths[s]) for s in samples]
                batch["tokens"][i] = sum(sizes)
                batch["loss_tokens"][i] = sum(n - 1 for n in sizes)
                if "padded_tokens" in batch:  # pad plans only
                    batch["padded_tokens"][i] = len(sizes) * max(sizes, default=0) if pad else sum(sizes)
                batch["num_micro"][i] = micro_count[(batch["rank"][i], batch["step"][i])]
                step_tokens[batch["step"][i]] += batch["tokens"][i]
                step_loss[batch["step"][i]] += batch["loss_tokens"][i]
        before = {}
        for step in sorted(step_tokens):
            before[step] = running
            running += step_tokens[step]
        for batch in rows:
            for i, step in enumerate(batch["step"]):
                batch["step_tokens"][i] = step_tokens[step]
                batch["step_loss_tokens"][i] = step_loss[step]
                batch["tokens_before_step"][i] = before[step]


def reported(path: Path, lengths: np.ndarray) -> set[str]:
    return {v.guarantee for v in check_plan(open_plan(path), lengths)}


def load(lengths: np.ndarray, samples: list[int], mode: str) -> int:
    sizes = [int(lengths[s]) for s in samples]
    return sum(sizes) if mode == "pack" else len(sizes) * max(sizes, default=0)


@pytest.fixture(params=["pack", "pad"])
def good(request, write_built_plan, small_lengths, tmp_path):
    """A sound plan of 400 samples: 2 ranks, 2 micro-batches per step, 2 epochs."""
    config = PlanConfig(max_tokens=1024, mode=request.param, world_size=2, micro_batches=2, epochs=2)
    path, _ = write_built_plan(small_lengths, config)
    schema, metadata, batches = read_rows(path)
    return {
        "path": path,
        "schema": schema,
        "metadata": metadata,
        "batches": batches,
        "lengths": small_lengths,
        "config": config,
        "broken": tmp_path / "broken.arrow",
    }


def forge(good, batches=None, metadata=None, *, rehash=True, count=True) -> Path:
    metadata = good["metadata"] if metadata is None else metadata
    batches = good["batches"] if batches is None else batches
    if count:
        recount(metadata, batches, good["lengths"])
    write_rows(good["broken"], good["schema"], metadata, batches, rehash=rehash)
    return good["broken"]


# --------------------------------------------------------------------------- the sound plan


def test_good_plan_and_its_rewrite_have_no_violations(good):
    assert check_plan(open_plan(good["path"]), good["lengths"]) == []
    path = forge(good)  # the rewriting helpers alone break nothing
    assert check_plan(open_plan(path), good["lengths"]) == []
    assert ref.check_guarantees(path, good["lengths"]) == []


# --------------------------------------------------------------------------- one defect each


def test_duplicated_sample_is_a_coverage_violation(good):
    """A sample of one row is added to another row of the same epoch where it still fits."""
    lengths, mode = good["lengths"], good["config"].mode
    epoch0 = good["batches"][:2]
    rows = [(batch, i) for batch in epoch0 for i in range(len(batch["samples"]))]
    everything = sorted((s for batch in epoch0 for row in batch["samples"] for s in row), key=lambda s: lengths[s])
    batch, row, extra = next(
        (batch, i, s)
        for s in everything
        for batch, i in rows
        if s not in batch["samples"][i] and load(lengths, batch["samples"][i] + [s], mode) <= 1024
    )
    batch["samples"][row].append(extra)
    path = forge(good)
    assert reported(path, lengths) == {"coverage"}
    assert any("[coverage]" in p for p in ref.check_guarantees(path, lengths))


def test_missing_sample_is_a_coverage_violation(good):
    row = next(i for i, samples in enumerate(good["batches"][0]["samples"]) if len(samples) > 1)
    good["batches"][0]["samples"][row].pop()
    path = forge(good)
    assert reported(path, good["lengths"]) == {"coverage"}


def test_over_cap_micro_batch_is_a_max_tokens_violation(good):
    lengths, mode, batches = good["lengths"], good["config"].mode, good["batches"]
    target, donor = batches[0], batches[1]
    row = max(range(len(target["samples"])), key=lambda i: load(lengths, target["samples"][i], mode))
    source = next(i for i, samples in enumerate(donor["samples"]) if len(samples) > 1)
    moved = max(donor["samples"][source], key=lambda s: lengths[s])
    assert load(lengths, target["samples"][row] + [moved], mode) > 1024
    donor["samples"][source].remove(moved)
    target["samples"][row].append(moved)
    path = forge(good)
    assert reported(path, lengths) == {"max_tokens"}
    assert any("[max_tokens]" in p for p in ref.check_guarantees(path, lengths))


def test_unequal_micro_counts_are_an_equal_micro_batches_violation(good):
    """Rank 1's last micro-batch of epoch 0 moves to rank 0, in the same step."""
    rank0, rank1 = good["batches"][0], good["batches"][1]
    step = rank1["step"][-1]
    row = {name: values.pop() for name, values in rank1.items()}
    row["rank"] = 0
    row["micro"] = sum(1 for s in rank0["step"] if s == step)
    for name, value in row.items():
        rank0[name].append(value)
    path = forge(good)
    assert reported(path, good["lengths"]) == {"equal_micro_batches"}
    assert any("[equal_micro_batches]" in p for p in ref.check_guarantees(path, good["lengths"]))


@pytest.mark.parametrize("ranks", ["every rank", "one rank"])
def test_wrong_step_loss_tokens_is_a_counts_violation(good, ranks):
    recount(good["metadata"], good["batches"], good["lengths"])
    targets = good["batches"][:2] if ranks == "every rank" else good["batches"][1:2]
    for batch in targets:
        batch["step_loss_tokens"] = [n + (s == 0) for n, s in zip(batch["step_loss_tokens"], batch["step"])]
    path = forge(good, count=False)
    assert reported(path, good["lengths"]) == {"counts"}
    assert any("[loss_normaliser]" in p for p in ref.check_guarantees(path, good["lengths"]))


def test_row_loss_tokens_off_its_samples_is_a_counts_violation(good):
    """One row claims a loss token too many; its step's normaliser agrees with the rows."""
    recount(good["metadata"], good["batches"], good["lengths"])
    epoch1_rank0, epoch1_rank1 = good["batches"][2], good["batches"][3]
    epoch1_rank0["loss_tokens"][0] += 1
    step = epoch1_rank0["step"][0]
    for batch in (epoch1_rank0, epoch1_rank1):
        batch["step_loss_tokens"] = [n + (s == step) for n, s in zip(batch["step_loss_tokens"], batch["step"])]
    path = forge(good, count=False)
    assert reported(path, good["lengths"]) == {"counts"}
    assert any("[counts]" in p for p in ref.check_guarantees(path, good["lengths"]))


def test_sample_outside_the_dataset_is_an_integrity_violation(good):
    good["batches"][0]["samples"][0][0] = good["lengths"].shape[0]
    path = forge(good, count=False)
    assert "integrity" in reported(path, good["lengths"])


def test_sample_listed_dropped_for_a_false_reason_is_a_coverage_violation(good):
    planned = good["batches"][0]["samples"][0][0]
    metadata = {**good["metadata"], "dropped": {"empty": [planned]}}
    path = forge(good, metadata=metadata)
    assert reported(path, good["lengths"]) == {"coverage"}


def test_sample_listed_under_drop_last_without_drop_last_is_a_coverage_violation(good):
    assert not good["config"].drop_last
    row = next(i for i, samples in enumerate(good["batches"][0]["samples"]) if len(samples) > 1)
    missing = good["batches"][0]["samples"][row].pop()
    metadata = {**good["metadata"], "dropped": {"drop_last": {"0": [missing]}}}
    path = forge(good, metadata=metadata)
    assert any("[dropped]" in p for p in ref.check_guarantees(path, good["lengths"]))
    assert reported(path, good["lengths"]) == {"coverage"}


def test_plan_checked_against_other_data_is_a_dataset_violation(good):
    path = good["path"]
    assert reported(path, good["lengths"] + 1) == {"dataset"}
    assert reported(path, good["lengths"][:-1]) == {"dataset"}


def test_tampered_rows_without_a_new_checksum_fail_integrity(good):
    good["batches"][0]["samples"][0].pop()
    path = forge(good, rehash=False)
    assert reported(path, good["lengths"]) == {"integrity", "coverage"}


def test_overlapping_pieces_are_a_coverage_violation(write_built_plan, tmp_path):
    lengths = np.array([2500, 40, 900, 300, 77, 1100], dtype=np.int32)
    config = PlanConfig(max_tokens=1024, oversize="split")
    path, _ = write_built_plan(lengths, config)
    schema, metadata, batches = read_rows(path)
    batch = batches[0]
    row, index = next((r, i) for r, starts in enumerate(batch["starts"]) for i, start in enumerate(starts) if start > 0)
    batch["starts"][row][index] -= 1  # now overlaps the piece before it
    broken = tmp_path / "broken.arrow"
    write_rows(broken, schema, metadata, batches, rehash=True)
    assert reported(broken, lengths) == {"coverage"}
    assert any("[coverage]" in p for p in ref.check_guarantees(broken, lengths))


def test_sample_planned_three_times_is_named_with_its_count(good):
    """The checks count a sample into one byte saturating at two; the message still names
    the exact count."""
    lengths, mode = good["lengths"], good["config"].mode
    rows = [(batch, i) for batch in good["batches"][:2] for i in range(len(batch["samples"]))]
    extra = min((s for batch, i in rows for s in batch["samples"][i]), key=lambda s: lengths[s])
    hosts = [
        (batch, i)
        for batch, i in rows
        if extra not in batch["samples"][i] and load(lengths, batch["samples"][i] + [extra], mode) <= 1024
    ][:2]
    for batch, i in hosts:
        batch["samples"][i].append(extra)
    path = forge(good)
    messages = [str(v) for v in check_plan(open_plan(path), lengths)]
    assert messages == [
        f"[coverage] epoch 0: 1 samples are not planned exactly once (sample {extra:,} appears 3 times)"
    ]


def test_piece_beside_its_whole_sample_is_an_overlap(write_built_plan, tmp_path):
    """A sample planned whole gets a second, partial entry: the checks sort it with the
    sample's whole entry and find the overlap."""
    lengths = np.array([2500, 40, 900, 300, 77, 1100], dtype=np.int32)
    path, _ = write_built_plan(lengths, PlanConfig(max_tokens=1024, oversize="split"))
    schema, metadata, batches = read_rows(path)
    batch = batches[0]
    row = next(r for r, samples in enumerate(batch["samples"]) if 1 in samples)
    batch["samples"][row].append(1)  # sample 1 (40 tokens) is planned whole; now also [10, 15)
    batch["starts"][row].append(10)
    batch["lengths"][row].append(5)
    broken = tmp_path / "broken.arrow"
    write_rows(broken, schema, metadata, batches, rehash=True)
    overlap = "[coverage] epoch 0: two pieces of a sample overlap"
    assert overlap in [str(v) for v in check_plan(open_plan(broken), lengths)]
    assert overlap in [str(v) for v in check_plan(open_plan(broken))]


# --------------------------------------------------------------------------- bytes on disk


def flip(path: Path, position: int, out: Path) -> Path:
    data = bytearray(path.read_bytes())
    data[position] ^= 0x01
    out.write_bytes(bytes(data))
    return out


def buffer_position(path: Path, batch: int, column: str, *, list_values: bool = False) -> int:
    """File offset of a column's data buffer (list columns: offsets, or values) in one
    record batch, from the addresses of the zero-copy memory-mapped read."""
    with pa.memory_map(str(path), "r") as source:
        base = source.read_buffer(1).address
        array = pa.ipc.open_file(source).get_batch(batch).column(column)
        if list_values:
            array = array.values
        return array.buffers()[1].address - base  # buffer 0 is the validity bitmap


def test_flipped_byte_in_tokens_is_an_integrity_violation(good):
    path = flip(good["path"], buffer_position(good["path"], 0, "tokens") + 3, good["broken"])
    found = reported(path, good["lengths"])
    assert "integrity" in found and "counts" in found


def test_flipped_byte_in_samples_is_an_integrity_violation(good):
    path = flip(good["path"], buffer_position(good["path"], 0, "samples", list_values=True) + 40, good["broken"])
    found = reported(path, good["lengths"])
    assert "integrity" in found and "coverage" in found


def test_truncated_file_is_a_plan_format_error(good):
    data = good["path"].read_bytes()
    good["broken"].write_bytes(data[: len(data) // 2])
    with pytest.raises(PlanFormatError):
        open_plan(good["broken"])


def test_corrupt_list_offsets_are_reported_not_raised(good):
    data = good["path"].read_bytes()
    num_rows = len(good["batches"][0]["samples"])
    position = buffer_position(good["path"], 0, "samples") + 4 * (num_rows // 2)
    assert struct.unpack("<i", data[position : position + 4])[0] > 0
    broken = bytearray(data)
    broken[position : position + 4] = struct.pack("<i", 65_540)
    good["broken"].write_bytes(bytes(broken))
    try:
        found = reported(good["broken"], good["lengths"])
    except PlanFormatError:
        return
    assert "integrity" in found


def test_corrupt_message_header_is_a_plan_format_error(good):
    data = good["path"].read_bytes()
    # File: magic (8 bytes), then the schema message: continuation (4), length (4), body.
    (schema_length,) = struct.unpack("<i", data[12:16])
    first_batch = 16 + schema_length
    assert data[first_batch : first_batch + 4] == b"\xff\xff\xff\xff"
    path = flip(good["path"], first_batch, good["broken"])
    try:
        found = reported(path, good["lengths"])
    except PlanFormatError:
        return
    assert "integrity" in found


def test_metadata_without_a_required_key_is_a_plan_format_error(good):
    data = good["path"].read_bytes()
    assert b'"epochs":' in data  # top level and config, in the schema message and the footer
    good["broken"].write_bytes(data.replace(b'"epochs":', b'"epochz":'))
    with pytest.raises(PlanFormatError):
        open_plan(good["broken"])


def test_any_flipped_byte_is_refused_reported_as_integrity_or_changes_nothing(good):
    """Every 37th byte flipped in turn: opening or checking the plan raises a BatchPlanError
    (never another exception), or `check_plan` reports ``integrity`` (the checksum no longer
    matches), or the byte is one nothing reads (padding, the schema message's copy of the
    metadata): the file then reads back exactly as the sound one, rows and metadata."""
    data = good["path"].read_bytes()
    sound = read_rows(good["path"])
    outcomes = Counter()
    for position in range(0, len(data), 37):
        path = flip(good["path"], position, good["broken"])
        try:
            found = {v.guarantee for v in check_plan(open_plan(path), good["lengths"])}
        except BatchPlanError:
            outcomes["refused"] += 1
            continue
        if found:
            assert "integrity" in found, (position, found)
            outcomes["reported"] += 1
        else:
            assert read_rows(path) == sound, f"byte {position} changed the plan and nothing was reported"
            outcomes["unchanged"] += 1
    assert outcomes["refused"] and outcomes["reported"], outcomes
