"""A mixture's sequence-length warmup: epoch 0's first tokens cut into pieces under a growing
cap, source by source, so that the warmup's steps hold every source's share too.

As for one dataset (`batchplan.planning.warmup`), the cap on a sequence grows from
``seqlen_warmup_min`` to ``max_tokens`` over the run's first ``T = seqlen_warmup_tokens``
tokens, in ``S`` stages (`warmup.num_stages`) of one cap each. A mixture's steps take each
source's micro-batches in its share, so each source gives the warmup its share of it:

1. Source ``s`` gives the entries of its epoch-0 order that begin before its due tokens of
   the run's first ``T + D`` tokens (its weight there: the phases', over the epoch's
   sources); stage ``j`` is those that begin in its due tokens of the ``j``-th ``S``-th of them.
2. Each source's queue holds its stages in order, then the rest of its epoch, and the steps
   are composed in one pass that takes micro-batches of the stages so far only
   (`batchplan.kernels.interleave.compose_segments`): stage ``j`` joins where what they have
   left fits in the step, or, where a source has too little left for its share of the step,
   once the run's tokens reach ``X_j - D``: ``X_j`` is the tokens of stages ``0..j-1``, ``D``
   (`stage_lag`) what fits in a step (`carry_bound`) and an entry of each source (the cuts
   of step 1 overshoot each source's due tokens by up to one). Either way a stage-``j`` piece
   is trained in a step that begins after at least ``X_j - D`` tokens.
3. Stage ``j``'s pieces are cut to ``cap(max(0, X_j - D))``, tiling their entries as
   ``oversize="split"`` pieces do (``length - 1`` loss tokens each), so a step that ends after
   ``t`` tokens holds no piece longer than ``cap(t)``: exactly, whatever the composition. The
   stages reach ``T + D`` tokens, so the rest of the epoch begins after ``T`` tokens, where
   the cap is ``max_tokens``; a source with fewer tokens in epoch 0 than its share of them
   gives all it has, and the others give more (the part of the run the stages cover grows
   until they hold ``T + D`` tokens).

Against one dataset the staircase lies at most ``D`` tokens (a step, and an entry of each
source) to the right.
Cost: O(epoch 0's entries) once per build.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig
from batchplan.errors import DatasetError
from batchplan.plan import Entries
from batchplan.planning.warmup import num_stages, warmup_cap

__all__ = ["FirstEpoch", "MixtureWarmup", "add_mixture_warmup", "carry_bound", "stage_lag"]

_GROWTH = 1.25  # how much the part of the run the stages cover grows while they fall short


@dataclasses.dataclass(frozen=True)
class FirstEpoch:
    """What the warmup reads of a mixture's entries (`batchplan.planning.mixture_entries`).

    Attributes:
        chunk_bounds: shape (chunks + 1,): epoch 0's chunk ``c`` is entries
            ``chunk_bounds[c]:chunk_bounds[c + 1]`` (its sources in order, each one's passes in order).
        chunk_source: shape (chunks,): the source of each.
        phase_starts: shape (phases,): the run's tokens before each phase (0 first).
        phase_weights: shape (phases, sources): each phase's weights.
    """

    chunk_bounds: NDArray[np.int64]
    chunk_source: NDArray[np.int64]
    phase_starts: NDArray[np.float64]
    phase_weights: NDArray[np.float64]


@dataclasses.dataclass(frozen=True)
class MixtureWarmup:
    """Where epoch 0's warmup lies among a mixture's entries.

    Attributes:
        region: shape (epoch 0's chunks,): the entries at the start of each chunk that the
            warmup cuts into pieces (the rest of the chunk is planned as usual).
        part_stage: shape (parts,): the stage of each part of pieces.
        part_chunk: shape (parts,): the chunk whose entries each part cuts.
        part_bounds: shape (parts + 1,): part ``k`` is entries ``part_bounds[k]:part_bounds[k + 1]``
            (pieces, after every chunk's entries), stage after stage, chunk after chunk.
        caps: the cap of each stage's pieces.
    """

    region: NDArray[np.int64]
    part_stage: NDArray[np.int64]
    part_chunk: NDArray[np.int64]
    part_bounds: NDArray[np.int64]
    caps: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.caps)


def carry_bound(config: PlanConfig) -> int:
    """The most tokens a step holds where what the stages so far have left fits in it (as the
    last step of a composition does):
    ``world_size x M x max_tokens`` with ``M`` micro-batches per rank (a ramp-up takes at most
    ``M``), else the step's token target and two rounds of ``max_tokens`` (the rounds nearest
    a target: `batchplan.kernels.interleave`)."""
    per_step = config.micro_batches_per_step
    if per_step is not None:
        return config.world_size * per_step * config.max_tokens
    assert config.tokens_per_step is not None  # steps are sized by tokens when not by micro-batches
    return config.tokens_per_step + 2 * config.world_size * config.max_tokens


def stage_lag(config: PlanConfig, num_sources: int) -> int:
    """How many tokens before the tokens of the stages before it a stage may join the steps
    (``D`` of the module docstring): what fits in one step (`carry_bound`), and an entry of
    each source, by which the stages' cuts overshoot the sources' due tokens (a stage joins
    early where a source is short: `batchplan.kernels.interleave.compose_segments`)."""
    return carry_bound(config) + num_sources * config.max_tokens


def add_mixture_warmup(entries: Entries, first: FirstEpoch, config: PlanConfig) -> tuple[Entries, MixtureWarmup]:
    """``entries`` with epoch 0's warmup pieces appended, and where they lie (the module
    docstring).

    Raises:
        DatasetError: epoch 0 holds fewer tokens than the warmup.
    """
    warmup_tokens = config.seqlen_warmup_tokens
    assert warmup_tokens is not None  # the config has a warmup
    ends = first.chunk_bounds[1:]
    total = int(entries.length[int(first.chunk_bounds[0]) : int(ends[-1])].sum(dtype=np.int64))
    if total < warmup_tokens:
        raise DatasetError(
            f"`seqlen_warmup_tokens` {warmup_tokens:,}: the warmup runs over more tokens than the mixture's epoch 0 "
            f"holds ({total:,}); it lies inside the first epoch: lower `seqlen_warmup_tokens` to at most {total:,}, "
            "or use fewer epochs"
        )
    stages, bound = num_stages(config), stage_lag(config, int(np.unique(first.chunk_source).shape[0]))
    region, stage = _stages(entries, first, warmup_tokens + bound, stages)
    before_stage = np.zeros(stages + 1, dtype=np.int64)
    stage_tokens = np.bincount(stage, weights=entries.length[region], minlength=stages)
    np.cumsum(stage_tokens.astype(np.int64), out=before_stage[1:])
    caps = tuple(warmup_cap(max(0, int(before_stage[j]) - bound), config) for j in range(stages))
    order = np.lexsort((region, stage))  # stage after stage; within one, chunk after chunk
    region, stage = region[order], stage[order]
    cap = np.asarray(caps, dtype=np.int64)[stage]
    pieces = -(-entries.length[region].astype(np.int64) // cap)
    extended = _with_pieces(entries, region, cap, pieces)
    chunk_of = np.searchsorted(ends, region, side="right")  # its chunk's position in epoch 0
    return extended, _laid_out(entries.num_entries, stage, chunk_of, pieces, ends.shape[0], caps)


def _stages(entries: Entries, first: FirstEpoch, span: int, stages: int):
    """``(region, stage)``: the entries of epoch 0 the warmup cuts (ids, source after source)
    and the stage of each (step 1 of the module docstring): the entries of each source that
    begin before its due tokens of the run's first ``span`` (by the phases' weights, or by its
    tokens in the epoch where the sources they ask for run out), stage ``j`` those that begin
    in its due tokens of the stage's part of the run."""
    sources = first.chunk_source
    present = np.unique(sources)
    chunks = np.arange(sources.shape[0])
    ranges = [
        (int(first.chunk_bounds[chunks[sources == s][0]]), int(first.chunk_bounds[chunks[sources == s][-1] + 1]))
        for s in present
    ]
    sums = [np.cumsum(entries.length[a:b], dtype=np.int64) for a, b in ranges]
    begins = [np.concatenate([[0], held[:-1]]) for held in sums]
    supply = np.array([int(held[-1]) if held.size else 0 for held in sums], dtype=np.float64)
    by_weight = functools.partial(_due_at, first.phase_starts, first.phase_weights[:, present])
    limits = _reach(begins, sums, by_weight, span, stages)
    if limits is None:  # the sources the phases ask for run out: every source by its tokens
        limits = _reach(
            begins, sums, lambda points: np.outer(points, supply / max(float(supply.sum()), 1.0)), span, stages
        )
    assert limits is not None  # every source with tokens has a share
    counts = [int(np.searchsorted(begin, limit[-1], side="left")) for begin, limit in zip(begins, limits.T)]
    region = np.concatenate([np.arange(a, a + count, dtype=np.int64) for (a, _), count in zip(ranges, counts)])
    stage = np.concatenate(
        [
            np.searchsorted(limit[1:-1], begin[:count], side="right")
            for begin, limit, count in zip(begins, limits.T, counts)
        ]
    )
    return region, stage.astype(np.int64)


