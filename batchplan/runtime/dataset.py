"""`PlanDataset`: carries a plan's token spans from the sampler to the collator.

A ``DataLoader`` hands the collator only ``dataset[i]`` for each index, never the
index itself, so a span (``--oversize truncate|split``) must travel with the item.
The sampler yields `SpanIndex` ints; this wrapper turns ``dataset[span_index]``
into a `SpanItem` (the item plus its span), which `PackCollator` and `PadCollator`
slice. Plain ``int`` indices pass through unchanged, so wrapping is harmless for
plans without spans. Cost: one tuple per item.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from batchplan.runtime.records import SpanIndex, SpanItem

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
