"""What the runtime hands to training: one `MicroBatch` record per planned row.

A record is a ``NamedTuple`` (about 0.3 us to build). It travels with its batch:
`PlanSampler` yields `PlannedRows` (the dataset rows of a micro-batch, a ``list``
that carries its record), `PlanDataset` fetches them as `PlannedItems` (the items,
same record) and the collators put the record on the batch they build. Both are
plain ``list`` subclasses, so they cross ``DataLoader`` worker processes by pickle.
`SpanIndex` is the dataset row a plan with token spans yields (an ``int`` that
also carries its span); `SpanItem` is the dataset item `PlanDataset` returns for
it, which the collators slice.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from batchplan.errors import ConfigError

__all__ = ["MicroBatch", "PlannedItems", "PlannedRows", "SpanIndex", "SpanItem"]


class MicroBatch(NamedTuple):
    """One micro-batch of one rank, as planned.

    Attributes:
        indices: dataset rows, in plan order (what the loader fetches).
        epoch: 0-based epoch.
        step: global optimizer step, counting across epochs.
        micro: position of this micro-batch within its step on this rank.
        num_micro: micro-batches per rank in this step (the same on every rank).
        is_last: ``micro == num_micro - 1``: run the optimizer after this one.
        tokens: real (non-pad) tokens of this micro-batch.
        loss_tokens: tokens of this micro-batch that carry a label.
        step_loss_tokens: loss tokens of the whole step on all ranks: the exact
            normaliser of a token-mean loss.
        tokens_before_step: tokens of every step before this one (all ranks).
        step_tokens: tokens of this step on all ranks.
        padded_tokens: tensor size in tokens (count x longest in pad mode).
        position: index of this row among this rank's rows of the epoch.
        starts: first token of each entry within its sample, or None when every
            entry is a whole sample (the plan has no spans).
        lengths: tokens of each entry, or None like ``starts``.
        world_size: the plan's data-parallel ranks (None on a record made by hand).
        rank: the rank this micro-batch belongs to (None on a record made by hand).
        source: in a mixture's plan, the source whose samples the micro-batch holds (its
            position in the plan's ``mixture`` metadata; -1 for an empty one): all its
            ``loss_tokens`` are that source's, for a loss per source. None in other plans.
    """

    indices: list[int]
    epoch: int
    step: int
    micro: int
    num_micro: int
    is_last: bool
    tokens: int
    loss_tokens: int
    step_loss_tokens: int
    tokens_before_step: int
    step_tokens: int
    padded_tokens: int
    position: int
    starts: list[int] | None = None
    lengths: list[int] | None = None
    world_size: int | None = None
    rank: int | None = None
    source: int | None = None

    @property
    def spans(self) -> list[tuple[int, int]] | None:
        """``(start, length)`` of each entry, or None when the plan has no spans."""
        if self.starts is None or self.lengths is None:
            return None
        return list(zip(self.starts, self.lengths))

    @property
    def loss_tokens_by_source(self) -> dict[int, int] | None:
        """Loss tokens of this micro-batch per source of a mixture's plan: ``{source:
        loss_tokens}`` (a micro-batch holds one source; ``{}`` for an empty one), keyed like
        `source` (``source_names(plan)[source]`` is its name). None in other plans.
        `batchplan.runtime.SourceLosses` sums them over a step's ranks for a loss per source."""
        if self.source is None:
            return None
        return {self.source: self.loss_tokens} if self.source >= 0 and self.indices else {}

    @property
    def is_empty(self) -> bool:
        """True for a planned empty micro-batch (run a zero-weight dummy forward)."""
        return not self.indices

    def loss_scale(self, world_size: int | None = None) -> float:
        """Factor turning this micro-batch's loss *sum* into its share of the step's mean.

        ``loss_sum * loss_scale()``, backpropagated on every micro-batch, gives
        gradients of the mean token loss over the whole step once DDP/FSDP average
        them over the plan's ranks: ``world_size / step_loss_tokens``. A step without
        loss tokens (only one-token samples) scales by ``world_size`` so its zero loss
        stays finite.

        Args:
            world_size: the ranks gradients are averaged over; default the plan's
                (a record made by hand must pass it). Another value than the plan's
                is an error: the step's mean would be off by their ratio.
        """
        if world_size is None:
            if self.world_size is None:
                raise ConfigError("this record does not know its plan's world size: pass loss_scale(world_size)")
            world_size = self.world_size
        elif self.world_size is not None and world_size != self.world_size:
            raise ConfigError(
                f"loss_scale(world_size={world_size}) on a plan of {self.world_size} ranks: gradients averaged "
                f"over {world_size} ranks would not be the step's mean; train on {self.world_size} ranks"
            )
        return world_size / max(self.step_loss_tokens, 1)


class SpanIndex(int):
    """A dataset row that carries the token span of the entry to train on.

    It is an ``int`` (``dataset[idx]`` works unchanged); `PlanDataset` reads
    ``start``/``length`` and the collators slice the token ids by them. ``ends_sample``
    is True when the plan knows the span is its sample's last tokens (a span shorter
    than the plan's cap), so a longer sample is drift that `PlanDataset` reports.
    """

    # int subclasses cannot have non-empty __slots__; the attributes live in __dict__.
    start: int
    length: int
    ends_sample: bool

    def __new__(cls, row: int, start: int, length: int, ends_sample: bool = False) -> SpanIndex:
        index = super().__new__(cls, row)
        index.start = start
        index.length = length
        index.ends_sample = ends_sample
        return index

    def __reduce__(self) -> tuple[Any, ...]:
        return (SpanIndex, (int(self), self.start, self.length, self.ends_sample))

    def __repr__(self) -> str:
        return f"SpanIndex({int(self)}, start={self.start}, length={self.length})"


class SpanItem(NamedTuple):
    """A dataset item with the span of it to use: ``tokens[start:start + length]``."""

    item: Any
    start: int
    length: int


class _Planned(list):
    """A list that carries the `MicroBatch` record of the micro-batch it belongs to."""

    def __init__(self, values: list[Any], record: MicroBatch) -> None:
        super().__init__(values)
        self.record = record

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (list(self), self.record))


class PlannedRows(_Planned):
    """The dataset rows of one micro-batch (what the loader fetches), with its `record`."""


class PlannedItems(_Planned):
    """The dataset items of one micro-batch (what the collator receives), with its `record`."""
