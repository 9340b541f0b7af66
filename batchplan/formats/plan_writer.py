"""Write a plan file: one record batch per (epoch, rank), the metadata, and a checksum
of the content, written atomically (`batchplan.formats.atomic`). The layout is in
`batchplan.formats.plan_file` and docs/plan-format.md."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from batchplan.errors import PlanFormatError
from batchplan.formats.arrow import arrow_array
from batchplan.formats.atomic import atomic_path
from batchplan.formats.plan_file import FORMAT_VERSION, INT32_LIMIT, content_hash, dump_json, plan_schema

if TYPE_CHECKING:
    from batchplan.plan import EpochPlan, Plan

__all__ = ["plan_metadata", "plan_schema", "write_plan"]


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
    deferred = dump_json(metadata).count(_placeholder_entry()) == 1
    if not deferred:
        metadata["content_hash"] = content_hash(metadata, batches)
    schema = plan_schema(
        plan.num_samples, plan.entries.has_spans, metadata, has_cost=_has_cost(plan), has_padded=_has_padded(plan)
    )
    existed = path.exists()
    try:
        with atomic_path(path) as temporary, ThreadPoolExecutor(max_workers=1) as hasher:
            hashing = hasher.submit(content_hash, metadata, batches) if deferred else None
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
        "packing": [None if e.packing is None else e.packing.as_dict() for e in plan.epochs],
        "versions": {
            "batchplan": __version__,
            "numpy": np.__version__,
            "numba": version("numba"),  # from the installed metadata: numba itself is not loaded
            "pyarrow": pa.__version__,
            "highspy": version("highspy"),  # the packer's LP solver
        },
    }
    return {**metadata, **(lineage or {})}


def _shift_columns(batch: pa.RecordBatch, shifts: dict[str, int]) -> pa.RecordBatch:
    """``batch`` with ``shifts[name]`` added to each named int64 column."""
    for name, shift in shifts.items():
        if shift:
            index = batch.schema.get_field_index(name)
            shifted = arrow_array(batch.column(index).to_numpy() + np.int64(shift), pa.int64())
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
    return {name: arrow_array(values, schema.field(name).type) for name, values in columns.items()}


def _rank_batch(schema, plan, epoch: EpochPlan, rank: int, rows: slice, shared) -> pa.RecordBatch:
    offsets = epoch.offsets[rows.start : rows.stop + 1]
    members = epoch.members[offsets[0] : offsets[-1]]
    list_offsets = offsets - offsets[0]
    if list_offsets[-1] >= INT32_LIMIT:
        raise PlanFormatError("one rank's epoch holds more than 2^31 entries; raise world_size")
    list_offsets = arrow_array(list_offsets, pa.int32())
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
        else arrow_array(columns[f.name], f.type) for f in schema
    ]  # fmt: skip
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _list_array(offsets: pa.Array, values: NDArray, list_type: pa.ListType) -> pa.ListArray:
    """Of exactly the schema's type (non-null items): a `RecordBatch` of other types would be
    cast, which imports ``pyarrow.compute`` (~45 ms)."""
    return pa.ListArray.from_arrays(offsets, arrow_array(values, list_type.value_type), type=list_type)


# Not a possible CRC (not hex), as long as one: found only where it was put.
_HASH_PLACEHOLDER = "crc32:????????"


def _placeholder_entry() -> bytes:
    """The placeholder as it stands in the metadata's JSON: ``"content_hash":"crc32:????????"``."""
    return dump_json({"content_hash": _HASH_PLACEHOLDER})[1:-1]


def _replace_placeholder(path: Path, content_hash: str) -> None:
    """Write ``content_hash`` over the placeholder in the schema's two copies in an Arrow
    IPC file: the schema message after the leading magic, and the footer before the
    trailing one (their lengths are in the file; only those two messages are read)."""
    placeholder = _placeholder_entry()
    replacement = dump_json({"content_hash": content_hash})[1:-1]
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
