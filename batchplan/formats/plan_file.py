"""The plan file: Arrow IPC (file format), one record batch per (epoch, rank).

Batch ``epoch * world_size + rank`` holds that rank's micro-batches of that epoch in
(step, micro) order, so a rank reads only its rows, through a memory map, in O(its
rows). Schema metadata key ``batchplan`` holds JSON: format version, config, input
fingerprint, what was dropped and why, versions, and a checksum of the content
that `PlanFile.verify` recomputes. Files are written to a temporary name and renamed, so
an interrupted or failed write (a full disk) never leaves a partial plan and leaves the
previous file as it was; opening a file cut short says so. See docs/plan-format.md.

This module never imports numba: the runtime reads plans through it.
"""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from batchplan.errors import PlanFormatError
from batchplan.formats.arrow import arrow_array, numpy_of

__all__ = [
    "FORMAT_VERSION", "METADATA_KEY", "OpenedPlan", "PlanFile", "content_hash", "padded_tokens_column",
    "plan_schema",
]  # fmt: skip

# 2: pack plans have no padded_tokens column (in version 1 both modes have it). Readers
# take every version up to this one.
FORMAT_VERSION = 2
METADATA_KEY = b"batchplan"
REQUIRED_COLUMNS = (
    "epoch", "step", "rank", "micro", "samples", "tokens", "loss_tokens", "step_loss_tokens",
)  # fmt: skip
INT32_LIMIT = 2**31
_REQUIRED_METADATA = {
    "num_samples": int, "world_size": int, "max_tokens": int, "mode": str, "epochs": int, "seed": int,
    "config": dict, "steps_per_epoch": list, "rows_per_rank": list, "dropped": dict, "content_hash": str,
}  # fmt: skip


def content_hash(metadata: dict[str, Any], batches) -> str:
    """CRC-32 over the metadata (less this hash) and the values of every column, in order.

    A checksum against corruption, not a signature: CRC-32 runs at ~4 GB/s, so a plan
    of 16 M samples verifies in a fraction of a second.
    """
    crc = metadata_crc(metadata)
    for batch in batches:
        crc = batch_crc(batch, crc)
    return hash_text(crc)


def metadata_crc(metadata: dict[str, Any]) -> int:
    """The content hash's start: the CRC-32 of the metadata less ``content_hash``."""
    return zlib.crc32(dump_json({k: v for k, v in metadata.items() if k != "content_hash"}))


# The key of a record batch's custom metadata holding the checksum of its values.
BATCH_CRC_KEY = "batchplan_crc"


def batch_crc(batch: pa.RecordBatch, crc: int) -> int:
    """``crc`` continued over the values of every column of ``batch``."""
    for column in batch.columns:
        if pa.types.is_list(column.type):
            offsets = numpy_of(column.offsets)
            crc = zlib.crc32((offsets - offsets[0]).astype("<i8").data, crc)
            values = column.values.slice(offsets[0], offsets[-1] - offsets[0])
            crc = zlib.crc32(np.ascontiguousarray(numpy_of(values)).data, crc)
        else:
            crc = zlib.crc32(np.ascontiguousarray(numpy_of(column)).data, crc)
    return crc


def hash_text(crc: int) -> str:
    return f"crc32:{crc:08x}"


def dump_json(metadata: dict[str, Any]) -> bytes:
    return json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode()


