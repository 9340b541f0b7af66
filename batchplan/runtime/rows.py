"""One rank's rows of one epoch, as zero-copy numpy views of the memory-mapped plan
(`batchplan.formats.plan_rows.PlanRows`: a null in a plan column is a `PlanFormatError`).

Iteration converts rows to Python objects in chunks of `CHUNK_ROWS` (one
``tolist`` per column per chunk), so a micro-batch costs about a microsecond and
memory stays O(chunk), whatever the epoch's size. Reading touches only this
rank's record batch: the other ranks' rows are never paged in. The sampler checks
the rows it reads (`batchplan.runtime.checks.check_rank_rows`) before any is served.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from numpy.typing import NDArray

from batchplan.formats.plan_rows import PlanRows
from batchplan.runtime.records import MicroBatch, PlannedRows, SpanIndex

__all__ = ["CHUNK_ROWS", "RUNTIME_COLUMNS", "RankRows"]

CHUNK_ROWS = 512
# Columns the runtime reads beyond the format's required ones.
RUNTIME_COLUMNS = ("num_micro", "step_tokens", "tokens_before_step")
_SCALARS = (
    "step",
    "micro",
    "num_micro",
    "tokens",
    "loss_tokens",
    "step_loss_tokens",
    "tokens_before_step",
    "step_tokens",
    "padded_tokens",
)


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
        rows: PlanRows,
        epoch: int,
        world_size: int | None = None,
        *,
        rank: int | None = None,
        span_cap: int | None = None,
    ) -> None:
        self.epoch = epoch
        self.world_size = world_size
        self.rank = rank
        self.span_cap = span_cap
        self.num_rows = rows.num_rows
        self.has_spans = rows.has_spans
        self._columns = {name: rows.numbers(name) for name in _SCALARS}
        self._source = rows.numbers("source") if "source" in rows else None
        self._offsets, self._samples = rows.offsets("samples"), rows.entries("samples")
        if self.has_spans:
            self._span_offsets, self._starts = rows.offsets("starts"), rows.entries("starts")
            self._length_offsets, self._lengths = rows.offsets("lengths"), rows.entries("lengths")

    def column(self, name: str) -> NDArray[np.int64]:
        """A scalar column (``step``, ``tokens``, ...) as a read-only numpy view."""
        return self._columns[name]

    def entries(self) -> dict[str, tuple[NDArray[np.int64], NDArray]]:
        """``{name: (offsets, values)}`` of the list columns (``samples``, and ``starts`` and
        ``lengths`` with spans): row ``i`` holds ``values[offsets[i]:offsets[i + 1]]`` (offsets
        from 0); the values are read-only views."""
        columns = {"samples": (self._offsets, self._samples)}
        if self.has_spans:
            columns["starts"] = (self._span_offsets, self._starts)
            columns["lengths"] = (self._length_offsets, self._lengths)
        return columns

    def records(self, start: int = 0) -> Iterator[MicroBatch]:
        """One `MicroBatch` per row from row ``start``."""
        epoch, world_size, rank = self.epoch, self.world_size, self.rank
        for first in range(start, self.num_rows, CHUNK_ROWS):
            stop = min(first + CHUNK_ROWS, self.num_rows)
            columns = [self._columns[name][first:stop].tolist() for name in _SCALARS]
            samples, starts, lengths = self._chunk_lists(first, stop)
            sources = [None] * (stop - first) if self._source is None else self._source[first:stop].tolist()
            for j, row in enumerate(zip(*columns)):
                step, micro, num_micro, tokens, loss, step_loss, before, step_tokens, padded = row  # _SCALARS
                yield MicroBatch(
                    samples[j],
                    epoch,
                    step,
                    micro,
                    num_micro,
                    micro == num_micro - 1,
                    tokens,
                    loss,
                    step_loss,
                    before,
                    step_tokens,
                    padded,
                    first + j,
                    starts[j],
                    lengths[j],
                    world_size,
                    rank,
                    sources[j],
                )

    def planned_rows(self, start: int = 0) -> Iterator[PlannedRows]:
        """The dataset rows of each micro-batch from row ``start``, each with its record."""
        if not self.has_spans:
            for record in self.records(start):
                yield PlannedRows(record.indices, record)
            return
        cap = 0 if self.span_cap is None else self.span_cap
        for record in self.records(start):
            assert record.starts is not None and record.lengths is not None  # the plan has spans
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


def _split(values: NDArray, offsets: NDArray, first: int, stop: int) -> list[list[int]]:
    """Rows ``first..stop-1`` of a CSR list column as Python lists (one ``tolist``)."""
    bounds = offsets[first : stop + 1]
    flat = values[bounds[0] : bounds[-1]].tolist()
    cuts = (bounds - bounds[0]).tolist()
    return [flat[cuts[i] : cuts[i + 1]] for i in range(stop - first)]
