"""A plan seen through the interface every layout has, one rank's record batch at a time:
readers that must stream (validate, the summary) are checked through it."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa

from batchplan.formats.opened_plan import OpenedPlan


class RankReader:
    """A plan that hands out one rank's record batch at a time (no ``read_epoch``, no
    ``read_all``) and counts the reads of each (epoch, rank)."""

    MEMBERS = ("metadata", "schema", "world_size", "num_epochs", "num_samples", "num_steps", "verify", "path")

    def __init__(self, plan) -> None:
        self._plan = plan
        self.reads: Counter = Counter()

    def read_rank(self, epoch: int, rank: int, *, checked: bool = True) -> pa.RecordBatch:
        self.reads[epoch, rank] += 1
        return self._plan.read_rank(epoch, rank, checked=checked)

    rank_rows = OpenedPlan.rank_rows  # `read_rank` as numpy: counted there

    def __getattr__(self, name: str):
        if name not in self.MEMBERS:
            raise AttributeError(f"{name} is not part of the one-rank-at-a-time plan interface")
        return getattr(self._plan, name)


class WithMetadata:
    """A plan read as it is but with other metadata: a checker's view of a tampered plan."""

    def __init__(self, plan, metadata) -> None:
        self._plan, self.metadata = plan, metadata

    def __getattr__(self, name):
        return getattr(self._plan, name)
