"""`PlanDataset`: carries a plan's token spans from the sampler to the collator.

A ``DataLoader`` hands the collator only ``dataset[i]`` for each index, never the
index itself, so a span (``oversize="truncate"`` or ``"split"``) must travel with the item.
The sampler yields `SpanIndex` ints; this wrapper turns ``dataset[span_index]``
into a `SpanItem` (the item plus its span), which `PackCollator` and `PadCollator`
slice. Plain ``int`` indices pass through unchanged, so wrapping is harmless for
plans without spans. Cost: one tuple per item.

The loader fetches a micro-batch through `PlanDataset.__getitems__` (``DataLoader``
passes it the sampler's whole `PlannedRows`), which hands the collator the items as
`PlannedItems` carrying the micro-batch's record. A wrapped dataset with its own
``__getitems__`` (a Hugging Face ``datasets.Dataset``) is read with one call per
micro-batch.

There, whatever collate function follows, the items are checked against the record
(`batchplan.runtime.checks.check_items`) when their token ids can be read (under
``input_key``, or items that are the ids): a sample longer or shorter than planned,
a span outside its item, or a sample longer than the span the plan has end it is a
`PlanMismatchError` that names the micro-batch and the sample. Only here is that last
one seen: the sampler marks the spans that end their sample (`SpanIndex.ends_sample`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.data import Dataset

from batchplan.runtime.checks import check_items
from batchplan.runtime.records import MicroBatch, PlannedItems, SpanIndex, SpanItem

__all__ = ["PlanDataset"]


class PlanDataset(Dataset):
    """Wraps a map-style dataset so items of span indices arrive as `SpanItem`.

    Args:
        dataset: anything with ``__getitem__(int)`` (and ``__len__``).
        input_key: key of the token ids in a mapping item, checked against the plan;
            None checks nothing (items whose ids a collate function makes, e.g. raw text).
    """

    def __init__(self, dataset: Any, *, input_key: str | None = "input_ids") -> None:
        self.dataset = dataset
        self.input_key = input_key

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        item = self.dataset[int(index)]
        if isinstance(index, SpanIndex):
            return SpanItem(item, index.start, index.length)
        return item

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The items of one micro-batch; `PlannedItems` with its record when ``indices`` has one.

        Raises:
            PlanMismatchError: the items do not hold the tokens the record plans.
        """
        rows = [int(i) for i in indices]
        many = getattr(self.dataset, "__getitems__", None)
        if many is not None and rows:
            items = list(many(rows))
        else:
            items = [self.dataset[row] for row in rows]
        record = getattr(indices, "record", None)
        if record is not None and self.input_key is not None:
            self._check(items, indices, record)
        items = [
            SpanItem(item, i.start, i.length) if isinstance(i, SpanIndex) else item for item, i in zip(items, indices)
        ]
        return items if record is None else PlannedItems(items, record)

    def _check(self, items: list[Any], indices: Sequence[int], record: MicroBatch) -> None:
        counts = [_token_count(item.get(self.input_key) if isinstance(item, Mapping) else item) for item in items]
        tokens = [count for count in counts if count is not None]
        if len(tokens) != len(counts) or len(tokens) != len(record.indices):
            return  # ids this wrapper cannot count: the collator checks what it assembles
        ends = [getattr(i, "ends_sample", False) for i in indices] if record.starts is not None else None
        check_items(record, tokens, ends_sample=ends)


def _token_count(ids: Any) -> int | None:
    """Tokens in a flat sequence of ids (list, tuple, numpy array, tensor); None for anything else."""
    shape = getattr(ids, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) == 1 else None
    return len(ids) if isinstance(ids, (list, tuple)) else None
