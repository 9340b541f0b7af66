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
import errno
import glob
import json
import os
import tempfile
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from batchplan.errors import PlanFormatError

if TYPE_CHECKING:
    from batchplan.plan import EpochPlan, Plan

__all__ = [
    "FORMAT_VERSION", "METADATA_KEY", "PlanFile", "open_plan", "padded_tokens_column", "plan_metadata", "write_plan",
]  # fmt: skip

# 2: pack plans have no padded_tokens column (in version 1 both modes have it). Readers
# take every version up to this one.
FORMAT_VERSION = 2
METADATA_KEY = b"batchplan"
REQUIRED_COLUMNS = (
    "epoch", "step", "rank", "micro", "samples", "tokens", "loss_tokens", "step_loss_tokens",
)  # fmt: skip
_INT32_LIMIT = 2**31
_REQUIRED_METADATA = {
    "num_samples": int, "world_size": int, "max_tokens": int, "mode": str, "epochs": int, "seed": int,
    "config": dict, "steps_per_epoch": list, "rows_per_rank": list, "dropped": dict, "content_hash": str,
}  # fmt: skip


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
    index = pa.int32() if num_samples < _INT32_LIMIT else pa.int64()
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
    encoded = None if metadata is None else {METADATA_KEY: _dump_json(metadata)}
    return pa.schema(fields, metadata=encoded)