def plan_schema(
    num_samples: int,
    has_spans: bool,
    metadata: dict[str, Any] | None = None,
    *,
    has_cost: bool = False,
    has_padded: bool = True,
    has_source: bool = False,
) -> pa.Schema:
    """The schema of a plan; ``samples`` holds int32 below 2^31 samples, else int64.
    ``padded_tokens`` is written in pad mode only (pack mode: it would equal ``tokens``);
    ``source`` in a mixture's plan only (each micro-batch's source, -1 when empty)."""
    index = pa.int32() if num_samples < INT32_LIMIT else pa.int64()
    fields = [
        pa.field("epoch", pa.int32(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("micro", pa.int32(), nullable=False),
        pa.field("num_micro", pa.int32(), nullable=False),
        pa.field("samples", pa.list_(pa.field("item", index, nullable=False)), nullable=False),
        pa.field("tokens", pa.int64(), nullable=False),
        pa.field("loss_tokens", pa.int64(), nullable=False),
        pa.field("padded_tokens", pa.int64(), nullable=False),
        pa.field("step_tokens", pa.int64(), nullable=False),
        pa.field("step_loss_tokens", pa.int64(), nullable=False),
        pa.field("tokens_before_step", pa.int64(), nullable=False),
    ]
    if not has_padded:
        fields = [field for field in fields if field.name != "padded_tokens"]
    if has_cost:
        fields.append(pa.field("cost", pa.float64(), nullable=False))
    if has_source:
        fields.append(pa.field("source", pa.int16(), nullable=False))
    if has_spans:
        fields.append(pa.field("starts", pa.list_(pa.field("item", pa.int64(), nullable=False)), nullable=False))
        fields.append(pa.field("lengths", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False))
    encoded = None if metadata is None else {METADATA_KEY: dump_json(metadata)}
    return pa.schema(fields, metadata=encoded)


class OpenedPlan:
    """An opened plan, whatever its layout: a `PlanFile`, or a plan directory
    (`batchplan.formats.plan_directory.PlanDirectory`).

    Attributes:
        path: the file or directory.
        metadata: the decoded ``batchplan`` metadata (a directory's manifest).
    """

    path: Path
    metadata: dict[str, Any]

    @property
    def schema(self) -> pa.Schema:
        raise NotImplementedError

    @property
    def world_size(self) -> int:
        return int(self.metadata["world_size"])

    @property
    def num_epochs(self) -> int:
        return int(self.metadata["epochs"])

    @property
    def num_samples(self) -> int:
        return int(self.metadata["num_samples"])

    @property
    def num_steps(self) -> int:
        return int(sum(self.metadata["steps_per_epoch"]))

    def read_rank(self, epoch: int, rank: int, *, checked: bool = True) -> pa.RecordBatch:
        """This rank's micro-batches of this epoch, in (step, micro) order; ``checked``: against
        the checksum of its rows (`read_batch`); `batchplan validate`, which checks the whole
        plan's, reads on without it so as to report what else a damaged plan breaks."""
        raise NotImplementedError

    def read_epoch(self, epoch: int) -> pa.Table:
        """Every rank's micro-batches of one epoch, rank-major."""
        return pa.Table.from_batches([self.read_rank(epoch, r) for r in range(self.world_size)], self.schema)

    def verify(self) -> None:
        """Recompute the content hash(es); raise `PlanFormatError` if the plan was altered."""
        raise NotImplementedError


class PlanFile(OpenedPlan):
    """A plan file opened by memory map; reading one rank's epoch touches only its rows."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._reader = open_arrow(self.path)
        with unreadable_schema(self.path):
            self.metadata = read_metadata(self._reader, self.path)
            if self.metadata.get("layout") == "epoch":
                raise PlanFormatError(
                    f"{self.path}: one epoch's file of a plan directory; open the directory {self.path.parent}"
                )
            check_metadata(self.metadata, self.path)
            check_columns(self.schema, self.metadata, self.path)
        why = f" (epochs {self.num_epochs} x world_size {self.world_size})"
        check_batch_count(self._reader, self.num_epochs * self.world_size, self.path, why)

    @property
    def schema(self) -> pa.Schema:
        return self._reader.schema

    def read_rank(self, epoch: int, rank: int, *, checked: bool = True) -> pa.RecordBatch:
        """This rank's micro-batches of this epoch, in (step, micro) order (`OpenedPlan.read_rank`)."""
        check_epoch_rank(self, epoch, rank)
        what = f"epoch {epoch} rank {rank}"
        return read_batch(self._reader, epoch * self.world_size + rank, self.path, what, checked=checked)

    def read_all(self) -> pa.Table:
        """The whole plan as one table (epoch-major, then rank)."""
        try:
            table = self._reader.read_all()
            table.validate(full=True)  # see read_batch
            return table
        except (pa.ArrowException, OSError) as error:
            message = f"{self.path}: cannot read the plan ({error}); the file is corrupt, rebuild it"
            raise PlanFormatError(message) from error

    def verify(self) -> None:
        """Recompute the content hash; raise `PlanFormatError` if the file was altered."""
        verify_batches(self._reader, self.metadata, self.path)


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


def decode_metadata(raw: bytes, path: Path) -> dict[str, Any]:
    """JSON metadata of a plan (a file's, or a plan directory's manifest) of a readable format version."""
    try:
        metadata = json.loads(raw)
    except ValueError as error:
        raise PlanFormatError(f"{path}: batchplan metadata is not valid JSON ({error})") from error
    version = metadata.get("format_version") if isinstance(metadata, dict) else None
    if not isinstance(version, int):
        raise PlanFormatError(f"{path}: batchplan metadata has no format_version")
    if version > FORMAT_VERSION:
        raise PlanFormatError(
            f"{path}: plan format version {version} is newer than this batchplan "
            f"reads ({FORMAT_VERSION}); upgrade batchplan"
        )
    return metadata


def check_metadata(metadata: dict[str, Any], path: Path) -> None:
    """The keys every plan's metadata has, with their types."""
    for key, kind in _REQUIRED_METADATA.items():
        if not isinstance(metadata.get(key), kind) or isinstance(metadata.get(key), bool) and kind is int:
            raise PlanFormatError(
                f"{path}: batchplan metadata key {key!r} is missing or not a {kind.__name__}; "
                "the plan is corrupt, rebuild it"
            )
    epochs = metadata["epochs"]
    if len(metadata["steps_per_epoch"]) != epochs or len(metadata["rows_per_rank"]) != epochs:
        raise PlanFormatError(f"{path}: metadata describes {epochs} epochs inconsistently; rebuild it")


def expected_schema(metadata: dict[str, Any]) -> pa.Schema:
    """The columns a plan with this metadata has (without schema metadata)."""
    has_cost = metadata.get("attention_coefficient") is not None
    has_padded = metadata["mode"] == "pad"  # format-version-1 pack plans have it too: allowed
    return plan_schema(int(metadata["num_samples"]), bool(metadata.get("has_spans")), has_cost=has_cost,
                       has_padded=has_padded, has_source=metadata.get("mixture") is not None)  # fmt: skip


def check_columns(schema: pa.Schema, metadata: dict[str, Any], path: Path) -> None:
    """Every column of this format version, with its type; more columns are allowed."""
    missing = [name for name in REQUIRED_COLUMNS if name not in schema.names]
    if missing:
        raise PlanFormatError(f"{path}: required column(s) {missing} missing; not a valid plan")
    for field in expected_schema(metadata):
        found = schema.field(field.name).type if field.name in schema.names else None
        if found != field.type:
            raise PlanFormatError(
                f"{path}: column {field.name!r} is {found or 'missing'}, expected {field.type}; "
                "the plan is corrupt or not from batchplan, rebuild it"
            )


def check_batch_count(reader: pa.ipc.RecordBatchFileReader, expected: int, path: Path, why: str = "") -> None:
    if reader.num_record_batches != expected:
        raise PlanFormatError(f"{path}: {reader.num_record_batches} record batches, expected {expected}{why}")


def check_epoch_rank(plan, epoch: int, rank: int) -> None:
    """An epoch and a rank of ``plan``, or a `PlanFormatError`."""
    if not 0 <= epoch < plan.num_epochs:
        raise PlanFormatError(f"{plan.path}: epoch {epoch} is outside the plan's 0..{plan.num_epochs - 1}")
    if not 0 <= rank < plan.world_size:
        raise PlanFormatError(f"{plan.path}: rank {rank} is outside the plan's 0..{plan.world_size - 1}")


def read_batch(
    reader: pa.ipc.RecordBatchFileReader, index: int, path: Path, what: str, *, checked: bool = True
) -> pa.RecordBatch:
    """Record batch ``index``, fully validated, and checked against its own checksum. pyarrow
    reads a batch without checking its list offsets against its buffers, and using a corrupt
    one can crash the process; each batch carries the CRC-32 of its values in its message's
    custom metadata (`BATCH_CRC_KEY`, written by `batchplan.formats.plan_writer`), so a
    changed byte in a rank's rows is found by the rank that reads them. Both cost O(the
    batch's rows). A batch without the key (a plan from an earlier batchplan), or read with
    ``checked`` False, is read as is."""
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


def batch_checksum(batch: pa.RecordBatch) -> str:
    """The checksum a record batch carries (`BATCH_CRC_KEY`): ``crc32:`` and the CRC-32 of its
    values (`batch_crc` from 0)."""
    return hash_text(batch_crc(batch, 0))


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


_ARROW_MAGIC = b"ARROW1"
# "ARROW1" padded to 8 bytes, then (at the end) the footer's length (4 bytes) and "ARROW1".
_SMALLEST_ARROW_FILE = 8 + 4 + len(_ARROW_MAGIC)


def _unopenable(path: Path, error: Exception) -> PlanFormatError:
    """Why pyarrow could not open ``path``: cut short (it begins as an Arrow IPC file does
    but lacks the footer that ends one), damaged, or not Arrow IPC at all."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            head = file.read(len(_ARROW_MAGIC))
            file.seek(max(size - len(_ARROW_MAGIC), 0))
            tail = file.read()
    except OSError:  # unreadable (a directory, no permission): pyarrow's reason is the one
        return PlanFormatError(f"{path}: not a batchplan plan (not an Arrow IPC file: {error})")
    if size == 0:
        return PlanFormatError(f"{path}: the file is empty: the plan is truncated or incomplete; rebuild it")
    if not _ARROW_MAGIC.startswith(head):
        return PlanFormatError(f"{path}: not a batchplan plan (not an Arrow IPC file: {error})")
    if size < _SMALLEST_ARROW_FILE or tail != _ARROW_MAGIC:
        return PlanFormatError(
            f"{path}: expected an Arrow IPC file ending with its footer, found {size:,} bytes without one: "
            "the plan is truncated or incomplete; rebuild it (or copy it again, if a copy was cut short)"
        )
    return PlanFormatError(f"{path}: the Arrow IPC footer is unreadable ({error}); the file is corrupt, rebuild it")


def padded_tokens_column(rows: pa.RecordBatch | pa.Table) -> pa.Array | pa.ChunkedArray:
    """Rows' ``padded_tokens``: pack plans leave the column out (format version 2), and
    there it equals ``tokens`` (no padding)."""
    return rows.column("padded_tokens" if "padded_tokens" in rows.schema.names else "tokens")


def shift_columns(batch: pa.RecordBatch, shifts: dict[str, int]) -> pa.RecordBatch:
    """``batch`` with ``shifts[name]`` added to each named int64 column."""
    for name, shift in shifts.items():
        if shift:
            index = batch.schema.get_field_index(name)
            shifted = arrow_array(numpy_of(batch.column(index)) + np.int64(shift), pa.int64())
            batch = batch.set_column(index, batch.schema.field(index), shifted)
    return batch
