"""A mixture's epoch composed into steps: every part's micro-batches (one pass of one source
each, `batchplan.planning.mixture_epochs`) in one `EpochBatches`, and the order in which
`batchplan.kernels.interleave.compose_steps` takes them, step by step, so that every step
but the epoch's last holds each source within ``max_tokens`` of its weight.

A source's queue is its parts' micro-batches, part after part (its passes in order), each
part's in its seeded order. The parts come in segments (one without a sequence-length
warmup; with one, each warmup stage, then the rest of the epoch: `mixture_warmup`), and a
source's queue holds them segment after segment: a step takes micro-batches of the segments
so far only, and the next segment joins where what they have left fits in one step
(`batchplan.kernels.interleave.compose_segments`). The steps are composed in one pass, so
each source keeps to its share across segments as across any steps, and only the epoch's
last step takes what is left.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig
from batchplan.kernels.interleave import compose_segments, compose_steps
from batchplan.plan import index_dtype
from batchplan.planning.epoch_batches import EpochBatches
from batchplan.planning.forming import concatenate_parts
from batchplan.planning.mixture_warmup import stage_lag
from batchplan.planning.parted_bins import PartedBins

__all__ = ["Composed", "compose_epoch", "step_sizing"]


@dataclasses.dataclass
class Composed:
    """An epoch's micro-batches and their composed steps.

    Attributes:
        batches: every part's micro-batches, part after part (ids in that order).
        order: every micro-batch id in the order the steps take them.
        steps: shape (steps + 1,): step ``k`` is ``order[steps[k]:steps[k + 1]]``.
        part_bounds: shape (parts + 1,): part ``k``'s micro-batches are ids
            ``part_bounds[k]:part_bounds[k + 1]``.
        part_source: shape (parts,): each part's source.
        sizing: `step_sizing` at the epoch's start.
    """

    batches: EpochBatches
    order: NDArray[np.integer]
    steps: NDArray[np.int64]
    part_bounds: NDArray[np.int64]
    part_source: NDArray[np.int64]
    sizing: NDArray[np.float64]

    def sources_of(self, ids: NDArray[np.integer]) -> NDArray[np.int64]:
        """The source of each of the micro-batches ``ids``."""
        return self.part_source[np.searchsorted(self.part_bounds, ids, side="right") - 1]


def compose_epoch(
    parts: list, num_entries: int, config: PlanConfig, tokens_before: int, phases, values=None, dtype=None
) -> Composed:
    """Every part's micro-batches in one `EpochBatches` (packed: `PartedBins`, the parts' bins
    as they are; padded: laid out one part after another), and their order and steps (the
    module docstring); ``parts``: each a `batchplan.planning.mixture_epochs.Part`.

    Every step holds each source within ``max_tokens`` of its phase's weight (validate's
    check; a billionth inside it, against rounding; ``phases``: the run's tokens before each
    phase and the phases' weights), and deficits are counted against the epoch's own shares
    (its sources' tokens over its tokens, within a document of the weights) from the epoch's
    last phase on, so that every source runs out with the epoch's last step. ``values``,
    ``dtype``: `PartedBins`'s (members laid out as samples).
    """
    batches = _joined(parts, num_entries, values, dtype)
    base = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([part.num_batches for part in parts], out=base[1:])
    sources = sorted({part.source for part in parts})
    segments = sorted({part.segment for part in parts})
    queue, tokens, sizes = _queues(parts, base, sources, segments, batches.tokens())
    source_offsets = np.zeros(len(sources) + 1, dtype=np.int64)
    np.cumsum(sizes.sum(axis=0), out=source_offsets[1:])
    source_tokens = np.array(
        [tokens[a:b].sum() for a, b in zip(source_offsets[:-1], source_offsets[1:])], dtype=np.float64
    )
    shares = source_tokens / max(float(source_tokens.sum()), 1.0)
    starts, weights = phases
    asked = weights[:, sources] / np.maximum(weights[:, sources].sum(axis=1, keepdims=True), 1e-300)
    asked = np.ascontiguousarray(asked)  # columns taken are Fortran-ordered: one compiled version
    sizing = step_sizing(config, tokens_before, float(tokens.mean()) if tokens.shape[0] else 0.0)
    order = np.empty(queue.shape[0], dtype=np.int64)
    steps = np.empty(queue.shape[0] + 1, dtype=np.int64)
    arguments = (tokens, starts, asked, shares, config.world_size, config.max_tokens * (1 - 1e-9), sizing, order, steps)
    if len(segments) == 1:
        num_steps = compose_steps(source_offsets, *arguments)
    else:  # segment g of source s ends at limits[g, s]
        limits = source_offsets[:-1] + np.cumsum(sizes, axis=0)
        joins = _joins(tokens, source_offsets, limits, config, tokens_before)
        num_steps = compose_segments(source_offsets, limits, joins, *arguments)
    del tokens
    part_source = np.array([part.source for part in parts], dtype=np.int64)
    return Composed(
        batches,
        queue[order],
        steps[: num_steps + 1].copy(),
        base,
        part_source,
        sizing,
    )


def _queues(
    parts: list, base: NDArray[np.int64], sources: list[int], segments: list[int], formed_tokens: NDArray
) -> tuple[NDArray[np.integer], NDArray[np.int64], NDArray[np.int64]]:
    """``(queue, tokens, sizes)``: every source's queue, one after another (the micro-batch ids
    of its parts, segment after segment, each part's in its order; `index_dtype` of the ids),
    the tokens of each (int64), and the micro-batches of each (segment, source). Each part's
    tokens are gathered from its own (``formed_tokens[base[k]:base[k + 1]]``: in cache)."""
    by_queue: dict[tuple[int, int], list[int]] = {}
    for index, part in enumerate(parts):
        by_queue.setdefault((part.source, part.segment), []).append(index)
    sizes = np.zeros((len(segments), len(sources)), dtype=np.int64)
    queue = np.empty(int(base[-1]), dtype=index_dtype(int(base[-1])))
    tokens = np.empty(int(base[-1]), dtype=np.int64)
    at = 0
    for column, source in enumerate(sources):
        for row, segment in enumerate(segments):
            for index in by_queue.get((source, segment), []):
                order, first = parts[index].order, int(base[index])
                np.add(order, first, out=queue[at : at + order.shape[0]], casting="unsafe")  # ids fit
                tokens[at : at + order.shape[0]] = formed_tokens[first : int(base[index + 1])][order]
                sizes[row, column] += order.shape[0]
                at += order.shape[0]
    return queue, tokens, sizes


def _joined(parts: list, num_entries: int, values, dtype) -> EpochBatches:
    """Every part's micro-batches in one `EpochBatches`, part after part."""
    bins = [part.formed for part in parts if not isinstance(part.formed, EpochBatches)]
    if len(bins) == len(parts):
        layout = PartedBins(bins, [part.first for part in parts], num_entries, values=values, dtype=dtype)
        batches = EpochBatches.of_bins(layout)
        packings = [part.packing for part in parts if part.packing is not None]
        batches.packing = sum(packings[1:], packings[0])
        return batches
    laid = [
        (part.formed, part.first + np.arange(part.entries, dtype=np.int64), np.arange(part.num_batches))
        for part in parts
    ]
    return concatenate_parts(laid, num_entries)


def _joins(tokens, source_offsets, limits, config: PlanConfig, tokens_before: int) -> NDArray[np.float64]:
    """Per segment ``g``, the run's tokens from which it may join early (`compose_segments`):
    those before it, less `stage_lag`, so that a micro-batch of segment ``g`` is taken in a
    step that begins after at least that many (the warmup's caps rest on it)."""
    sums = np.concatenate([[0], np.cumsum(tokens)])
    bounds = np.vstack([source_offsets[:-1], limits])  # shape (segments + 1, sources)
    held = (sums[bounds[1:]] - sums[bounds[:-1]]).sum(axis=1)  # each segment's tokens
    before = np.concatenate([[0], np.cumsum(held)[:-1]])
    return (tokens_before + before - stage_lag(config, limits.shape[1])).astype(np.float64)


def step_sizing(config: PlanConfig, tokens_before: int, mean_tokens: float) -> NDArray[np.float64]:
    """`compose_steps`'s ``(rounds, tokens_before, start, target, ramp_tokens, max_rounds)``
    (``mean_tokens``: of the epoch's micro-batches, for a ramp-up to M per rank)."""
    per_step = config.micro_batches_per_step
    if per_step is not None and not config.has_rampup:
        return np.array([per_step, tokens_before, 0, 0, 0, 0], dtype=np.float64)
    if config.tokens_per_step is not None:
        full = float(config.tokens_per_step)
    else:  # a ramp-up to M micro-batches per rank: the mean tokens of such a step
        assert per_step is not None  # steps without a token target count micro-batches
        full = mean_tokens * config.world_size * per_step
    start = float(config.rampup_start or 0) if config.has_rampup else full
    ramp = config.rampup_tokens if config.has_rampup else 0
    return np.array([0, tokens_before, start, full, ramp, per_step or 0], dtype=np.float64)
