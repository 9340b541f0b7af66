"""Reading a plan's Arrow IPC files: opening by memory map, the metadata, record batches
validated and checked against their checksums, and every pyarrow error as a one-line
`PlanFormatError` with the file's path. A plan file and a plan directory's epoch files are
read through these alike (`batchplan.formats.plan_file`, `batchplan.formats.plan_directory`).

pyarrow reads a record batch without checking its list offsets against its buffers, and
using a corrupt one can crash the process: `read_batch` validates each batch fully and
checks it against the CRC-32 it carries, O(the batch's rows) both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from batchplan.errors import PlanFormatError
from batchplan.formats.arrow import arrow_array, numpy_of
from batchplan.formats.arrow_layout import ARROW_MAGIC, SMALLEST_ARROW_FILE
from batchplan.formats.plan_format import BATCH_CRC_KEY, METADATA_KEY, batch_checksum, content_hash, decode_metadata

__all__ = [
    "check_batch_count",
    "open_arrow",
    "read_batch",
    "read_metadata",
    "shift_columns",
    "unreadable_schema",
    "verify_batches",
]


def open_arrow(path: Path) -> pa.ipc.RecordBatchFileReader:
    """``path`` opened as an Arrow IPC file by memory map, or a `PlanFormatError` saying why not."""
    try:
        return pa.ipc.open_file(pa.memory_map(str(path), "r"))
    except FileNotFoundError as error:
        raise PlanFormatError(f"{path}: no such plan file") from error
    except (pa.ArrowException, OSError) as error:
        raise _unopenable(path, error) from error


@contextlib.contextmanager
def unreadable_schema(path: Path) -> Iterator[None]:
    """A damaged schema or metadata (a flipped byte in a name, a wrong type) as a `PlanFormatError`."""
    try:
        yield
    except (pa.ArrowException, UnicodeDecodeError, ValueError, TypeError, KeyError) as error:
        raise PlanFormatError(f"{path}: the plan's schema is unreadable ({error}); rebuild it") from error


def read_metadata(reader: pa.ipc.RecordBatchFileReader, path: Path) -> dict[str, Any]:
    """The ``batchplan`` metadata of an Arrow file: JSON of a format version this reads."""
    raw = (reader.schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise PlanFormatError(f"{path}: Arrow file without batchplan metadata; not a plan")
    return decode_metadata(raw, path)


def check_batch_count(reader: pa.ipc.RecordBatchFileReader, expected: int, path: Path, why: str = "") -> None:
    if reader.num_record_batches != expected:
        raise PlanFormatError(f"{path}: {reader.num_record_batches} record batches, expected {expected}{why}")


def read_batch(
    reader: pa.ipc.RecordBatchFileReader, index: int, path: Path, what: str, *, checked: bool = True
) -> pa.RecordBatch:
    """Record batch ``index``, fully validated, and checked against its own checksum
    (`BATCH_CRC_KEY`, written by `batchplan.formats.plan_writer`), so a changed byte in a rank's
    rows is found by the rank that reads them. A batch without the key (a plan from an earlier
    batchplan), or read with ``checked`` False, is read as is."""
    try:
        batch, custom = reader.get_batch_with_custom_metadata(index)
        batch.validate(full=True)
    except (pa.ArrowException, OSError) as error:
        message = f"{path}: cannot read {what} ({error}); the file is corrupt, rebuild it"
        raise PlanFormatError(message) from error
    recorded = None if custom is None or not checked else custom.get(BATCH_CRC_KEY.encode())
    if recorded is not None and recorded.decode(errors="replace") != batch_checksum(batch):
        raise PlanFormatError(
            f"{path}: {what} does not match the recorded checksum of its rows ({batch_checksum(batch)}, recorded "
            f"{recorded.decode(errors='replace')}); the file is corrupt, rebuild it"
        )
    return batch


def verify_batches(reader: pa.ipc.RecordBatchFileReader, metadata: dict[str, Any], path: Path) -> None:
    """Recompute the content hash of an Arrow plan file; a `PlanFormatError` if it differs."""
    batches = (read_batch(reader, i, path, f"record batch {i}") for i in range(reader.num_record_batches))
    try:
        found = content_hash(metadata, batches)
    except (pa.ArrowException, OSError, ValueError, IndexError) as error:
        raise PlanFormatError(f"{path}: the plan's rows are unreadable ({error}); rebuild it") from error
    if found != metadata.get("content_hash"):
        raise PlanFormatError(
            f"{path}: content hash {found} does not match the recorded "
            f"{metadata.get('content_hash')}; the file is corrupt, rebuild it"
        )


def shift_columns(batch: pa.RecordBatch, shifts: dict[str, int]) -> pa.RecordBatch:
    """``batch`` with ``shifts[name]`` added to each named int64 column."""
    for name, shift in shifts.items():
        if shift:
            index = batch.schema.get_field_index(name)
            shifted = arrow_array(numpy_of(batch.column(index)) + np.int64(shift), pa.int64())
            batch = batch.set_column(index, batch.schema.field(index), shifted)
    return batch


def _unopenable(path: Path, error: Exception) -> PlanFormatError:
    """Why pyarrow could not open ``path``: cut short (it begins as an Arrow IPC file does
    but lacks the footer that ends one), damaged, or not Arrow IPC at all."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            head = file.read(len(ARROW_MAGIC))
            file.seek(max(size - len(ARROW_MAGIC), 0))
            tail = file.read()
    except OSError:  # unreadable (a directory, no permission): pyarrow's reason is the one
        return PlanFormatError(f"{path}: not a batchplan plan (not an Arrow IPC file: {error})")
    if size == 0:
        return PlanFormatError(f"{path}: the file is empty: the plan is truncated or incomplete; rebuild it")
    if not ARROW_MAGIC.startswith(head):
        return PlanFormatError(f"{path}: not a batchplan plan (not an Arrow IPC file: {error})")
    if size < SMALLEST_ARROW_FILE or tail != ARROW_MAGIC:
        return PlanFormatError(
            f"{path}: expected an Arrow IPC file ending with its footer, found {size:,} bytes without one: "
            "the plan is truncated or incomplete; rebuild it (or copy it again, if a copy was cut short)"
        )
    return PlanFormatError(f"{path}: the Arrow IPC footer is unreadable ({error}); the file is corrupt, rebuild it")
