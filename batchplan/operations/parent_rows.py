"""A parent plan's rows read back for resharding: the micro-batches from a step on, with
their entries (samples and spans), counts and costs, and the entries of a new plan
indexed from them."""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import NDArray

from batchplan.formats.opened_plan import OpenedPlan
from batchplan.formats.plan_rows import PlanRows
from batchplan.kernels.pack import pack_segments
from batchplan.plan import Entries, index_dtype

__all__ = [
    "ParentRows",
    "always_dropped",
    "concat_rows",
    "index_entries",
    "merge_epoch_end",
    "parent_drops",
    "read_epoch",
    "segment_positions",
]


@dataclasses.dataclass(frozen=True)
class ParentRows:
    """A parent epoch's micro-batches, all ranks, in (step, rank, micro) order.

    Row ``i`` holds entries ``offsets[i]:offsets[i + 1]`` of ``sample`` (and of
    ``start``/``length`` when the plan has spans); ``source`` is each row's source in a
    mixture's plan, else None.
    """

    step: NDArray[np.int64]
    offsets: NDArray[np.int64]
    sample: NDArray[np.int64]
    start: NDArray[np.int64] | None
    length: NDArray[np.int64] | None
    tokens: NDArray[np.int64]
    loss_tokens: NDArray[np.int64]
    padded_tokens: NDArray[np.int64]
    cost: NDArray[np.float64] | None
    source: NDArray[np.int16] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.step.shape[0])

    def spans(self) -> NDArray[np.int64]:
        """Shape (entries, 3): each entry's ``(sample, start, length)``; for a plan with spans."""
        assert self.start is not None and self.length is not None  # read from a plan with spans
        return np.stack([self.sample, self.start, self.length], axis=1)

    def take(self, rows: NDArray[np.int64]) -> ParentRows:
        """These rows, in this order."""
        flat = segment_positions(self.offsets, rows)
        counts = np.diff(self.offsets)[rows]
        return ParentRows(
            step=self.step[rows],
            offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            sample=self.sample[flat],
            start=_pick(self.start, flat),
            length=_pick(self.length, flat),
            tokens=self.tokens[rows],
            loss_tokens=self.loss_tokens[rows],
            padded_tokens=self.padded_tokens[rows],
            cost=_pick(self.cost, rows),
            source=_pick(self.source, rows),
        )


def read_epoch(plan: OpenedPlan, epoch: int) -> ParentRows:
    """Every non-empty micro-batch of one parent epoch, in the order the run trains them."""
    columns = plan.epoch_rows(epoch)
    numbers = {
        name: columns.numbers(name).astype(np.int64)
        for name in ("step", "rank", "micro", "tokens", "loss_tokens", "padded_tokens")
    }
    spans = columns.has_spans
    rows = ParentRows(
        step=numbers["step"],
        offsets=columns.offsets("samples"),
        sample=_entries(columns, "samples"),
        start=_entries(columns, "starts") if spans else None,
        length=_entries(columns, "lengths") if spans else None,
        tokens=numbers["tokens"],
        loss_tokens=numbers["loss_tokens"],
        padded_tokens=numbers["padded_tokens"],
        cost=columns.numbers("cost") if "cost" in columns else None,
        source=columns.numbers("source") if "source" in columns else None,
    )
    order = np.lexsort((numbers["micro"], numbers["rank"], numbers["step"]))
    return rows.take(order[np.diff(rows.offsets)[order] > 0])


def merge_epoch_end(part: ParentRows, max_tokens: int) -> ParentRows:
    """Pack mode: the parent's last step of the epoch, whose micro-batches the parent split to
    give every rank one, packed again by the planner's best fit decreasing within
    ``max_tokens``: left as they are, its small pieces would sit in ordinary steps of the new
    plan beside full micro-batches and leave ranks idle. Counts and costs of a packed
    micro-batch are sums of its pieces', so they stay exact."""
    if part.num_rows == 0:
        return part
    last = np.flatnonzero(part.step == part.step.max())
    # (bins + 1,) offsets and (pieces,) members: pieces of the last step packed into bins
    offsets, members = pack_segments(part.tokens[last], np.arange(last.shape[0], dtype=np.int64), max_tokens)
    if offsets.shape[0] - 1 == last.shape[0]:
        return part
    merged = part.take(last[members])
    group_of = np.repeat(np.arange(offsets.shape[0] - 1), np.diff(offsets))

    def summed(values):
        return np.bincount(group_of, weights=values).astype(values.dtype)

    ends = ParentRows(
        step=merged.step[offsets[1:] - 1],
        offsets=np.concatenate([[0], np.cumsum(summed(np.diff(merged.offsets)))]),
        sample=merged.sample,
        start=merged.start,
        length=merged.length,
        tokens=summed(merged.tokens),
        loss_tokens=summed(merged.loss_tokens),
        padded_tokens=summed(merged.padded_tokens),
        cost=None if merged.cost is None else summed(merged.cost),
    )
    return concat_rows(part.take(np.flatnonzero(part.step != part.step.max())), ends)


