"""Write a plan file: one record batch per (epoch, rank), the metadata, and a checksum
of the content, written atomically (`batchplan.formats.atomic`). The layout is in
`batchplan.formats.plan_format` and docs/plan-format.md."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from batchplan.errors import PlanFormatError
from batchplan.formats.arrow import arrow_array
from batchplan.formats.arrow_file import shift_columns
from batchplan.formats.arrow_layout import replace_in_schema
from batchplan.formats.atomic import atomic_path
from batchplan.formats.plan_format import (
    BATCH_CRC_KEY,
    FORMAT_VERSION,
    INT32_LIMIT,
    METADATA_KEY,
    batch_checksum,
    batch_crc,
    content_hash,
    dump_json,
    hash_text,
    metadata_crc,
    plan_schema,
)

if TYPE_CHECKING:
    from batchplan.config import PlanConfig
    from batchplan.plan import Entries, EpochPlan, Plan

__all__ = [
    "epoch_batches",
    "epoch_metadata",
    "header_metadata",
    "merge_metadata",
    "plan_metadata",
    "plan_schema",
    "write_batches",
    "write_plan",
]


def write_plan(
    plan: Plan,
    path: str | os.PathLike,
    *,
    dataset: dict[str, Any] | None = None,
    lengths_fingerprint: str | None = None,
    on_batch: Callable[[int], None] | None = None,
    lineage: dict[str, Any] | None = None,
    mixture: dict[str, Any] | None = None,
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
        mixture: a mixture's plan: its sources (the metadata key ``mixture``); the rows
            then say their source (``EpochPlan.source``).
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise PlanFormatError(f"{path}: directory {path.parent} does not exist; create it first")
    metadata = plan_metadata(
        plan, dataset=dataset, lengths_fingerprint=lengths_fingerprint, lineage=lineage, mixture=mixture
    )
    schema = _schema_of(plan.num_samples, plan.entries.has_spans, plan.config, has_source=mixture is not None)
    batches = _record_batches(schema, plan, on_batch)
    if lineage:
        shifts = {
            "step": lineage.get("first_step", 0),
            "tokens_before_step": lineage.get("tokens_before_first_step", 0),
        }
        batches = (shift_columns(batch, shifts) for batch in batches)
    return write_batches(path, schema, metadata, batches)


def write_batches(path: Path, schema: pa.Schema, metadata: dict[str, Any], batches: Iterable[pa.RecordBatch]):
    """Write record batches of ``schema`` and ``metadata`` (its ``content_hash`` filled in
    here) atomically to ``path``, one batch in memory at a time; return the metadata.

    The hash covers the metadata and the values, not the file's bytes: it is computed
    while the file is written (CRC and writes release the GIL), then written over a
    placeholder of the same length (`batchplan.formats.arrow_layout.replace_in_schema`). The
    bytes are those of writing the hash up front, which is done instead when the
    placeholder's text occurs elsewhere in the metadata (a caller's nested dict could hold it).
    """
    metadata["content_hash"] = _HASH_PLACEHOLDER
    deferred = dump_json(metadata).count(_placeholder_entry()) == 1
    if not deferred:
        batches = list(batches)
        metadata["content_hash"] = content_hash(metadata, batches)
    schema = schema.with_metadata({METADATA_KEY: dump_json(metadata)})
    existed = path.exists()
    crc = [metadata_crc(metadata)]

    def hash_next(batch: pa.RecordBatch) -> None:  # in order: one hashing thread
        crc[0] = batch_crc(batch, crc[0])

    try:
        with atomic_path(path) as temporary, ThreadPoolExecutor(max_workers=1) as hasher:
            hashed = []
            with pa.OSFile(str(temporary), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
                for batch in batches:
                    if deferred:
                        hashed.append(hasher.submit(hash_next, batch))
                    checksum = {BATCH_CRC_KEY: batch_checksum(batch)}  # each batch its own, for its reader
                    writer.write_batch(batch.replace_schema_metadata(schema.metadata), custom_metadata=checksum)
                    while hashed and (hashed[0].done() or len(hashed) > 2):  # at most 2 batches wait
                        hashed.pop(0).result()
            for waiting in hashed:
                waiting.result()
            if deferred:
                metadata["content_hash"] = hash_text(crc[0])
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


def plan_metadata(plan: Plan, *, dataset=None, lengths_fingerprint=None, lineage=None, mixture=None) -> dict[str, Any]:
    """The JSON metadata of a plan (everything but the content hash); ``lineage`` keys last."""
    header = header_metadata(plan.config, plan.num_samples, plan.entries, dataset, lengths_fingerprint, mixture)
    parts = [epoch_metadata(plan.entries, epoch) for epoch in plan.epochs]
    return {**merge_metadata(header, parts), **(lineage or {})}


def header_metadata(
    config: PlanConfig, num_samples: int, entries: Entries, dataset=None, lengths_fingerprint=None, mixture=None
) -> dict[str, Any]:
    """What a plan's metadata says before any epoch is planned (``mixture``: a mixture's sources)."""
    from importlib.metadata import version

    from batchplan import __version__

    header = {
        "format_version": FORMAT_VERSION,
        "num_samples": num_samples,
        "num_entries": entries.num_entries,
        "world_size": config.world_size,
        "max_tokens": config.max_tokens,
        "mode": config.mode,
        "epochs": config.epochs,
        "seed": config.seed,
        "config": config.to_dict(),
        "config_fingerprint": config.fingerprint(),
        "lengths_fingerprint": lengths_fingerprint,
        "dataset": dataset,
        "has_spans": entries.has_spans,
        "hidden_size": config.hidden_size,
        "attention_coefficient": config.cost_coefficient,
        "dropped": {reason: samples.tolist() for reason, samples in entries.dropped.items()},
        "versions": {
            "batchplan": __version__,
            "numpy": np.__version__,
            "numba": version("numba"),  # from the installed metadata: numba itself is not loaded
            "pyarrow": pa.__version__,
            "highspy": version("highspy"),  # the packer's LP solver
        },
    }
    if mixture is not None:
        header["mixture"] = mixture
    return header


def epoch_metadata(entries: Entries, epoch: EpochPlan) -> dict[str, Any]:
    """What a plan's metadata says of one epoch (`merge_metadata` puts the parts together)."""
    part = {
        "epoch": epoch.epoch,
        "steps": epoch.num_steps,
        "rows_per_rank": epoch.rows_per_rank,
        "tokens": int(epoch.step_tokens.sum()),
        "packing": None if epoch.packing is None else epoch.packing.as_dict(),
        "drop_last": _dropped_samples(entries, epoch).tolist(),
    }
    if entries.start is not None:  # spans: a split sample may lose only some of its pieces
        part["drop_last_spans"] = _dropped_spans(entries, entries.start, epoch.dropped_entries)
    return part


