"""One rank's rows of one epoch, as zero-copy numpy views of the memory-mapped plan.

Iteration converts rows to Python objects in chunks of `CHUNK_ROWS` (one
``tolist`` per column per chunk), so a micro-batch costs about a microsecond and
memory stays O(chunk), whatever the epoch's size. Reading touches only this
rank's record batch: the other ranks' rows are never paged in. The sampler checks
the rows it reads (`batchplan.runtime.checks.check_rank_rows`) before any is served.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from batchplan.errors import PlanFormatError
from batchplan.formats.arrow import numpy_of
from batchplan.formats.plan_file import padded_tokens_column
from batchplan.runtime.records import MicroBatch, PlannedRows, SpanIndex

__all__ = ["CHUNK_ROWS", "RUNTIME_COLUMNS", "RankRows"]

CHUNK_ROWS = 512
# Columns the runtime reads beyond the format's required ones.
RUNTIME_COLUMNS = ("num_micro", "step_tokens", "tokens_before_step")
_SCALARS = (
    "step", "micro", "num_micro", "tokens", "loss_tokens", "step_loss_tokens",
    "tokens_before_step", "step_tokens", "padded_tokens",
)  # fmt: skip


class RankRows:
    """This rank's micro-batches of one epoch, in (step, micro) order.

    Attributes:
        epoch: the epoch these rows belong to.
        num_rows: micro-batches of this rank in this epoch.
        has_spans: whether rows carry ``starts``/``lengths`` token spans.
        world_size: the plan's ranks, put on every record (`MicroBatch.loss_scale`).
        rank: the rank these rows belong to, put on every record.
        span_cap: spans shorter than this are their sample's last tokens (`SpanIndex.ends_sample`);
            None: unknown.
    """

    def __init__(
        self,
        batch: pa.RecordBatch,
        epoch: int,
        path: object,
        world_size: int | None = None,
        *,
        rank: int | None = None,
        span_cap: int | None = None,
    ) -> None:
        self.epoch = epoch
        self.world_size = world_size
        self.rank = rank
        self.span_cap = span_cap
        self.num_rows = batch.num_rows
        self.has_spans = "starts" in batch.schema.names
        try:
            self._columns = {name: _scalar_column(batch, name) for name in _SCALARS}
            self._source = _values(batch.column("source")) if "source" in batch.schema.names else None
            self._offsets, self._samples = _list_column(batch, "samples")
            if self.has_spans:
                self._span_offsets, self._starts = _list_column(batch, "starts")
                self._length_offsets, self._lengths = _list_column(batch, "lengths")
        except (KeyError, pa.ArrowException) as error:
            raise PlanFormatError(f"{path}: cannot read epoch {epoch} ({error}); rebuild the plan") from error

    def column(self, name: str) -> NDArray[np.int64]:
        """A scalar column (``step``, ``tokens``, ...) as a read-only numpy view."""
        return self._columns[name]

    def entries(self) -> dict[str, tuple[NDArray, NDArray]]:
        """``{name: (offsets, values)}`` of the list columns (``samples``, and ``starts`` and
        ``lengths`` with spans): row ``i`` holds ``values[offsets[i] - offsets[0]:offsets[i + 1]
        - offsets[0]]``; read-only views."""
        columns = {"samples": (self._offsets, self._samples)}
        if self.has_spans:
            columns["starts"] = (self._span_offsets, self._starts)
            columns["lengths"] = (self._length_offsets, self._lengths)
        if self.num_rows == 0:
            return {name: (np.zeros(1, np.int64), values[:0]) for name, (_, values) in columns.items()}
        return {name: (offsets, values[offsets[0] : offsets[-1]]) for name, (offsets, values) in columns.items()}

    def records(self, start: int = 0) -> Iterator[MicroBatch]:
        """One `MicroBatch` per row from row ``start``."""
        epoch, world_size, rank = self.epoch, self.world_size, self.rank
        for first in range(start, self.num_rows, CHUNK_ROWS):
            stop = min(first + CHUNK_ROWS, self.num_rows)
            columns = [self._columns[name][first:stop].tolist() for name in _SCALARS]
            samples, starts, lengths = self._chunk_lists(first, stop)
            sources = [None] * (stop - first) if self._source is None else self._source[first:stop].tolist()
            for j, (step, micro, num_micro, *counts) in enumerate(zip(*columns)):
                yield MicroBatch(
                    samples[j], epoch, step, micro, num_micro, micro == num_micro - 1, *counts,
                    first + j, starts[j], lengths[j], world_size, rank, sources[j],
                )  # fmt: skip

    def planned_rows(self, start: int = 0) -> Iterator[PlannedRows]:
        """The dataset rows of each micro-batch from row ``start``, each with its record."""
        if not self.has_spans:
            for record in self.records(start):
                yield PlannedRows(record.indices, record)
            return
        cap = 0 if self.span_cap is None else self.span_cap
        for record in self.records(start):
            rows = [SpanIndex(r, s, n, n < cap) for r, s, n in zip(record.indices, record.starts, record.lengths)]
            yield PlannedRows(rows, record)

    def _chunk_lists(self, first: int, stop: int):
        samples = _split(self._samples, self._offsets, first, stop)
        if not self.has_spans:
            nothing = [None] * (stop - first)
            return samples, nothing, nothing
        starts = _split(self._starts, self._span_offsets, first, stop)
        lengths = _split(self._lengths, self._span_offsets, first, stop)
        return samples, starts, lengths


def _scalar_column(batch: pa.RecordBatch, name: str) -> NDArray[np.int64]:
    column = padded_tokens_column(batch) if name == "padded_tokens" else batch.column(name)
    return _values(column)


def _list_column(batch: pa.RecordBatch, name: str) -> tuple[NDArray[np.int64], NDArray]:
    """``(offsets, values)``: row ``i`` is ``values[offsets[i]:offsets[i + 1]]``."""
    column = batch.column(name)
    return _values(column.offsets), _values(column.values)


def _values(array: pa.Array) -> NDArray:
    """A read-only view of a plan column's values; a null (a damaged file: plans have none)
    is an error, not a 0."""
    if array.null_count:
        raise pa.ArrowInvalid(f"{array.null_count} null value(s) in a plan column")
    return numpy_of(array)


def _split(values: NDArray, offsets: NDArray, first: int, stop: int) -> list[list[int]]:
    """Rows ``first..stop-1`` of a CSR list column as Python lists (one ``tolist``)."""
    bounds = offsets[first : stop + 1]
    flat = values[bounds[0] : bounds[-1]].tolist()
    cuts = (bounds - bounds[0]).tolist()
    return [flat[cuts[i] : cuts[i + 1]] for i in range(stop - first)]
