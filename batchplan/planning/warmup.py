"""Sequence-length warmup: the first tokens of the run train on short pieces of samples.

DeepSpeed's sequence-length warmup, planned ahead. With ``seqlen_warmup_min = m`` and
``seqlen_warmup_tokens = T``, the cap on a sequence grows linearly from ``m`` to
``max_tokens`` over the first ``T`` tokens of the run (inside the first epoch):
``cap(t) = m + (max_tokens - m) * t // T``, then ``max_tokens``.

How (epoch 0 only; later epochs plan whole samples as usual):

1. A seeded permutation of the entries is walked, counting tokens; the entries that
   begin before ``T`` tokens form the warmup region (the rest are planned as usual).
2. The region is cut into ``S`` stages of equal tokens (``S`` = ``T`` / four steps of
   one full micro-batch per rank, between 1 and 64), so each stage packs well. An
   entry belongs to the stage in which it begins; stage ``j`` starts at
   ``T_j = j * T // S`` tokens and its entries are split into pieces of at most
   ``cap(T_j)`` tokens that tile them, exactly like ``oversize="split"`` pieces (each
   piece its own sequence: ``length - 1`` loss tokens).
3. The planner forms each stage's micro-batches on its own and schedules the stages
   first, in order (shuffled within a stage), then the rest of the epoch. Stage ``j``
   then runs after every token of stages ``0..j-1``, at least ``T_j`` tokens, so
   every piece is at most the cap at the time it trains: a step that ends after
   ``t`` tokens holds no piece longer than ``cap(t)``. The cap is a staircase of
   ``S`` steps under the line.

Nothing is lost: pieces tile their samples, and every DESIGN.md guarantee holds (the
coverage check already understands pieces). Cost: O(n) once per build.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig
from batchplan.errors import DatasetError
from batchplan.plan import Entries, index_dtype

__all__ = ["MAX_STAGES", "SeqlenWarmup", "add_warmup_pieces", "warmup_cap"]

MAX_STAGES = 64  # the cap takes at most this many values
MIN_STAGE_CHUNKS = 4  # a stage holds at least this many full steps of one micro-batch per rank


@dataclasses.dataclass(frozen=True)
class SeqlenWarmup:
    """Where epoch 0's entries are when the first tokens are warmed up.

    Attributes:
        num_base: entries ``0..num_base-1`` are the entries of every other epoch.
        rest: base entries that epoch 0 plans as usual (outside the warmup), sorted.
        stage_offsets: stage ``j``'s pieces are entries ``stage_offsets[j]:stage_offsets[j + 1]``.
        caps: the cap of each stage's pieces.
    """

    num_base: int
    rest: NDArray[np.int64]
    stage_offsets: NDArray[np.int64]
    caps: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.caps)


def warmup_cap(tokens_done: int, config: PlanConfig) -> int:
    """The longest sequence allowed after ``tokens_done`` tokens of the run (Python ints: exact)."""
    low, span = config.seqlen_warmup_min, config.seqlen_warmup_tokens
    assert low is not None and span is not None  # the config has a warmup
    if tokens_done >= span:
        return config.max_tokens
    return low + (config.max_tokens - low) * tokens_done // span


def num_stages(config: PlanConfig) -> int:
    """Stages of the warmup: as many as keep each one at least `MIN_STAGE_CHUNKS` steps, up to 64."""
    stage_tokens = MIN_STAGE_CHUNKS * config.world_size * config.max_tokens
    assert config.seqlen_warmup_tokens is not None  # the config has a warmup
    return max(1, min(MAX_STAGES, config.seqlen_warmup_tokens // stage_tokens))


def add_warmup_pieces(entries: Entries, config: PlanConfig, rng: np.random.Generator) -> tuple[Entries, SeqlenWarmup]:
    """Append epoch 0's warmup pieces to ``entries`` (steps 1-2 of the module docstring).

    Raises:
        DatasetError: the epoch holds fewer tokens than the warmup.
    """
    warmup_tokens = config.seqlen_warmup_tokens
    assert warmup_tokens is not None  # the config has a warmup
    length = entries.length.astype(np.int64)
    total = int(length.sum())
    if total < warmup_tokens:
        raise DatasetError(
            f"`seqlen_warmup_tokens` {warmup_tokens:,}: the warmup runs over more tokens than one epoch holds "
            f"({total:,}); it lies inside the first epoch: lower `seqlen_warmup_tokens` to at most {total:,}"
        )
    order = rng.permutation(entries.num_entries)
    before = np.cumsum(length[order]) - length[order]  # tokens of the walk before each entry
    count = int(np.searchsorted(before, warmup_tokens))  # entries that begin inside the warmup
    chosen = order[:count]
    stages = num_stages(config)
    stage = before[:count] * stages // warmup_tokens  # non-decreasing along the walk
    caps = tuple(warmup_cap(j * warmup_tokens // stages, config) for j in range(stages))
    cap = np.asarray(caps, dtype=np.int64)[stage]
    pieces = (length[chosen] + cap - 1) // cap
    # shape (num_pieces,): the entry each piece comes from, and its index within the entry
    source = np.repeat(chosen, pieces)
    first = np.cumsum(pieces) - pieces
    index = np.arange(source.shape[0], dtype=np.int64) - np.repeat(first, pieces)
    piece_cap = np.repeat(cap, pieces)
    offset = index * piece_cap
    piece_length = np.minimum(piece_cap, length[source] - offset)
    base_start = np.zeros(entries.num_entries, dtype=np.int64) if entries.start is None else entries.start
    sample = entries.sample
    if sample is None:  # entry i is sample i
        sample = np.arange(entries.num_entries, dtype=index_dtype(entries.num_entries))
    extended = Entries(
        # A piece is part of its entry: it fits the entries' dtype (uint16 or int32).
        length=np.concatenate([entries.length, piece_length.astype(entries.length.dtype)]),
        dropped=entries.dropped,
        sample=np.concatenate([sample, sample[source]]),
        start=np.concatenate([base_start, base_start[source] + offset]),
    )
    per_stage = np.bincount(np.repeat(stage, pieces), minlength=stages)
    stage_offsets = entries.num_entries + np.concatenate([[0], np.cumsum(per_stage)]).astype(np.int64)
    rest = np.sort(order[count:]).astype(np.int64)
    return extended, SeqlenWarmup(entries.num_entries, rest, stage_offsets, caps)