def _reach(begins, sums, due, span: int, stages: int) -> NDArray[np.float64] | None:
    """Shape (stages + 1, sources): where each stage begins in each source's order (and the
    last ends): ``due`` (each source's tokens of the run's first ``t``, for each ``t`` of an
    array) at the stages' bounds over the run's first ``covered`` tokens, ``covered`` grown
    from ``span`` until the entries that begin before the last bound hold ``span`` tokens (or
    are all); None when the sources of a positive share run out first."""
    covered = float(span)
    while True:
        limits = due(covered * np.arange(stages + 1) / stages)
        counts = [int(np.searchsorted(begin, limit, side="left")) for begin, limit in zip(begins, limits[-1])]
        held = sum(int(total[count - 1]) for total, count in zip(sums, counts) if count)
        full = [count == begin.shape[0] for begin, count in zip(begins, counts)]
        if held >= span or all(full):
            return limits
        if all(done or part <= 0 for done, part in zip(full, limits[-1])):
            return None
        covered *= _GROWTH


def _due_at(starts: NDArray[np.float64], weights: NDArray[np.float64], points: NDArray[np.float64]):
    """Shape (points, sources): each source's tokens of the run's first ``point`` tokens, for
    each point: every phase's weights (over these sources, as the steps are held to them)
    times the phase's tokens before the point."""
    ends = np.append(starts[1:], np.inf)
    inside = np.clip(np.minimum(ends[None, :], points[:, None]) - starts[None, :], 0.0, None)
    weights = weights / np.maximum(weights.sum(axis=1, keepdims=True), 1e-300)
    return inside @ weights


