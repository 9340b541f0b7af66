"""`PlanDataset`: carries a plan's token spans from the sampler to the collator.

A ``DataLoader`` hands the collator only ``dataset[i]`` for each index, never the
index itself, so a span (``--oversize truncate|split``) must travel with the item.
The sampler yields `SpanIndex` ints; this wrapper turns ``dataset[span_index]``
into a `SpanItem` (the item plus its span), which `PackCollator` and `PadCollator`
slice. Plain ``int`` indices pass through unchanged, so wrapping is harmless for
plans without spans. Cost: one tuple per item.

The loader fetches a micro-batch through `PlanDataset.__getitems__` (``DataLoader``
passes it the sampler's whole `PlannedRows`), which hands the collator the items as
`PlannedItems` carrying the micro-batch's record. A wrapped dataset with its own
``__getitems__`` (a Hugging Face ``datasets.Dataset``) is read with one call per
micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils.data import Dataset

from batchplan.runtime.records import PlannedItems, SpanIndex, SpanItem

__all__ = ["PlanDataset"]


class PlanDataset(Dataset):
    """Wraps a map-style dataset so items of span indices arrive as `SpanItem`.

    Args:
        dataset: anything with ``__getitem__(int)`` (and ``__len__``).
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        item = self.dataset[int(index)]
        if isinstance(index, SpanIndex):
            return SpanItem(item, index.start, index.length)
        return item

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The items of one micro-batch; `PlannedItems` with its record when ``indices`` has one."""
        rows = [int(i) for i in indices]
        many = getattr(self.dataset, "__getitems__", None)
        if many is not None and rows:
            items = list(many(rows))
        else:
            items = [self.dataset[row] for row in rows]
        items = [SpanItem(item, i.start, i.length) if isinstance(i, SpanIndex) else item
                 for item, i in zip(items, indices)]  # fmt: skip
        record = getattr(indices, "record", None)
        return items if record is None else PlannedItems(items, record)
