"""One epoch of a mixture planned: micro-batches of one source each, steps that hold every
source's token share, and the epoch's end.

An epoch's entries are its chunks (`batchplan.planning.mixture_entries`: the uses of one
pass of one source). Every chunk is formed on its own (pack or pad, as for one dataset) and
its micro-batches shuffled; `batchplan.planning.mixture_steps` takes them in the order that
keeps every prefix of the epoch within about one micro-batch of each source's share of its
tokens, step by step. The schedule keeps that order (steps are consecutive micro-batches;
ranks are balanced inside each step), so every step but an epoch's last holds each source's
share within ``max_tokens`` tokens, and the run never drifts. Packing each chunk on its own
costs at most one part-filled micro-batch per source, pass and epoch against packing the
epoch's samples together (docs/mixtures.md).

The epoch's last step takes what is left: completed with split and empty micro-batches, or
under ``drop_last`` dropped when incomplete (`batchplan.planning.mixture_epoch_end`). With a
sequence-length warmup, epoch 0's first tokens are pieces (`batchplan.planning.mixture_warmup`),
formed stage by stage and composed first.

Memory: an epoch of `batchplan.planning.bins.COMPRESS_FROM_ENTRIES` entries compresses each part's
bins as soon as they are formed (`batchplan.planning.parted_bins`): at 10^9 uses over 50
sources, the build peaks as one dataset of as many samples does (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig
from batchplan.errors import DatasetError
from batchplan.plan import EpochPlan, PackingBound, index_dtype
from batchplan.planning.bins import COMPRESS_FROM_ENTRIES, PackedBins
from batchplan.planning.epoch_batches import EpochBatches
from batchplan.planning.forming import form_micro_batches
from batchplan.planning.mixture_entries import MixtureEntries, prepare_mixture_entries, sizing_lengths
from batchplan.planning.mixture_epoch_end import drop_incomplete_end
from batchplan.planning.mixture_steps import compose_epoch
from batchplan.planning.parted_bins import CompressedBins, release_free_heap
from batchplan.planning.randomness import (
    STREAM_ENTRY_ORDER,
    STREAM_MICRO_BATCH_ORDER,
    STREAM_SEQLEN_WARMUP,
    KeyStream,
    epoch_rng,
)
from batchplan.planning.schedule import schedule_epoch
from batchplan.planning.threads import threads_for

__all__ = ["MixtureEntries", "Part", "plan_mixture_epoch", "prepare_mixture_entries", "sizing_lengths"]


_NO_ORDER = np.zeros(0, dtype=np.int64)


class Part(NamedTuple):
    """A chunk's micro-batches (or a warmup stage's pieces of one): its source, its formed
    micro-batches over its ``entries`` entries from ``first`` on (packed: their bins, compressed
    in a large epoch), how many and their packing, their seeded order, the chunk, and the
    segment it is composed in (a warmup stage, or after the warmup: `mixture_steps`)."""

    source: int
    formed: EpochBatches | PackedBins | CompressedBins
    num_batches: int
    packing: PackingBound | None
    first: int
    entries: int
    order: NDArray[np.int64]
    chunk: int
    segment: int = 0


def plan_mixture_epoch(
    mixture: MixtureEntries, config: PlanConfig, epoch: int, *, tokens_before: int = 0, threads: int = 1
) -> EpochPlan:
    """Plan one epoch of a mixture (the module docstring): micro-batches of one pass of one
    source each, a source's passes in order, interleaved by share and scheduled in that
    order; the plan's rows carry their source. A phase begins with the first step whose
    tokens before it (``tokens_before`` and the epoch's steps before it) reach its start.

    Raises:
        DatasetError: the epoch holds no samples, or ``drop_last`` would drop all of it.
    """
    entries = mixture.entries
    parts = form_parts(mixture, config, epoch, threads)
    if not parts:
        raise DatasetError(f"epoch {epoch} of the mixture holds no samples; use fewer epochs")
    release_free_heap()  # what forming freed in heaps, among what the parts keep
    values, dtype = None, None  # members are entry ids, or each part's samples drawn again
    if mixture.members_are_samples:
        values = [functools.partial(mixture.chunk_samples, part.chunk, config.seed) for part in parts]
        dtype = index_dtype(max(entries.num_entries, mixture.num_samples))
    bounds = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([part.entries for part in parts], out=bounds[1:])
    sources = (bounds, np.array([part.source for part in parts], dtype=np.int16))
    phases = (mixture.phase_starts, mixture.phase_weights)
    composed = compose_epoch(parts, entries.num_entries, config, tokens_before, phases, values, dtype)
    del parts, values  # each part's order (8 bytes per micro-batch): not while the epoch is scheduled
    if config.drop_last:
        composed = drop_incomplete_end(composed, config, epoch)
    return schedule_epoch(
        entries,
        composed.batches,
        config,
        epoch,
        tokens_before=tokens_before,
        order=composed.order,
        steps=composed.steps,
        sources=sources,
        threads=threads,
    )


def form_parts(mixture: MixtureEntries, config: PlanConfig, epoch: int, threads: int = 1) -> list[Part]:
    """Every chunk of ``epoch`` formed into micro-batches and shuffled, source by source, a
    source's passes in order; in epoch 0 with a warmup, first each stage's pieces of every
    chunk (segment ``j`` for stage ``j``), then the rest of each chunk (the last segment)."""
    rng = epoch_rng(config.seed, epoch, STREAM_ENTRY_ORDER)
    order_rng = epoch_rng(config.seed, epoch, STREAM_MICRO_BATCH_ORDER)
    chunks = range(int(mixture.epoch_chunks[epoch]), int(mixture.epoch_chunks[epoch + 1]))
    # A large epoch compresses each part's bins as soon as they are formed: they never add up.
    compress = int(mixture.chunk_bounds[chunks.stop] - mixture.chunk_bounds[chunks.start]) >= COMPRESS_FROM_ENTRIES
    form = functools.partial(_form, mixture, config, compress=compress, threads=threads)
    warmup = mixture.warmup if epoch == 0 else None
    parts = []
    if warmup is not None:
        stage_rng = epoch_rng(config.seed, 0, STREAM_SEQLEN_WARMUP)
        for stage, position, first, last in zip(
            warmup.part_stage, warmup.part_chunk, warmup.part_bounds[:-1], warmup.part_bounds[1:]
        ):
            parts.append(form(chunks[position], int(first), int(last), stage_rng, stage_rng, int(stage)))
    segment = 0 if warmup is None else warmup.num_stages
    spans = []
    for position, chunk in enumerate(chunks):
        first = int(mixture.chunk_bounds[chunk]) + (0 if warmup is None else int(warmup.region[position]))
        last = int(mixture.chunk_bounds[chunk + 1])
        if last > first:
            spans.append((chunk, first, last))
    # Side by side, a part a thread, where the epoch keeps its bins; a compressed epoch forms its
    # parts one at a time, so that only one part's bins are held before they are compressed.
    if config.mode == "pack" and threads > 1 and len(spans) > 1 and not compress:
        return parts + _formed_side_by_side(mixture, config, spans, rng, order_rng, segment, compress, threads)
    return parts + [form(chunk, first, last, rng, order_rng, segment) for chunk, first, last in spans]


def _formed_side_by_side(
    mixture: MixtureEntries, config: PlanConfig, spans, rng, order_rng, segment: int, compress: bool, threads: int
) -> list[Part]:
    """Packed parts of ``spans`` (``(chunk, first, last)`` each) formed on ``threads`` threads, a
    part each: the parts `_form` makes one after another. Packing draws from ``rng`` only the
    keys of its shuffle within lengths (`KeyStream`): each part's generator starts where
    ``rng`` stands at its turn, and ``rng`` moves past its keys; each part's order is drawn
    from ``order_rng`` in the parts' order."""
    starts = [np.random.Generator(KeyStream.draw_later(rng, last - first).bit_generator) for _, first, last in spans]

    def unshuffled(span: tuple[int, int, int], part_rng: np.random.Generator) -> Part:
        chunk, first, last = span
        return _form(mixture, config, chunk, first, last, part_rng, None, segment, compress=compress, threads=1)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        formed = pool.map(unshuffled, spans, starts)
        return [part._replace(order=order_rng.permutation(part.num_batches)) for part in formed]


def _form(
    mixture: MixtureEntries,
    config: PlanConfig,
    chunk: int,
    first: int,
    last: int,
    rng,
    order_rng,
    segment: int,
    *,
    compress: bool,
    threads: int,
) -> Part:
    """Entries ``first:last`` (of ``chunk``) formed into micro-batches with ``rng`` and
    shuffled with ``order_rng`` (None: not yet, an empty order); packed, their bins (compressed in
    a large epoch)."""
    formed = form_micro_batches(mixture.entries.length[first:last], config, rng, threads_for(last - first, threads))
    kept: EpochBatches | PackedBins | CompressedBins = formed
    if isinstance(formed.layout, PackedBins):  # packed: the bins, compressed in a large epoch
        kept = CompressedBins(formed.layout) if compress else formed.layout
    part = Part(
        int(mixture.chunk_source[chunk]),
        kept,
        formed.count,
        formed.packing,
        first,
        last - first,
        _NO_ORDER if order_rng is None else order_rng.permutation(formed.count),
        chunk,
        segment,
    )
    del formed, kept
    if compress:
        release_free_heap()  # the bins' slots, freed among what the parts keep
    return part
