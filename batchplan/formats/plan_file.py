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

import json
import os
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from batchplan.errors import PlanFormatError
from batchplan.formats.arrow import numpy_of

if TYPE_CHECKING:
    pass

__all__ = [
    "FORMAT_VERSION", "METADATA_KEY", "PlanFile", "content_hash", "open_plan", "padded_tokens_column", "plan_schema",
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
    crc = zlib.crc32(dump_json({k: v for k, v in metadata.items() if k != "content_hash"}))
    for batch in batches:
        for column in batch.columns:
            if pa.types.is_list(column.type):
                offsets = numpy_of(column.offsets)
                crc = zlib.crc32((offsets - offsets[0]).astype("<i8").data, crc)
                values = column.values.slice(offsets[0], offsets[-1] - offsets[0])
                crc = zlib.crc32(np.ascontiguousarray(numpy_of(values)).data, crc)
            else:
                crc = zlib.crc32(np.ascontiguousarray(numpy_of(column)).data, crc)
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
) -> pa.Schema:
    """The schema of a plan; ``samples`` holds int32 below 2^31 samples, else int64.
    ``padded_tokens`` is written in pad mode only (pack mode: it would equal ``tokens``)."""
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
    if has_spans:
        fields.append(pa.field("starts", pa.list_(pa.field("item", pa.int64(), nullable=False)), nullable=False))
        fields.append(pa.field("lengths", pa.list_(pa.field("item", pa.int32(), nullable=False)), nullable=False))
    encoded = None if metadata is None else {METADATA_KEY: dump_json(metadata)}
    return pa.schema(fields, metadata=encoded)