def _dropped_samples(entries: Entries, epoch: EpochPlan) -> NDArray[np.integer]:
    """The samples drop_last leaves out of ``epoch``, sorted: each once, or in a mixture's
    epoch (whose entries are uses) once per dropped entry, so a sample whose two uses are
    dropped is listed twice."""
    samples = entries.samples_of(epoch.dropped_entries)
    return np.sort(samples) if epoch.source is not None else np.unique(samples)


def merge_metadata(header: dict[str, Any], parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A plan's metadata: its header and the parts of its epochs, in epoch order."""
    dropped = dict(header["dropped"])
    last = [part for part in parts if part["drop_last"]]
    if last:
        dropped["drop_last"] = {str(part["epoch"]): part["drop_last"] for part in last}
        if header["has_spans"]:
            dropped["drop_last_spans"] = {str(part["epoch"]): part["drop_last_spans"] for part in last}
    return {
        **header,
        "dropped": dropped,
        "steps_per_epoch": [part["steps"] for part in parts],
        "rows_per_rank": [part["rows_per_rank"] for part in parts],
        "packing": [part["packing"] for part in parts],
    }


def _schema_of(num_samples: int, has_spans: bool, config: PlanConfig, *, has_source: bool = False) -> pa.Schema:
    has_cost = config.cost_coefficient is not None
    return plan_schema(num_samples, has_spans, has_cost=has_cost, has_padded=_has_padded(config), has_source=has_source)


def _has_padded(config: PlanConfig) -> bool:
    """Pad plans have ``padded_tokens``; in pack plans it would equal ``tokens``."""
    return config.mode == "pad"


def _dropped_spans(entries: Entries, start: NDArray[np.int64], dropped: NDArray[np.integer]) -> list[list[int]]:
    """``[sample, start, length]`` of each dropped entry (``start``: the entries' first tokens), sorted."""
    dropped = np.sort(dropped)  # entries are numbered in (sample, start) order
    spans = np.stack([entries.samples_of(dropped), start[dropped], entries.length[dropped]])
    return spans.T.tolist()


def _record_batches(schema: pa.Schema, plan: Plan, on_batch) -> Iterator[pa.RecordBatch]:
    step_base = 0
    tokens_base = 0
    for epoch in plan.epochs:
        yield from epoch_batches(schema, plan.entries, epoch, step_base, tokens_base, on_batch)
        step_base += epoch.num_steps
        tokens_base += int(epoch.step_tokens.sum())


def epoch_batches(
    schema: pa.Schema, entries: Entries, epoch: EpochPlan, step_base: int, tokens_base: int, on_batch=None
) -> Iterator[pa.RecordBatch]:
    """An epoch's record batches, one per rank; ``step`` and ``tokens_before_step`` count
    from ``step_base`` and ``tokens_base``."""
    # shape (num_steps,): tokens before each step
    before = tokens_base + np.cumsum(epoch.step_tokens) - epoch.step_tokens
    shared = _shared_columns(schema, epoch, step_base, before)
    for rank in range(epoch.world_size):
        rows = slice(rank * epoch.rows_per_rank, (rank + 1) * epoch.rows_per_rank)
        yield _rank_batch(schema, entries, epoch, rank, rows, shared)
        if on_batch is not None:
            on_batch(epoch.epoch * epoch.world_size + rank)


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


def _rank_batch(schema, entries: Entries, epoch: EpochPlan, rank: int, rows: slice, shared) -> pa.RecordBatch:
    offsets = epoch.offsets[rows.start : rows.stop + 1]
    members = epoch.members_between(int(offsets[0]), int(offsets[-1]))
    list_offsets = offsets - offsets[0]
    if list_offsets[-1] >= INT32_LIMIT:
        raise PlanFormatError("one rank's epoch holds more than 2^31 entries; raise world_size")
    list_offsets = arrow_array(list_offsets, pa.int32())
    columns = {
        "rank": np.full(rows.stop - rows.start, rank, dtype=np.int32),
        "samples": _list_array(list_offsets, entries.samples_of(members), schema.field("samples").type),
        "tokens": epoch.tokens[rows],
        "loss_tokens": epoch.loss_tokens[rows],
    }
    if "padded_tokens" in schema.names:
        columns["padded_tokens"] = epoch.padded_tokens[rows]
    if epoch.cost is not None:
        columns["cost"] = epoch.cost[rows]
    if "source" in schema.names:
        assert epoch.source is not None  # a mixture's plan (write_plan's mixture=): the planner set the sources
        columns["source"] = epoch.source[rows]
    if entries.start is not None:  # spans
        columns["starts"] = _list_array(list_offsets, entries.start[members], schema.field("starts").type)
        columns["lengths"] = _list_array(list_offsets, entries.length[members], schema.field("lengths").type)
    arrays = [
        shared[f.name]
        if f.name in shared
        else columns[f.name]
        if pa.types.is_list(f.type)
        else arrow_array(columns[f.name], f.type)
        for f in schema
    ]
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
    """Write ``content_hash`` over the placeholder in the written file's schema (both copies)."""
    replace_in_schema(path, _placeholder_entry(), dump_json({"content_hash": content_hash})[1:-1])
