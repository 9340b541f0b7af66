"""A mixture's run as epochs: each source's selected samples (`mixture_sizing`) cut into
epochs, and each epoch's micro-batches interleaved so that every step holds each source's
token share.

Sizing gives each source an order of sample uses (pass after pass). The run is cut into
``config.epochs`` epochs of about equal tokens: epoch ``e`` takes the ``e``-th of as many
consecutive parts of every source's order (a part ends at the sample whose tokens reach
``e + 1`` over ``epochs`` of the source's planned tokens; with phases, the part of its target
that the phases put in the run's first ``e + 1`` over ``epochs`` of its tokens), so repetition
order holds across epochs and each epoch holds every source's share within one document.

An epoch's entries are its uses, source after source (a sample used twice is two entries).
Micro-batches hold one source each: every source's entries are formed on their own (pack or
pad, as for one dataset) and shuffled; then `batchplan.kernels.interleave` takes them in the
order that keeps every prefix of the epoch within about one micro-batch of each source's share
of its tokens. The schedule keeps that order (steps are consecutive micro-batches; ranks are
balanced inside each step), so every step but an epoch's last holds each source's share
within ``max_tokens`` tokens, and the run never drifts. Packing each source on its own costs
at most one part-filled micro-batch per source and epoch against packing the epoch's samples
together (docs/mixtures.md).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig
from batchplan.errors import ConfigError, DatasetError
from batchplan.kernels.interleave import compose_steps
from batchplan.mixture import Mixture
from batchplan.plan import Entries, EpochPlan, index_dtype
from batchplan.planning.entries import make_entries
from batchplan.planning.forming import concatenate_parts, form_micro_batches
from batchplan.planning.bins import PackedBins
from batchplan.planning.micro_batches import MicroBatches
from batchplan.planning.parted_bins import PartedBins
from batchplan.planning.mixture_sizing import SourceResume, SourceSelection, run_fractions, select_sources
from batchplan.planning.randomness import STREAM_ENTRY_ORDER, STREAM_MICRO_BATCH_ORDER, epoch_rng
from batchplan.planning.schedule import schedule_epoch
from batchplan.planning.threads import threads_for

__all__ = ["MixtureEntries", "plan_mixture_epoch", "prepare_mixture_entries", "sizing_lengths"]


@dataclasses.dataclass(frozen=True)
class MixtureEntries:
    """A mixture's entries in chunks: the uses of one pass of one source in one epoch.

    Attributes:
        entries: every use of every selected sample, chunk after chunk (``entries.sample``
            maps each to its global sample index).
        chunk_bounds: shape (chunks + 1,): chunk ``c`` is entries ``chunk_bounds[c]:chunk_bounds[c + 1]``.
        chunk_source: shape (chunks,): the source of each chunk.
        epoch_chunks: shape (epochs + 1,): epoch ``e`` is chunks ``epoch_chunks[e]:epoch_chunks[e + 1]``
            (its sources in order, each source's passes in order).
        selections: what the run uses of each source (`mixture_sizing.SourceSelection`,
            without their orders: the entries hold them).
        phase_starts: shape (phases,): the tokens of the run before each phase begins (0 first).
        phase_weights: shape (phases, sources): each phase's weights, summing to 1 (without
            phases one row: each source's share of the run).
    """

    entries: Entries
    chunk_bounds: NDArray[np.int64]
    chunk_source: NDArray[np.int64]
    epoch_chunks: NDArray[np.int64]
    selections: tuple[SourceSelection, ...]
    phase_starts: NDArray[np.float64]
    phase_weights: NDArray[np.float64]

    def epoch_tokens(self, epoch: int) -> int:
        first = int(self.chunk_bounds[self.epoch_chunks[epoch]])
        last = int(self.chunk_bounds[self.epoch_chunks[epoch + 1]])
        return int(self.entries.length[first:last].sum(dtype=np.int64))


def sizing_lengths(lengths: NDArray[np.integer], config: PlanConfig) -> NDArray[np.integer]:
    """The tokens each sample brings to a source's target: 0 for what the build drops
    (empty, and oversize under ``drop``), ``max_tokens`` for a truncated sample; in the
    lengths' own dtype, and ``lengths`` itself when no sample changes."""
    lengths = np.asarray(lengths)
    if config.oversize not in ("drop", "truncate") or int(lengths.max(initial=0)) <= config.max_tokens:
        return lengths
    sized = lengths.copy()
    if config.oversize == "drop":
        sized[sized > config.max_tokens] = 0
    else:
        np.minimum(sized, config.max_tokens, out=sized)
    return sized


def prepare_mixture_entries(
    mixture: Mixture,
    lengths: NDArray[np.integer],
    offsets: NDArray[np.integer],
    config: PlanConfig,
    *,
    loss_tokens: NDArray[np.integer] | None = None,
    threads: int = 1,
    resume: dict[str, SourceResume] | None = None,
) -> MixtureEntries:
    """Size every source and lay out the run's entries, epoch by epoch and source by source
    (``resume``: where sources' orders go on from, `mixture_sizing.select_sources`).

    Raises:
        DatasetError: a source breaks a policy of ``config`` (empty or oversize samples), or
            the mixture selects no tokens at all.
        ConfigError: an option a mixture does not take.
    """
    if config.has_seqlen_warmup:
        raise ConfigError("seqlen_warmup is not available with a mixture; leave it out")
    if config.drop_last:
        raise ConfigError(
            "drop_last is not available with a mixture (an epoch's last step is completed instead); leave it out"
        )
    lengths = np.asarray(lengths)
    selections = select_sources(
        mixture, sizing_lengths(lengths, config), offsets, seed=config.seed, threads=threads, resume=resume
    )
    chunks, chunk_source, epoch_chunks = [], [], [0]
    fractions = run_fractions(mixture, config.epochs)
    cuts = [_epoch_cuts(selection.order, lengths, config.epochs, None if fractions is None else fractions[source])
            for source, selection in enumerate(selections)]  # fmt: skip
    # The sources' orders are copied into the entries below, then let go (4 bytes per use).
    for epoch in range(config.epochs):
        for source, selection in enumerate(selections):
            part = slice(int(cuts[source][epoch]), int(cuts[source][epoch + 1]))
            for chunk in _passes(part, selection.num_samples, selection.head):
                chunks.append(selection.order[chunk])
                chunk_source.append(source)
        epoch_chunks.append(len(chunks))
    uses = np.concatenate([np.zeros(0, dtype=index_dtype(int(lengths.shape[0])))] + chunks)
    if uses.shape[0] == 0:
        raise DatasetError("the mixture selects no samples: give its sources tokens, or raise their weights")
    use_bounds = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum([chunk.shape[0] for chunk in chunks], out=use_bounds[1:])
    del chunks
    selections = tuple(selection.without_order() for selection in selections)
    use_loss = None if loss_tokens is None else np.asarray(loss_tokens)[uses]
    entries, chunk_bounds = _to_samples(make_entries(lengths[uses], config, use_loss), uses, use_bounds)
    if entries.num_entries == 0:
        raise DatasetError("no samples left to plan in the mixture after dropping empty and oversize ones")
    if mixture.by_epochs:
        starts, weights = [0], [[selection.weight for selection in selections]]
    else:
        starts, weights = mixture.phase_weights()
    return MixtureEntries(
        entries, chunk_bounds, np.asarray(chunk_source, dtype=np.int64), np.asarray(epoch_chunks, dtype=np.int64),
        selections, np.asarray(starts, dtype=np.float64), np.asarray(weights, dtype=np.float64),
    )


def _epoch_cuts(
    order: NDArray[np.integer], lengths: NDArray[np.integer], epochs: int, fractions: NDArray[np.float64] | None
) -> NDArray[np.int64]:
    """Shape (epochs + 1,): positions of ``order`` where each epoch's part begins, the run cut
    into ``epochs`` consecutive parts: the ``e``-th ends at the sample whose tokens reach
    ``fractions[e + 1]`` of the order's tokens (None: ``(e + 1) / epochs``, parts of about
    equal tokens)."""
    if epochs == 1 or order.shape[0] == 0:
        return np.array([0] + [order.shape[0]] * epochs, dtype=np.int64)
    sums = np.cumsum(lengths[order], dtype=np.int64)
    if fractions is None:
        targets = sums[-1] * np.arange(1, epochs, dtype=np.float64) / epochs
    else:
        targets = sums[-1] * fractions[1:-1]
    inner = np.minimum(np.searchsorted(sums, targets, side="left") + 1, order.shape[0])
    inner[targets <= 0] = 0  # a source the phases give nothing yet
    return np.concatenate([[0], inner, [order.shape[0]]]).astype(np.int64)


def _passes(part: slice, num_samples: int, head: int = 0) -> list[slice]:
    """``part`` of a source's order cut where a pass ends: after the ``head`` positions of a
    pass under way, then every ``num_samples`` positions."""
    if part.stop <= part.start:
        return []
    ends = [head] if 0 < head else []
    ends += range(head + num_samples, part.stop, num_samples)
    edges = [part.start] + [end for end in ends if part.start < end < part.stop] + [part.stop]
    return [slice(start, stop) for start, stop in zip(edges[:-1], edges[1:])]


def _to_samples(over_uses: Entries, uses: NDArray[np.integer], use_bounds: NDArray[np.int64]):
    """Entries whose ``sample`` is the global sample (not the use), drops listed by sample,
    and the entry bounds of every (epoch, source) part."""
    use_of_entry = over_uses.sample
    one_each = use_of_entry is not None and use_of_entry.shape[0] == uses.shape[0]
    if use_of_entry is None or (one_each and not any(which.size for which in over_uses.dropped.values())):
        # Every use is one entry, in order (spans of truncated samples included): no gather.
        bounds = use_bounds
        sample = uses
    else:
        bounds = np.searchsorted(use_of_entry, use_bounds, side="left").astype(np.int64)
        sample = uses[use_of_entry]
    dropped = {reason: np.unique(uses[which]).astype(np.int64) for reason, which in over_uses.dropped.items()}
    entries = dataclasses.replace(over_uses, sample=sample, dropped=dropped)
    return entries, bounds


def plan_mixture_epoch(
    mixture: MixtureEntries, config: PlanConfig, epoch: int, *, tokens_before: int = 0, threads: int = 1
) -> EpochPlan:
    """Plan one epoch of a mixture (the module docstring): micro-batches of one pass of one
    source each, a source's passes in order, interleaved by share and scheduled in that
    order; the plan's rows carry their source. A phase begins with the first step whose
    tokens before it (``tokens_before`` and the epoch's steps before it) reach its start."""
    entries = mixture.entries
    rng = epoch_rng(config.seed, epoch, STREAM_ENTRY_ORDER)
    order_rng = epoch_rng(config.seed, epoch, STREAM_MICRO_BATCH_ORDER)
    parts = []  # a source's passes in order
    for chunk in range(int(mixture.epoch_chunks[epoch]), int(mixture.epoch_chunks[epoch + 1])):
        first, last = int(mixture.chunk_bounds[chunk]), int(mixture.chunk_bounds[chunk + 1])
        if last > first:
            formed = form_micro_batches(entries.length[first:last], config, rng, threads_for(last - first, threads))
            parts.append(_Part(int(mixture.chunk_source[chunk]), formed, first, last - first,
                               order_rng.permutation(formed.count)))  # fmt: skip
    if not parts:
        raise DatasetError(f"epoch {epoch} of the mixture holds no samples; use fewer epochs")
    phases = (mixture.phase_starts, mixture.phase_weights)
    batches, steps, order = _composed(parts, entries.num_entries, config, tokens_before, phases)
    bounds = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([part.entries for part in parts], out=bounds[1:])
    sources = (bounds, np.array([part.source for part in parts], dtype=np.int16))
    return schedule_epoch(entries, batches, config, epoch, tokens_before=tokens_before, order=order, steps=steps,
                          sources=sources, threads=threads)  # fmt: skip


class _Part(NamedTuple):
    """A chunk's micro-batches: its source, its formed micro-batches over its ``entries``
    entries from ``first`` on, and their seeded order."""

    source: int
    batches: MicroBatches
    first: int
    entries: int
    order: NDArray[np.int64]



def _composed(parts, num_entries: int, config: PlanConfig, tokens_before: int, phases):
    """Every part's micro-batches in one `MicroBatches` (packed: `PartedBins`, the parts' bins
    as they are; padded: laid out one part after another), the order `compose_steps` gives
    them (a source's queue: its parts' micro-batches one part after another, each part's in a
    seeded order) and the steps' bounds over that order.

    Every step holds each source within ``max_tokens`` of its phase's weight (validate's
    check; a billionth inside it, against rounding; ``phases``: the run's tokens before each
    phase and the phases' weights), and deficits are counted against the epoch's own shares
    (its sources' tokens over its tokens, within a document of the weights) from the epoch's
    last phase on, so that every source runs out with the epoch's last step."""
    if all(isinstance(part.batches.layout, PackedBins) for part in parts):
        layout = PartedBins([part.batches.layout for part in parts], [part.first for part in parts], num_entries)
        batches = MicroBatches.of_bins(layout)
        packings = [part.batches.packing for part in parts]
        batches.packing = sum(packings[1:], packings[0])
    else:
        laid = [(part.batches, part.first + np.arange(part.entries, dtype=np.int64), np.arange(part.batches.count))
                for part in parts]  # fmt: skip
        batches = concatenate_parts(laid, num_entries)
    base = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([part.batches.count for part in parts], out=base[1:])
    queue = np.concatenate([base[index] + part.order for index, part in enumerate(parts)])  # parts are source by source
    sources = sorted({part.source for part in parts})
    counts = np.array([sum(part.batches.count for part in parts if part.source == source) for source in sources],
                      dtype=np.int64)  # fmt: skip
    source_offsets = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=source_offsets[1:])
    tokens = batches.tokens().astype(np.int64)[queue]
    source_tokens = np.add.reduceat(tokens, source_offsets[:-1]).astype(np.float64)
    shares = source_tokens / max(float(source_tokens.sum()), 1.0)
    starts, weights = phases
    asked = weights[:, sources] / np.maximum(weights[:, sources].sum(axis=1, keepdims=True), 1e-300)
    sizing = _sizing(config, tokens_before, float(tokens.mean()) if tokens.shape[0] else 0.0)
    order = np.empty(queue.shape[0], dtype=np.int64)
    steps = np.empty(queue.shape[0] + 1, dtype=np.int64)
    num_steps = compose_steps(source_offsets, tokens, starts, asked, shares, config.world_size,
                              config.max_tokens * (1 - 1e-9), sizing, order, steps)  # fmt: skip
    return batches, steps[: num_steps + 1].copy(), queue[order]


def _sizing(config: PlanConfig, tokens_before: int, mean_tokens: float) -> NDArray[np.float64]:
    """`compose_steps`'s ``(rounds, tokens_before, start, target, ramp_tokens, max_rounds)``."""
    per_step = config.micro_batches_per_step
    if per_step is not None and not config.has_rampup:
        return np.array([per_step, tokens_before, 0, 0, 0, 0], dtype=np.float64)
    if config.tokens_per_step is not None:
        full = float(config.tokens_per_step)
    else:  # a ramp-up to M micro-batches per rank: the mean tokens of such a step
        full = mean_tokens * config.world_size * per_step
    start = float(config.rampup_start) if config.has_rampup else full
    ramp = config.rampup_tokens if config.has_rampup else 0
    return np.array([0, tokens_before, start, full, ramp, per_step or 0], dtype=np.float64)
