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

Memory: the run's lengths along its uses (2 bytes per use) and, below `DRAW_AGAIN_FROM_USES`
uses, each use's sample (4 bytes), both drawn straight into one array each (sizing writes
each source's passes there; with one epoch nothing is copied). Where every use is one packed
entry, the epochs' members are laid out as the samples themselves, so writing looks nothing
up (`MixtureEntries.members_are_samples`); a run of `DRAW_AGAIN_FROM_USES` uses or more then
holds no sample at all, drawing each part's again when it is laid out, and an epoch of
`batchplan.planning.bins.PARK_FROM_ENTRIES` entries parks each part's bins as soon as they
are formed (`batchplan.planning.parted_bins`): at 10^9 uses over 50 sources, the build peaks
as one dataset of as many samples does (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig
from batchplan.errors import ConfigError, DatasetError
from batchplan.kernels.interleave import compose_steps
from batchplan.mixture import Mixture
from batchplan.plan import Entries, EpochPlan, PackingBound, index_dtype
from batchplan.planning.bins import PARK_FROM_ENTRIES, PackedBins
from batchplan.planning.buffers import new_buffer
from batchplan.planning.entries import make_entries
from batchplan.planning.forming import concatenate_parts, form_micro_batches
from batchplan.planning.micro_batches import MicroBatches
from batchplan.planning.mixture_sizing import (
    SourceResume,
    SourceSelection,
    count_uses,
    draw_sources,
    run_fractions,
    with_shares,
)
from batchplan.planning.parted_bins import ParkedBins, PartedBins, release_free_heap
from batchplan.planning.randomness import STREAM_ENTRY_ORDER, STREAM_MICRO_BATCH_ORDER, epoch_rng
from batchplan.planning.schedule import schedule_epoch
from batchplan.planning.threads import threads_for

__all__ = ["MixtureEntries", "plan_mixture_epoch", "prepare_mixture_entries", "sizing_lengths"]


# Runs of about this many uses or more hold no sample per use (4 bytes each) while they are
# planned (`MixtureEntries.uses` is None): each part's samples are drawn again from their seeds
# when its members are laid out, one more permutation per pass. 2^27, where epochs park their
# bins (`batchplan.planning.bins.PARK_FROM_ENTRIES`): memory, not that time, is what runs out.
DRAW_AGAIN_FROM_USES = 1 << 27


@dataclasses.dataclass(frozen=True)
class MixtureEntries:
    """A mixture's entries in chunks: the uses of one pass of one source in one epoch.

    Attributes:
        entries: every use of every selected sample, chunk after chunk (``entries.sample``
            maps each to its global sample index; None with ``members_are_samples``).
        chunk_bounds: shape (chunks + 1,): chunk ``c`` is entries ``chunk_bounds[c]:chunk_bounds[c + 1]``.
        chunk_source: shape (chunks,): the source of each chunk.
        epoch_chunks: shape (epochs + 1,): epoch ``e`` is chunks ``epoch_chunks[e]:epoch_chunks[e + 1]``
            (its sources in order, each source's passes in order).
        selections: what the run uses of each source (`mixture_sizing.SourceSelection`,
            without their orders: the entries hold them).
        phase_starts: shape (phases,): the tokens of the run before each phase begins (0 first).
        phase_weights: shape (phases, sources): each phase's weights, summing to 1 (without
            phases one row: each source's share of the run).
        chunk_start: shape (chunks,): each chunk's first position in its source's order.
        members_are_samples: the uses are the entries one for one (nothing dropped or cut)
            and packed: ``entries.sample`` is None and each epoch's members are laid out as
            the global sample indices (`chunk_samples`), not as entry ids, so that writing
            them looks nothing up.
        uses: with ``members_are_samples``, the global sample index of every use (entry),
            or None where the run has `DRAW_AGAIN_FROM_USES` uses or more: each chunk's are
            then drawn again from the seed when its part is laid out.
    """

    entries: Entries
    chunk_bounds: NDArray[np.int64]
    chunk_source: NDArray[np.int64]
    epoch_chunks: NDArray[np.int64]
    selections: tuple[SourceSelection, ...]
    phase_starts: NDArray[np.float64]
    phase_weights: NDArray[np.float64]
    chunk_start: NDArray[np.int64]
    members_are_samples: bool = False
    uses: NDArray[np.integer] | None = None

    @property
    def num_samples(self) -> int:
        """The samples of every source (the global indices' count)."""
        last = self.selections[-1]
        return last.offset + last.num_samples

    def epoch_tokens(self, epoch: int) -> int:
        first = int(self.chunk_bounds[self.epoch_chunks[epoch]])
        last = int(self.chunk_bounds[self.epoch_chunks[epoch + 1]])
        return int(self.entries.length[first:last].sum(dtype=np.int64))

    def chunk_samples(self, chunk: int, seed: int, threads: int = 1) -> NDArray[np.integer]:
        """With ``members_are_samples``: the global sample index of each use of ``chunk`` (a
        view of ``uses``, or drawn again from ``seed``, the build's: one permutation)."""
        first, last = int(self.chunk_bounds[chunk]), int(self.chunk_bounds[chunk + 1])
        if self.uses is not None:
            return self.uses[first:last]
        selection = self.selections[int(self.chunk_source[chunk])]
        at = int(self.chunk_start[chunk])
        return selection.draw(at, at + last - first, seed, index_dtype(self.num_samples), threads)


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

    Sources are drawn one at a time, their orders (while the run has fewer than
    `DRAW_AGAIN_FROM_USES` uses) and their lengths (and loss tokens) along them written one
    after another into one array each; with more than one epoch, then copied epoch by epoch.

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
    sized = sizing_lengths(lengths, config)
    about, most = count_uses(mixture, sized, offsets, resume=resume)
    sample_dtype = index_dtype(int(lengths.shape[0]))
    # Orders and lengths are drawn into arrays of room for the most uses: pages never written
    # are never resident. The shuffles carry the lengths along when sizing counts them as they are.
    # A large run keeps no order where each use will be one packed entry (members are samples).
    one_each = config.mode == "pack" and (
        lengths.size == 0 or (int(lengths.min()) > 0 and int(lengths.max()) <= config.max_tokens)
    )
    out = None if about >= DRAW_AGAIN_FROM_USES and one_each else new_buffer(most, sample_dtype)
    along = new_buffer(most, lengths.dtype)
    carried = along if sized is lengths else None
    drawn = _Gathered.of(
        draw_sources(mixture, sized, offsets, seed=config.seed, threads=threads, resume=resume, out=out,
                     along=carried),
        out, lengths if carried is None else None, along, None if loss_tokens is None else np.asarray(loss_tokens),
        config.epochs, run_fractions(mixture, config.epochs),
    )  # fmt: skip
    del out, along, carried
    selections = with_shares(mixture, drawn.selections)
    chunks, epoch_chunks = _chunks(selections, drawn.cuts, config.epochs)
    use_bounds = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum([last - first for _, first, last in chunks], out=use_bounds[1:])
    if use_bounds[-1] == 0:
        raise DatasetError("the mixture selects no samples: give its sources tokens, or raise their weights")
    used_lengths, used_loss, uses = drawn.by_chunk(chunks)
    del drawn
    entries = make_entries(used_lengths, config, used_loss)
    del used_lengths, used_loss
    members_are_samples = (
        config.mode == "pack" and entries.sample is None and not any(which.size for which in entries.dropped.values())
    )
    if members_are_samples:
        chunk_bounds = use_bounds
    else:  # each entry's sample is looked up
        assert uses is not None  # the orders were kept: ``one_each`` was false
        entries, chunk_bounds = _to_samples(entries, uses, use_bounds)
        uses = None
    if entries.num_entries == 0:
        raise DatasetError("no samples left to plan in the mixture after dropping empty and oversize ones")
    if mixture.by_epochs:
        starts, weights = [0], [[selection.weight for selection in selections]]
    else:
        starts, weights = mixture.phase_weights()
    return MixtureEntries(
        entries, chunk_bounds, np.array([source for source, _, _ in chunks], dtype=np.int64),
        np.asarray(epoch_chunks, dtype=np.int64), selections, np.asarray(starts, dtype=np.float64),
        np.asarray(weights, dtype=np.float64), np.array([first for _, first, _ in chunks], dtype=np.int64),
        members_are_samples, uses,
    )  # fmt: skip


@dataclasses.dataclass
class _Gathered:
    """Every source's order (None where they are drawn again) and its lengths (and loss
    tokens) along it, source after source; where each source's begin, and its epochs' cuts."""

    selections: tuple[SourceSelection, ...]
    orders: NDArray[np.integer] | None
    lengths: NDArray[np.integer]
    loss: NDArray[np.integer] | None
    base: list[int]
    cuts: list[NDArray[np.int64]]

    @classmethod
    def of(cls, drawn, out, lengths, used, loss, epochs: int, fractions) -> _Gathered:
        """Each source of ``drawn`` (`draw_sources`, into ``out`` or not) as it comes: its
        lengths along its order gathered into ``used`` (None: `draw_sources` wrote them
        there), and its loss tokens."""
        used_loss = None if loss is None else new_buffer(used.shape[0], loss.dtype)
        gathers = [(values, into) for values, into in ((lengths, used), (loss, used_loss))
                   if values is not None and into is not None]  # fmt: skip
        selections, base, cuts, at = [], [0], [], 0
        for source, selection in enumerate(drawn):
            order, count = selection.order, selection.num_uses
            for values, into in gathers:  # valid indices: no checked copy
                np.take(values, order, out=into[at : at + count], mode="clip")
            cuts.append(_epoch_cuts(used[at : at + count], epochs, None if fractions is None else fractions[source]))
            selections.append(selection.without_order())
            at += count
            base.append(at)
            del selection, order  # before the next source's order is drawn
        loss = None if used_loss is None else used_loss[:at]
        return cls(tuple(selections), None if out is None else out[:at], used[:at], loss, base, cuts)

    def by_chunk(self, chunks) -> tuple[NDArray, NDArray | None, NDArray | None]:
        """The lengths, loss tokens (or None) and samples (or None) of the uses, chunk after
        chunk: as drawn when the chunks take the uses in that order (one epoch), else copied."""
        starts = [self.base[source] + first for source, first, _ in chunks]
        ends = [self.base[source] + last for source, _, last in chunks]
        as_drawn = starts == [0] + ends[:-1] and ends[-1] == self.base[-1]

        def lay_out(values):
            if values is None or as_drawn:
                return values
            return np.concatenate([values[start:end] for start, end in zip(starts, ends)])

        return lay_out(self.lengths), lay_out(self.loss), lay_out(self.orders)


def _chunks(selections, cuts, epochs: int) -> tuple[list[tuple[int, int, int]], list[int]]:
    """The run's chunks, epoch after epoch, source after source, pass after pass: ``(source,
    first, last)`` positions of the source's order each; and each epoch's first chunk (and
    the count: ``epochs + 1``)."""
    chunks, epoch_chunks = [], [0]
    for epoch in range(epochs):
        for source, selection in enumerate(selections):
            part = slice(int(cuts[source][epoch]), int(cuts[source][epoch + 1]))
            passes = _passes(part, selection.num_samples, selection.head)
            chunks += [(source, chunk.start, chunk.stop) for chunk in passes]
        epoch_chunks.append(len(chunks))
    return chunks, epoch_chunks


def _epoch_cuts(used: NDArray[np.integer], epochs: int, fractions: NDArray[np.float64] | None) -> NDArray[np.int64]:
    """Shape (epochs + 1,): positions of a source's order where each epoch's part begins (``used``:
    the lengths along the order), the run cut into ``epochs`` consecutive parts: the ``e``-th
    ends at the sample whose tokens reach ``fractions[e + 1]`` of the order's tokens (None:
    ``(e + 1) / epochs``, parts of about equal tokens)."""
    if epochs == 1 or used.shape[0] == 0:
        return np.array([0] + [used.shape[0]] * epochs, dtype=np.int64)
    sums = np.cumsum(used, dtype=np.int64)
    if fractions is None:
        targets = sums[-1] * np.arange(1, epochs, dtype=np.float64) / epochs
    else:
        targets = sums[-1] * fractions[1:-1]
    inner = np.minimum(np.searchsorted(sums, targets, side="left") + 1, used.shape[0])
    inner[targets <= 0] = 0  # a source the phases give nothing yet
    return np.concatenate([[0], inner, [used.shape[0]]]).astype(np.int64)


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
    chunks = range(int(mixture.epoch_chunks[epoch]), int(mixture.epoch_chunks[epoch + 1]))
    # A large epoch parks each part's bins as soon as they are formed: they never add up.
    park = int(mixture.chunk_bounds[chunks.stop] - mixture.chunk_bounds[chunks.start]) >= PARK_FROM_ENTRIES
    parts = []  # a source's passes in order
    for chunk in chunks:
        first, last = int(mixture.chunk_bounds[chunk]), int(mixture.chunk_bounds[chunk + 1])
        if last > first:
            formed = form_micro_batches(entries.length[first:last], config, rng, threads_for(last - first, threads))
            kept: MicroBatches | PackedBins | ParkedBins = formed
            if isinstance(formed.layout, PackedBins):  # packed: the bins, parked in a large epoch
                kept = ParkedBins(formed.layout) if park else formed.layout
            parts.append(_Part(int(mixture.chunk_source[chunk]), kept, formed.count, formed.packing, first,
                               last - first, order_rng.permutation(formed.count), chunk))  # fmt: skip
            del formed, kept
            if park:
                release_free_heap()  # the bins' slots, freed among what the parts keep
    if not parts:
        raise DatasetError(f"epoch {epoch} of the mixture holds no samples; use fewer epochs")
    release_free_heap()  # what forming freed in heaps, among what the parts keep
    phases = (mixture.phase_starts, mixture.phase_weights)
    values, dtype = None, None  # members are entry ids, or each part's samples drawn again
    if mixture.members_are_samples:
        values = [functools.partial(mixture.chunk_samples, part.chunk, config.seed) for part in parts]
        dtype = index_dtype(max(entries.num_entries, mixture.num_samples))
    bounds = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([part.entries for part in parts], out=bounds[1:])
    sources = (bounds, np.array([part.source for part in parts], dtype=np.int16))
    batches, steps, order = _composed(parts, entries.num_entries, config, tokens_before, phases, values, dtype)
    del parts, values  # each part's order (8 bytes per micro-batch): not while the epoch is scheduled
    return schedule_epoch(entries, batches, config, epoch, tokens_before=tokens_before, order=order, steps=steps,
                          sources=sources, threads=threads)  # fmt: skip


class _Part(NamedTuple):
    """A chunk's micro-batches: its source, its formed micro-batches over its ``entries``
    entries from ``first`` on (packed: their bins, parked in a large epoch), how many and
    their packing, their seeded order, and the chunk."""

    source: int
    formed: MicroBatches | PackedBins | ParkedBins
    num_batches: int
    packing: PackingBound | None
    first: int
    entries: int
    order: NDArray[np.int64]
    chunk: int


def _composed(parts, num_entries: int, config: PlanConfig, tokens_before: int, phases, values=None, dtype=None):
    """Every part's micro-batches in one `MicroBatches` (packed: `PartedBins`, the parts' bins
    as they are; padded: laid out one part after another), the order `compose_steps` gives
    them (a source's queue: its parts' micro-batches one part after another, each part's in a
    seeded order) and the steps' bounds over that order.

    Every step holds each source within ``max_tokens`` of its phase's weight (validate's
    check; a billionth inside it, against rounding; ``phases``: the run's tokens before each
    phase and the phases' weights), and deficits are counted against the epoch's own shares
    (its sources' tokens over its tokens, within a document of the weights) from the epoch's
    last phase on, so that every source runs out with the epoch's last step."""
    bins = [part.formed for part in parts if not isinstance(part.formed, MicroBatches)]
    if len(bins) == len(parts):
        layout = PartedBins(bins, [part.first for part in parts], num_entries, values=values, dtype=dtype)
        batches = MicroBatches.of_bins(layout)
        packings = [part.packing for part in parts if part.packing is not None]
        batches.packing = sum(packings[1:], packings[0])
    else:
        laid = [(part.formed, part.first + np.arange(part.entries, dtype=np.int64), np.arange(part.num_batches))
                for part in parts]  # fmt: skip
        batches = concatenate_parts(laid, num_entries)
    del bins
    base = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([part.num_batches for part in parts], out=base[1:])
    queue = np.concatenate([base[index] + part.order for index, part in enumerate(parts)])  # parts are source by source
    sources = sorted({part.source for part in parts})
    counts = np.array([sum(part.num_batches for part in parts if part.source == source) for source in sources],
                      dtype=np.int64)  # fmt: skip
    source_offsets = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=source_offsets[1:])
    tokens = batches.tokens().astype(np.int64, copy=False)[queue]
    source_tokens = np.add.reduceat(tokens, source_offsets[:-1]).astype(np.float64)
    shares = source_tokens / max(float(source_tokens.sum()), 1.0)
    starts, weights = phases
    asked = weights[:, sources] / np.maximum(weights[:, sources].sum(axis=1, keepdims=True), 1e-300)
    sizing = _sizing(config, tokens_before, float(tokens.mean()) if tokens.shape[0] else 0.0)
    order = np.empty(queue.shape[0], dtype=np.int64)
    steps = np.empty(queue.shape[0] + 1, dtype=np.int64)
    num_steps = compose_steps(source_offsets, tokens, starts, asked, shares, config.world_size,
                              config.max_tokens * (1 - 1e-9), sizing, order, steps)  # fmt: skip
    del tokens
    return batches, steps[: num_steps + 1].copy(), queue[order].astype(index_dtype(queue.shape[0]))


def _sizing(config: PlanConfig, tokens_before: int, mean_tokens: float) -> NDArray[np.float64]:
    """`compose_steps`'s ``(rounds, tokens_before, start, target, ramp_tokens, max_rounds)``."""
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