def _with_pieces(entries: Entries, region: NDArray[np.int64], cap: NDArray[np.int64], pieces) -> Entries:
    """``entries`` and, after them, the ``pieces`` pieces of at most ``cap`` tokens that tile
    each of ``region``, in that order."""
    length = entries.length[region].astype(np.int64)
    # shape (all pieces,): the entry each piece comes from, and its index within the entry
    whose = np.repeat(np.arange(region.shape[0]), pieces)
    index = np.arange(whose.shape[0], dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    offset = index * cap[whose]
    piece_length = np.minimum(cap[whose], length[whose] - offset)
    start = np.zeros(entries.num_entries, dtype=np.int64) if entries.start is None else entries.start
    assert entries.sample is not None  # a warmup's entries name their samples (`mixture_entries`)
    return Entries(
        length=np.concatenate([entries.length, piece_length.astype(entries.length.dtype)]),
        dropped=entries.dropped,
        sample=np.concatenate([entries.sample, entries.sample[region[whose]]]),
        start=np.concatenate([start, start[region[whose]] + offset]),
    )


def _laid_out(num_base: int, stage, chunk_of, pieces, num_chunks: int, caps: tuple[int, ...]) -> MixtureWarmup:
    """Where the pieces lie: one part per (stage, chunk) that has some, in the order they are cut."""
    key = stage * (num_chunks + 1) + chunk_of
    starts = np.flatnonzero(np.diff(key, prepend=-1))
    bounds = np.zeros(starts.shape[0] + 1, dtype=np.int64)
    if starts.size:
        np.cumsum(np.add.reduceat(pieces, starts), out=bounds[1:])
    region = np.bincount(chunk_of, minlength=num_chunks).astype(np.int64)
    return MixtureWarmup(region, stage[starts], chunk_of[starts], num_base + bounds, caps)