class PlanFile:
    """A plan opened by memory map; reading one rank's epoch touches only its rows.

    Attributes:
        path: the file.
        metadata: the decoded ``batchplan`` metadata.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            self._source = pa.memory_map(str(self.path), "r")
            self._reader = pa.ipc.open_file(self._source)
        except FileNotFoundError as error:
            raise PlanFormatError(f"{self.path}: no such plan file") from error
        except (pa.ArrowException, OSError) as error:
            raise _unopenable(self.path, error) from error
        try:
            self.metadata = self._decode_metadata()
            self._check_schema()
        except (pa.ArrowException, UnicodeDecodeError, ValueError, TypeError, KeyError) as error:
            # A damaged schema or metadata (a flipped byte in a name, a wrong type).
            raise PlanFormatError(f"{self.path}: the plan's schema is unreadable ({error}); rebuild it") from error

    @property
    def schema(self) -> pa.Schema:
        return self._reader.schema

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

    def read_rank(self, epoch: int, rank: int) -> pa.RecordBatch:
        """This rank's micro-batches of this epoch, in (step, micro) order."""
        if not 0 <= epoch < self.num_epochs:
            raise PlanFormatError(f"{self.path}: epoch {epoch} is outside the plan's 0..{self.num_epochs - 1}")
        if not 0 <= rank < self.world_size:
            raise PlanFormatError(f"{self.path}: rank {rank} is outside the plan's 0..{self.world_size - 1}")
        return self._batch(epoch * self.world_size + rank, f"epoch {epoch} rank {rank}")

    def read_epoch(self, epoch: int) -> pa.Table:
        """Every rank's micro-batches of one epoch, rank-major."""
        return pa.Table.from_batches([self.read_rank(epoch, r) for r in range(self.world_size)], self.schema)

    def read_all(self) -> pa.Table:
        """The whole plan as one table (epoch-major, then rank)."""
        try:
            table = self._reader.read_all()
            table.validate(full=True)  # see _batch
            return table
        except (pa.ArrowException, OSError) as error:
            message = f"{self.path}: cannot read the plan ({error}); the file is corrupt, rebuild it"
            raise PlanFormatError(message) from error

    def verify(self) -> None:
        """Recompute the content hash; raise `PlanFormatError` if the file was altered."""
        batches = [self._batch(i, f"record batch {i}") for i in range(self._reader.num_record_batches)]
        try:
            found = content_hash(self.metadata, batches)
        except (pa.ArrowException, OSError, ValueError, IndexError) as error:
            raise PlanFormatError(f"{self.path}: the plan's rows are unreadable ({error}); rebuild it") from error
        if found != self.metadata.get("content_hash"):
            raise PlanFormatError(
                f"{self.path}: content hash {found} does not match the recorded "
                f"{self.metadata.get('content_hash')}; the file is corrupt, rebuild it"
            )

    def _batch(self, index: int, what: str) -> pa.RecordBatch:
        """Record batch ``index``, fully validated. pyarrow reads a batch without checking its
        list offsets against its buffers, and using a corrupt one can crash the process;
        validating costs O(the batch's rows)."""
        try:
            batch = self._reader.get_batch(index)
            batch.validate(full=True)
        except (pa.ArrowException, OSError) as error:
            message = f"{self.path}: cannot read {what} ({error}); the file is corrupt, rebuild it"
            raise PlanFormatError(message) from error
        return batch

    def _decode_metadata(self) -> dict[str, Any]:
        raw = (self._reader.schema.metadata or {}).get(METADATA_KEY)
        if raw is None:
            raise PlanFormatError(f"{self.path}: Arrow file without batchplan metadata; not a plan")
        try:
            metadata = json.loads(raw)
        except ValueError as error:
            raise PlanFormatError(f"{self.path}: batchplan metadata is not valid JSON ({error})") from error
        version = metadata.get("format_version") if isinstance(metadata, dict) else None
        if not isinstance(version, int):
            raise PlanFormatError(f"{self.path}: batchplan metadata has no format_version")
        if version > FORMAT_VERSION:
            raise PlanFormatError(
                f"{self.path}: plan format version {version} is newer than this batchplan "
                f"reads ({FORMAT_VERSION}); upgrade batchplan"
            )
        for key, kind in _REQUIRED_METADATA.items():
            if not isinstance(metadata.get(key), kind) or isinstance(metadata.get(key), bool) and kind is int:
                raise PlanFormatError(
                    f"{self.path}: batchplan metadata key {key!r} is missing or not a {kind.__name__}; "
                    "the plan is corrupt, rebuild it"
                )
        epochs = metadata["epochs"]
        if len(metadata["steps_per_epoch"]) != epochs or len(metadata["rows_per_rank"]) != epochs:
            raise PlanFormatError(f"{self.path}: metadata describes {epochs} epochs inconsistently; rebuild it")
        return metadata

    def _check_schema(self) -> None:
        missing = [name for name in REQUIRED_COLUMNS if name not in self.schema.names]
        if missing:
            raise PlanFormatError(f"{self.path}: required column(s) {missing} missing; not a valid plan")
        # Every column of this format version, with its type; more columns are allowed.
        has_cost = self.metadata.get("attention_coefficient") is not None
        has_padded = self.metadata["mode"] == "pad"  # format-version-1 pack plans have it too: allowed
        expected = plan_schema(
            self.num_samples, bool(self.metadata.get("has_spans")), has_cost=has_cost, has_padded=has_padded
        )
        for field in expected:
            found = self.schema.field(field.name).type if field.name in self.schema.names else None
            if found != field.type:
                raise PlanFormatError(
                    f"{self.path}: column {field.name!r} is {found or 'missing'}, expected {field.type}; "
                    "the plan is corrupt or not from batchplan, rebuild it"
                )
        expected = self.num_epochs * self.world_size
        if self._reader.num_record_batches != expected:
            raise PlanFormatError(
                f"{self.path}: {self._reader.num_record_batches} record batches, expected "
                f"{expected} (epochs {self.num_epochs} x world_size {self.world_size})"
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


def open_plan(path: str | os.PathLike) -> PlanFile:
    """Open a plan file by memory map (see `PlanFile`)."""
    return PlanFile(path)