def write_plan(
    plan: Plan,
    path: str | os.PathLike,
    *,
    dataset: dict[str, Any] | None = None,
    lengths_fingerprint: str | None = None,
    on_batch: Callable[[int], None] | None = None,
    lineage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``plan`` atomically to ``path``; return the metadata written.

    Args:
        plan: the plan to write.
        path: destination; its directory must exist. An existing file is replaced
            only once the new one is complete.
        dataset: description of the input (files, column), stored in the metadata.
        lengths_fingerprint: fingerprint of the input lengths (`fingerprint_lengths`).
        on_batch: called after each record batch is built (progress bars).
        lineage: for a plan continuing another (`batchplan.operations.reshard`): keys merged into
            the metadata. Its ``first_step`` and ``tokens_before_first_step`` shift the
            ``step`` and ``tokens_before_step`` columns, so they run on from the parent's.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise PlanFormatError(f"{path}: directory {path.parent} does not exist; create it first")
    batches = list(_record_batches(plan, on_batch))
    metadata = plan_metadata(plan, dataset=dataset, lengths_fingerprint=lengths_fingerprint, lineage=lineage)
    if lineage:
        shifts = {"step": lineage.get("first_step", 0),
                  "tokens_before_step": lineage.get("tokens_before_first_step", 0)}  # fmt: skip
        batches = [_shift_columns(batch, shifts) for batch in batches]
    # The hash covers the metadata and the values, not the file's bytes: it is computed
    # while the file is written (CRC and writes release the GIL), then written over a
    # placeholder of the same length. The bytes are those of writing the hash up front,
    # which is done instead when the placeholder's text occurs elsewhere in the metadata
    # (a caller's nested dict could hold it).
    metadata["content_hash"] = _HASH_PLACEHOLDER
    deferred = _dump_json(metadata).count(_placeholder_entry()) == 1
    if not deferred:
        metadata["content_hash"] = _content_hash(metadata, batches)
    schema = plan_schema(
        plan.num_samples, plan.entries.has_spans, metadata, has_cost=_has_cost(plan), has_padded=_has_padded(plan)
    )
    existed = path.exists()
    try:
        with _atomic_path(path) as temporary, ThreadPoolExecutor(max_workers=1) as hasher:
            hashing = hasher.submit(_content_hash, metadata, batches) if deferred else None
            with pa.OSFile(str(temporary), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
                for batch in batches:
                    writer.write_batch(batch.replace_schema_metadata(schema.metadata))
            if hashing is not None:
                metadata["content_hash"] = hashing.result()
                _replace_placeholder(temporary, metadata["content_hash"])
    except OSError as error:  # a full disk, a quota, permissions: the temporary is already removed
        raise _write_failed(path, error, existed) from error
    return metadata


def _write_failed(path: Path, error: OSError, existed: bool) -> OSError:
    """``error``, raised while writing ``path``, as one line: the path, what is left, the fix.
    Still an `OSError` with the same ``errno``; its text is the line alone."""
    reason = os.strerror(error.errno) if error.errno else str(error)
    left = f"the previous {path.name} is untouched" if existed else "nothing was written"
    fix = "choose another -o"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = f"free space on the disk holding {path.absolute().parent} or {fix}"
    failed = OSError(f"{path}: cannot write the plan ({reason}); {left}; {fix}")
    failed.errno = error.errno
    return failed


def plan_metadata(plan: Plan, *, dataset=None, lengths_fingerprint=None, lineage=None) -> dict[str, Any]:
    """The JSON metadata of a plan (everything but the content hash); ``lineage`` keys last."""
    from importlib.metadata import version

    from batchplan import __version__

    config = plan.config
    dropped: dict[str, Any] = {reason: samples.tolist() for reason, samples in plan.entries.dropped.items()}
    last = [e for e in plan.epochs if e.dropped_entries.size]
    if last:
        dropped["drop_last"] = {str(e.epoch): _dropped_samples(plan, e) for e in last}
        if plan.entries.has_spans:  # a split sample may lose only some of its pieces
            dropped["drop_last_spans"] = {str(e.epoch): _dropped_spans(plan, e) for e in last}
    metadata = {
        "format_version": FORMAT_VERSION,
        "num_samples": plan.num_samples,
        "num_entries": plan.entries.num_entries,
        "world_size": config.world_size,
        "max_tokens": config.max_tokens,
        "mode": config.mode,
        "epochs": config.epochs,
        "seed": config.seed,
        "config": config.to_dict(),
        "config_fingerprint": config.fingerprint(),
        "lengths_fingerprint": lengths_fingerprint,
        "dataset": dataset,
        "has_spans": plan.entries.has_spans,
        "hidden_size": config.hidden_size,
        "attention_coefficient": config.cost_coefficient,
        "steps_per_epoch": [e.num_steps for e in plan.epochs],
        "rows_per_rank": [e.rows_per_rank for e in plan.epochs],
        "dropped": dropped,
        "versions": {
            "batchplan": __version__,
            "numpy": np.__version__,
            "numba": version("numba"),  # from the installed metadata: numba itself is not loaded
            "pyarrow": pa.__version__,
        },
    }
    return {**metadata, **(lineage or {})}


def _shift_columns(batch: pa.RecordBatch, shifts: dict[str, int]) -> pa.RecordBatch:
    """``batch`` with ``shifts[name]`` added to each named int64 column."""
    for name, shift in shifts.items():
        if shift:
            index = batch.schema.get_field_index(name)
            shifted = pa.array(batch.column(index).to_numpy() + np.int64(shift), type=pa.int64())
            batch = batch.set_column(index, batch.schema.field(index), shifted)
    return batch


def _has_cost(plan: Plan) -> bool:
    return plan.config.cost_coefficient is not None


def _has_padded(plan: Plan) -> bool:
    return plan.config.mode == "pad"


def _dropped_samples(plan: Plan, epoch: EpochPlan) -> list[int]:
    return np.unique(plan.entries.samples_of(epoch.dropped_entries)).tolist()


def _dropped_spans(plan: Plan, epoch: EpochPlan) -> list[list[int]]:
    """``[sample, start, length]`` of each dropped entry, sorted."""
    entries = np.sort(epoch.dropped_entries)  # entries are numbered in (sample, start) order
    spans = np.stack([plan.entries.samples_of(entries), plan.entries.start[entries], plan.entries.length[entries]])
    return spans.T.tolist()


def _record_batches(plan: Plan, on_batch) -> Iterator[pa.RecordBatch]:
    schema = plan_schema(
        plan.num_samples, plan.entries.has_spans, has_cost=_has_cost(plan), has_padded=_has_padded(plan)
    )
    step_base = 0
    tokens_base = 0
    for epoch in plan.epochs:
        # shape (num_steps,): global tokens before each step, counting across epochs
        before = tokens_base + np.cumsum(epoch.step_tokens) - epoch.step_tokens
        shared = _shared_columns(schema, epoch, step_base, before)
        for rank in range(epoch.world_size):
            rows = slice(rank * epoch.rows_per_rank, (rank + 1) * epoch.rows_per_rank)
            yield _rank_batch(schema, plan, epoch, rank, rows, shared)
            if on_batch is not None:
                on_batch(epoch.epoch * epoch.world_size + rank)
        step_base += epoch.num_steps
        tokens_base += int(epoch.step_tokens.sum())


def _shared_columns(schema, epoch: EpochPlan, step_base: int, before) -> dict[str, pa.Array]:
    """The columns every rank of an epoch has alike (the same step sequence), built once."""
    local_step = epoch.rank_step
    columns = {
        "epoch": np.full(local_step.shape[0], epoch.epoch, dtype=np.int32),
        "step": local_step + step_base,
        "micro": epoch.rank_micro,
        "num_micro": epoch.rank_num_micro,
        "step_tokens": epoch.step_tokens[local_step],
        "step_loss_tokens": epoch.step_loss_tokens[local_step],
        "tokens_before_step": before[local_step],
    }
    return {name: pa.array(values, type=schema.field(name).type) for name, values in columns.items()}


def _rank_batch(schema, plan, epoch: EpochPlan, rank: int, rows: slice, shared) -> pa.RecordBatch:
    offsets = epoch.offsets[rows.start : rows.stop + 1]
    members = epoch.members[offsets[0] : offsets[-1]]
    list_offsets = offsets - offsets[0]
    if list_offsets[-1] >= _INT32_LIMIT:
        raise PlanFormatError("one rank's epoch holds more than 2^31 entries; raise world_size")
    list_offsets = pa.array(list_offsets.astype(np.int32))
    columns = {
        "rank": np.full(rows.stop - rows.start, rank, dtype=np.int32),
        "samples": _list_array(list_offsets, plan.entries.samples_of(members), schema.field("samples").type),
        "tokens": epoch.tokens[rows],
        "loss_tokens": epoch.loss_tokens[rows],
    }
    if "padded_tokens" in schema.names:
        columns["padded_tokens"] = epoch.padded_tokens[rows]
    if epoch.cost is not None:
        columns["cost"] = epoch.cost[rows]
    if plan.entries.has_spans:
        columns["starts"] = _list_array(list_offsets, plan.entries.start[members], schema.field("starts").type)
        columns["lengths"] = _list_array(list_offsets, plan.entries.length[members], schema.field("lengths").type)
    arrays = [
        shared[f.name] if f.name in shared else columns[f.name] if pa.types.is_list(f.type)
        else pa.array(columns[f.name], type=f.type) for f in schema
    ]  # fmt: skip
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _list_array(offsets: pa.Array, values: NDArray, list_type: pa.ListType) -> pa.ListArray:
    """Of exactly the schema's type (non-null items): a `RecordBatch` of other types would be
    cast, which imports ``pyarrow.compute`` (~45 ms)."""
    return pa.ListArray.from_arrays(offsets, pa.array(values, type=list_type.value_type), type=list_type)


def _content_hash(metadata: dict[str, Any], batches) -> str:
    """CRC-32 over the metadata (less this hash) and the values of every column, in order.

    A checksum against corruption, not a signature: CRC-32 runs at ~4 GB/s, so a plan
    of 16 M samples verifies in a fraction of a second.
    """
    crc = zlib.crc32(_dump_json({k: v for k, v in metadata.items() if k != "content_hash"}))
    for batch in batches:
        for column in batch.columns:
            if pa.types.is_list(column.type):
                offsets = column.offsets.to_numpy()
                crc = zlib.crc32((offsets - offsets[0]).astype("<i8").data, crc)
                values = column.values.slice(offsets[0], offsets[-1] - offsets[0])
                crc = zlib.crc32(np.ascontiguousarray(values.to_numpy()).data, crc)
            else:
                crc = zlib.crc32(np.ascontiguousarray(column.to_numpy()).data, crc)
    return f"crc32:{crc:08x}"


# Not a possible CRC (not hex), as long as one: found only where it was put.
_HASH_PLACEHOLDER = "crc32:????????"


def _placeholder_entry() -> bytes:
    """The placeholder as it stands in the metadata's JSON: ``"content_hash":"crc32:????????"``."""
    return _dump_json({"content_hash": _HASH_PLACEHOLDER})[1:-1]


def _replace_placeholder(path: Path, content_hash: str) -> None:
    """Write ``content_hash`` over the placeholder in the schema's two copies in an Arrow
    IPC file: the schema message after the leading magic, and the footer before the
    trailing one (their lengths are in the file; only those two messages are read)."""
    placeholder = _placeholder_entry()
    replacement = _dump_json({"content_hash": content_hash})[1:-1]
    if len(replacement) != len(placeholder):
        raise AssertionError(f"content hash {content_hash!r} is not as long as its placeholder")
    with open(path, "rb+") as file:
        size = os.fstat(file.fileno()).st_size
        # "ARROW1\0\0", then the schema message: 0xFFFFFFFF, its length, the flatbuffer.
        header = os.pread(file.fileno(), 16, 8)
        schema_at, schema_length = 16, int.from_bytes(header[4:8], "little")
        # The footer (a flatbuffer holding the schema again), its length, then "ARROW1".
        footer_length = int.from_bytes(os.pread(file.fileno(), 4, size - 10), "little")
        footer_at = size - 10 - footer_length
        for start, length in ((schema_at, schema_length), (footer_at, footer_length)):
            message = os.pread(file.fileno(), length, start)
            if message.count(placeholder) != 1:
                raise AssertionError(f"{path}: the content-hash placeholder is not where the Arrow format puts it")
            os.pwrite(file.fileno(), replacement, start + message.index(placeholder))


@contextlib.contextmanager
def _atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path``, renamed onto it on success, removed on failure."""
    _remove_stale_temporaries(path)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    os.close(handle)
    temporary = Path(name)
    try:
        yield temporary
        with open(temporary, "rb+") as written:
            os.fsync(written.fileno())
        os.chmod(temporary, 0o666 & ~_current_umask())  # mkstemp made it 0600
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _remove_stale_temporaries(path: Path) -> None:
    """Delete temporaries of earlier writes to ``path`` whose process is gone (a kill -9)."""
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = stale.name[len(path.name) + 2 :].split(".", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            stale.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _dump_json(metadata: dict[str, Any]) -> bytes:
    return json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode()


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
            found = _content_hash(self.metadata, batches)
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
        has_padded = self.metadata["mode"] == "pad"  # pack plans of earlier versions have it too: allowed
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