def concat_rows(first: ParentRows, second: ParentRows) -> ParentRows:
    def both(a, b):
        return None if a is None else np.concatenate([a, b])

    return ParentRows(
        step=both(first.step, second.step),
        offsets=np.concatenate([first.offsets, first.offsets[-1] + second.offsets[1:]]),
        sample=both(first.sample, second.sample),
        start=both(first.start, second.start),
        length=both(first.length, second.length),
        tokens=both(first.tokens, second.tokens),
        loss_tokens=both(first.loss_tokens, second.loss_tokens),
        padded_tokens=both(first.padded_tokens, second.padded_tokens),
        cost=both(first.cost, second.cost),
        source=both(first.source, second.source),
    )


def _pick(values: NDArray | None, positions: NDArray[np.int64]) -> NDArray | None:
    return None if values is None else values[positions]


def _entries(rows: PlanRows, name: str) -> NDArray[np.int64]:
    return rows.entries(name).astype(np.int64)


def segment_positions(offsets: NDArray[np.int64], segments: NDArray[np.int64]) -> NDArray[np.int64]:
    """Positions of the items of ``segments`` (CSR ``offsets``), segment after segment."""
    counts = offsets[segments + 1] - offsets[segments]
    placed = np.cumsum(counts) - counts  # where each segment starts in the output
    return np.repeat(offsets[segments] - placed, counts) + np.arange(int(counts.sum()), dtype=np.int64)


def parent_drops(plan: OpenedPlan, epoch: int) -> NDArray[np.int64]:
    """What the parent dropped by drop_last in ``epoch``: shape (n, 3) ``[sample, start, length]``
    with spans, else shape (n, 1) ``[sample]``."""
    dropped = plan.metadata["dropped"]
    if plan.metadata.get("has_spans"):
        return np.asarray(dropped.get("drop_last_spans", {}).get(str(epoch), []), dtype=np.int64).reshape(-1, 3)
    return np.asarray(dropped.get("drop_last", {}).get(str(epoch), []), dtype=np.int64).reshape(-1, 1)


def always_dropped(plan: OpenedPlan) -> dict[str, NDArray[np.int64]]:
    dropped = plan.metadata["dropped"]
    return {r: np.asarray(dropped[r], dtype=np.int64) for r in ("empty", "oversize") if r in dropped}


def index_entries(plan: OpenedPlan, rows: list[ParentRows], drops: list[NDArray[np.int64]]):
    """The new plan's `Entries`, and the entry of each row item and each dropped piece, per epoch.

    Without spans: entry ``i`` is the ``i``-th sample not always dropped (as the planner
    numbers them). With spans: every piece the new plan holds or drops, in (sample,
    start) order.
    """
    always = always_dropped(plan)
    if not plan.metadata.get("has_spans"):
        keep = np.ones(plan.num_samples, dtype=bool)
        for samples in always.values():
            keep[samples] = False
        sample = np.flatnonzero(keep).astype(index_dtype(plan.num_samples))
        unknown = np.zeros(sample.shape[0], dtype=np.int32)  # per-sample lengths are not in the file
        entries = Entries(sample=sample, start=None, length=unknown, loss_tokens=unknown, dropped=always)
        return entries, [_entry_of(sample, part.sample) for part in rows], [_entry_of(sample, d[:, 0]) for d in drops]
    pieces = [part.spans() for part in rows] + list(drops)
    every = np.concatenate(pieces)
    order = np.lexsort((every[:, 2], every[:, 1], every[:, 0]))
    ordered = every[order]
    new = np.ones(ordered.shape[0], dtype=bool)
    new[1:] = np.any(ordered[1:] != ordered[:-1], axis=1)
    inverse = np.empty(every.shape[0], dtype=np.int64)
    inverse[order] = np.cumsum(new) - 1
    unique = ordered[new]
    length = unique[:, 2].astype(np.int32)
    entries = Entries(
        sample=unique[:, 0].astype(index_dtype(plan.num_samples)),
        start=unique[:, 1].copy(),
        length=length,
        dropped=always,
    )
    bounds = np.cumsum([0] + [p.shape[0] for p in pieces])
    ids = [inverse[bounds[i] : bounds[i + 1]] for i in range(len(pieces))]
    return entries, ids[: len(rows)], ids[len(rows) :]


def _entry_of(kept: NDArray[np.integer], samples: NDArray[np.int64]) -> NDArray[np.int64]:
    return np.searchsorted(kept, samples).astype(np.int64)
