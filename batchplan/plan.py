"""The data types of a plan in memory: what planning makes and plan files write.

- `Entries`: what micro-batches hold: samples, or spans of samples when they are
  truncated or split (one entry per span).
- `EpochPlan`: one epoch's micro-batches, rows ordered by (rank, step, micro).
- `Plan`: the config, the entries and every epoch.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig

__all__ = ["Entries", "EpochPlan", "Members", "PackingBound", "Plan", "index_dtype", "length_dtype", "packing_fill"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entries:
    """What micro-batches hold: samples, or spans of samples (one entry per span).

    Attributes:
        length: tokens of each entry: uint16 when every entry has fewer than 2^16 tokens,
            else int32 (`length_dtype`).
        dropped: reason -> sample indices left out of every epoch.
        sample: dataset row of each entry (int32 below 2^31 samples, else int64), or
            None when entry ``i`` is sample ``i`` (nothing dropped or cut: no array).
        start: first token of each entry within its sample, or None when every
            entry is a whole sample.
        loss_tokens: tokens carrying a label in each entry (uint16 when every value is
            below 2^16, else int32), or None when every entry has ``length - 1`` (no
            loss-token column: the planner then counts them without a pass over entries,
            and keeps no array).
    """

    length: NDArray[np.integer]
    dropped: dict[str, NDArray[np.int64]]
    sample: NDArray[np.integer] | None = None
    start: NDArray[np.int64] | None = None
    loss_tokens: NDArray[np.integer] | None = None

    @property
    def num_entries(self) -> int:
        return int(self.length.shape[0])

    @property
    def has_spans(self) -> bool:
        return self.start is not None

    @property
    def loss_is_length_minus_one(self) -> bool:
        return self.loss_tokens is None

    def samples_of(self, entries: NDArray[np.integer]) -> NDArray[np.integer]:
        """Dataset rows of the given entries."""
        return entries if self.sample is None else self.sample[entries]


def index_dtype(count: int) -> np.dtype:
    """int32 for indices below 2^31 (half the memory of int64), else int64."""
    return np.dtype(np.int32) if count < 2**31 else np.dtype(np.int64)


def length_dtype(longest: int) -> np.dtype:
    """uint16 for token counts below 2^16 (half the memory of int32), else int32."""
    return np.dtype(np.uint16) if longest < 2**16 else np.dtype(np.int32)


class Members:
    """An epoch's members (entry ids) in row order, held in one array. Planning may hand an
    epoch members laid out a window at a time instead (`batchplan.planning.bins.PendingMembers`):
    the same values from `between` and `all`."""

    def __init__(self, array: NDArray[np.integer]) -> None:
        self._array = array

    @property
    def count(self) -> int:
        return int(self._array.shape[0])

    def between(self, start: int, stop: int) -> NDArray[np.integer]:
        """Members ``start:stop`` (a view)."""
        return self._array[start:stop]

    def all(self) -> NDArray[np.integer]:
        return self._array


@dataclasses.dataclass(frozen=True)
class EpochPlan:
    """One epoch's micro-batches, rows ordered by (rank, step, micro).

    Every rank has the same number of rows (``rows_per_rank``); rank ``r`` holds rows
    ``r * rows_per_rank`` to ``(r + 1) * rows_per_rank``. Row ``i`` holds entries
    ``members[offsets[i]:offsets[i + 1]]`` (indices into `Entries`); `members_between`
    reads a range of them without laying out all (a writer's way, rank after rank). Every
    rank's rows have the same (step, micro, num_micro) sequence: stored once, for one rank.

    Index arrays and per-row counts are int32 where their values fit (`index_dtype`: half
    the memory of int64), else int64; sums over rows are int64.
    """

    epoch: int
    world_size: int
    offsets: NDArray[np.integer]  # int32 below 2^31 members
    member_store: Members  # entry ids (int32 below 2^31 entries), laid out or a window at a time
    rank_step: NDArray[np.int64]  # epoch-local step of each of one rank's rows
    rank_micro: NDArray[np.int32]  # position in the step on the rank
    rank_num_micro: NDArray[np.int32]  # micro-batches per rank in the row's step
    tokens: NDArray[np.integer]  # int32 when every row's tokens fit
    loss_tokens: NDArray[np.integer]  # the dtype of tokens
    padded_tokens: NDArray[np.integer]  # count x longest in pad mode (int64), tokens in pack mode
    cost: NDArray[np.float64] | None  # tokens + attention term (`batchplan.planning.cost`), with a coefficient
    step_tokens: NDArray[np.int64]  # per epoch-local step, all ranks
    step_loss_tokens: NDArray[np.int64]
    dropped_entries: NDArray[np.int64]  # entries left out by drop_last
    packing: PackingBound | None = None  # pack mode: the micro-batches as packed, and their bound
    source: NDArray[np.int16] | None = None  # a mixture's: each row's source (-1: empty), else None

    @property
    def members(self) -> NDArray[np.integer]:
        """Every row's members, one after another (all laid out, and kept, on first use)."""
        return self.member_store.all()

    def members_between(self, start: int, stop: int) -> NDArray[np.integer]:
        """Members ``start:stop``, e.g. ``offsets[first_row]:offsets[last_row + 1]``."""
        return self.member_store.between(start, stop)

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_steps(self) -> int:
        return int(self.step_tokens.shape[0])

    @property
    def rows_per_rank(self) -> int:
        return self.num_rows // self.world_size

    @functools.cached_property
    def step(self) -> NDArray[np.int64]:
        """Epoch-local step of every row."""
        return _broadcast(self.rank_step, (self.world_size, self.rows_per_rank))

    @functools.cached_property
    def rank(self) -> NDArray[np.int32]:
        """Rank of every row."""
        return _broadcast(np.arange(self.world_size, dtype=np.int32)[:, None], (self.world_size, self.rows_per_rank))

    @functools.cached_property
    def micro(self) -> NDArray[np.int32]:
        return _broadcast(self.rank_micro, (self.world_size, self.rows_per_rank))

    @functools.cached_property
    def num_micro(self) -> NDArray[np.int32]:
        return _broadcast(self.rank_num_micro, (self.world_size, self.rows_per_rank))


@dataclasses.dataclass(frozen=True)
class PackingBound:
    """An epoch's micro-batches as packed (before its end is completed or dropped), and a
    lower bound on the micro-batches of any packing of the same entries
    (`batchplan.planning.cutting_stock`)."""

    micro_batches: int
    tokens: int
    bound: int
    kind: str  # which bound: "lp", "l2" or "volume"

    def __add__(self, other: PackingBound) -> PackingBound:
        """Two packings side by side (a warmup's stages): their counts and bounds add up."""
        kind = self.kind if self.kind == other.kind else "mixed"
        return PackingBound(
            self.micro_batches + other.micro_batches, self.tokens + other.tokens, self.bound + other.bound, kind
        )

    def fill(self, max_tokens: int) -> float:
        """Tokens / (micro-batches x max_tokens) of the packing."""
        return packing_fill(self.tokens, self.micro_batches, max_tokens)

    def bound_fill(self, max_tokens: int) -> float:
        """The most any packing of these entries fills: tokens / (bound x max_tokens)."""
        return packing_fill(self.tokens, self.bound, max_tokens)

    def as_dict(self) -> dict[str, int | str]:
        return dataclasses.asdict(self)


def packing_fill(tokens: int, micro_batches: int, max_tokens: int) -> float:
    """tokens / (micro_batches x max_tokens): how full packed micro-batches are (1.0 for none)."""
    return tokens / (micro_batches * max_tokens) if micro_batches else 1.0


@dataclasses.dataclass(frozen=True)
class Plan:
    """A whole plan in memory: the config, the entries, and every epoch."""

    config: PlanConfig
    num_samples: int
    entries: Entries
    epochs: tuple[EpochPlan, ...]

    @property
    def num_steps(self) -> int:
        return sum(epoch.num_steps for epoch in self.epochs)


def _broadcast(values: NDArray, shape: tuple[int, int]) -> NDArray:
    """``values`` broadcast to ``shape``, flattened: every rank's rows from one rank's
    (or from one value per rank). A copy, faster than `np.tile`/`np.repeat`."""
    out = np.empty(shape, dtype=values.dtype)
    out[:] = values
    return out.reshape(-1)
