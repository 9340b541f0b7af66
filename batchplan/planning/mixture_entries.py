"""A mixture's run as entries: each source's selected uses (`mixture_sizing`) cut into
epochs, and each epoch's part of a source into chunks, one per pass.

Sizing gives each source an order of sample uses (pass after pass). The run is cut into
``config.epochs`` epochs of about equal tokens: epoch ``e`` takes the ``e``-th of as many
consecutive parts of every source's order (a part ends at the sample whose tokens reach
``e + 1`` over ``epochs`` of the source's planned tokens; with phases, the part of its target
that the phases put in the run's first ``e + 1`` over ``epochs`` of its tokens), so repetition
order holds across epochs and each epoch holds every source's share within one document.
An epoch's entries are its uses, source after source, pass after pass (a sample used twice
is two entries); `make_entries` applies the build's policies to them (drop, truncate, split).

Memory: the run's lengths along its uses (2 bytes per use) and, below `DRAW_AGAIN_FROM_USES`
uses, each use's sample (4 bytes), both drawn straight into one array each (with one epoch
nothing is copied). Where every use is one packed entry, the epochs' members are laid out as
the samples themselves (`MixtureEntries.members_are_samples`): a whole pass in sample order is
then a range, never written, and a run of `DRAW_AGAIN_FROM_USES` uses or more holds no sample
at all, drawing each part's again when it is laid out. A build with ``drop_last`` or a
sequence-length warmup keeps each use's sample (its drops and pieces name samples).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig
from batchplan.errors import ConfigError, DatasetError
from batchplan.mixture import Mixture
from batchplan.plan import Entries, index_dtype
from batchplan.planning.buffers import new_buffer
from batchplan.planning.entries import make_entries
from batchplan.planning.mixture_sizing import (
    SourceResume,
    SourceSelection,
    count_uses,
    draw_sources,
    run_fractions,
    with_shares,
)
from batchplan.planning.mixture_warmup import FirstEpoch, MixtureWarmup, add_mixture_warmup

__all__ = ["DRAW_AGAIN_FROM_USES", "MixtureEntries", "prepare_mixture_entries", "sizing_lengths"]


# Runs of about this many uses or more hold no sample per use (4 bytes each) while they are
# planned (`MixtureEntries.uses` is None): each part's samples are drawn again from their seeds
# when its members are laid out, one more permutation per pass. 2^27, where epochs compress their
# bins (`batchplan.planning.bins.COMPRESS_FROM_ENTRIES`): memory, not that time, is what runs out.
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
            then drawn again from the seed when its part is laid out. Whole passes in sample
            order are not written there (`chunk_samples` gives them as ranges).
        warmup: epoch 0's sequence-length warmup (`batchplan.planning.mixture_warmup`): its
            pieces are entries after every chunk's; None without one.
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
    warmup: MixtureWarmup | None = None

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
        range for a whole pass in sample order, a view of ``uses``, or drawn again from
        ``seed``, the build's: one permutation)."""
        first, last = int(self.chunk_bounds[chunk]), int(self.chunk_bounds[chunk + 1])
        selection = self.selections[int(self.chunk_source[chunk])]
        at = int(self.chunk_start[chunk])
        if self.uses is not None and not selection.is_range(at):
            return self.uses[first:last]
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
    (``resume``: where sources' orders go on from, `mixture_sizing.select_sources`); with a
    sequence-length warmup, epoch 0's warmup pieces after them (`mixture_warmup`).

    Sources are drawn one at a time, their orders (while the run has fewer than
    `DRAW_AGAIN_FROM_USES` uses) and their lengths (and loss tokens) along them written one
    after another into one array each; with more than one epoch, then copied epoch by epoch.

    Raises:
        DatasetError: a source breaks a policy of ``config`` (empty or oversize samples), the
            mixture selects no tokens at all, or epoch 0 holds fewer tokens than the warmup.
        ConfigError: ``drop_last`` with phases over more than one epoch.
    """
    _check_options(mixture, config)
    lengths = np.asarray(lengths)
    drawn = _draw_uses(mixture, lengths, offsets, config, loss_tokens, threads, resume)
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
    entries, chunk_bounds, uses = _named(entries, uses, use_bounds, config)
    members_are_samples = entries.sample is None  # else each entry names its sample
    if entries.num_entries == 0:
        raise DatasetError("no samples left to plan in the mixture after dropping empty and oversize ones")
    starts, weights = _phases(mixture, selections)
    prepared = MixtureEntries(
        entries,
        chunk_bounds,
        np.array([source for source, _, _ in chunks], dtype=np.int64),
        np.asarray(epoch_chunks, dtype=np.int64),
        selections,
        starts,
        weights,
        np.array([first for _, first, _ in chunks], dtype=np.int64),
        members_are_samples,
        uses,
    )
    if not config.has_seqlen_warmup:
        return prepared
    epoch_0 = slice(int(prepared.epoch_chunks[0]), int(prepared.epoch_chunks[1]))
    first = FirstEpoch(
        prepared.chunk_bounds[epoch_0.start : epoch_0.stop + 1], prepared.chunk_source[epoch_0], starts, weights
    )
    entries, warmup = add_mixture_warmup(prepared.entries, first, config)
    return dataclasses.replace(prepared, entries=entries, warmup=warmup)


def _check_options(mixture: Mixture, config: PlanConfig) -> None:
    """Refuse ``drop_last`` with phases over several epochs: each epoch's part of a source is
    cut for where the phases put the run's tokens, which what the epochs before it drop would
    move (docs/mixtures.md)."""
    if config.drop_last and config.epochs > 1 and mixture.phases:
        raise ConfigError(
            f"drop_last with phases takes one epoch, not {config.epochs}: what an epoch drops moves the run's tokens "
            "where a later epoch's phase begins, away from the part of each source that epoch holds; a mixture's "
            "epochs are parts of one run, so plan it as one epoch (`epochs` 1), or leave drop_last off"
        )


def _named(entries: Entries, uses, use_bounds: NDArray[np.int64], config: PlanConfig):
    """``(entries, chunk_bounds, uses)``: the uses' entries as they are, with ``uses`` their
    samples (or None: drawn again), where their members are the samples
    (`MixtureEntries.members_are_samples`); else entries that name their samples, and None."""
    members_are_samples = (
        config.mode == "pack"
        and not _names_samples(config)
        and entries.sample is None
        and not any(which.size for which in entries.dropped.values())
    )
    if members_are_samples:
        return entries, use_bounds, uses
    assert uses is not None  # the orders were kept: `_draw_uses` kept them
    entries, chunk_bounds = _to_samples(entries, uses, use_bounds)
    return entries, chunk_bounds, None


def _names_samples(config: PlanConfig) -> bool:
    """Whether the build names each use's sample beyond its members: what ``drop_last``
    drops is listed by sample, and a warmup's pieces are spans of samples."""
    return config.drop_last or config.has_seqlen_warmup


def _draw_uses(mixture, lengths, offsets, config: PlanConfig, loss_tokens, threads: int, resume) -> _Gathered:
    """Every source's uses drawn (`draw_sources`) with their lengths and loss tokens along
    them, and each source's epochs' cuts."""
    sized = sizing_lengths(lengths, config)
    about, most = count_uses(mixture, sized, offsets, resume=resume)
    sample_dtype = index_dtype(int(lengths.shape[0]))
    # Orders and lengths are drawn into arrays of room for the most uses: pages never written
    # are never resident. The shuffles carry the lengths along when sizing counts them as they are.
    # A large run keeps no order where each use will be one packed entry (members are samples).
    one_each = (
        config.mode == "pack"
        and not _names_samples(config)
        and (lengths.size == 0 or (int(lengths.min()) > 0 and int(lengths.max()) <= config.max_tokens))
    )
    out = None if about >= DRAW_AGAIN_FROM_USES and one_each else new_buffer(most, sample_dtype)
    along = new_buffer(most, lengths.dtype)
    carried = along if sized is lengths else None
    # One epoch without a warmup: each whole pass is one chunk, which forming shuffles anyway
    # (packing within lengths, padding all of it), so it is taken in sample order. Several
    # epochs cut passes where their tokens reach a share, and a warmup takes a chunk's first
    # uses: there the passes' own seeded orders choose which samples go where.
    shuffled = config.epochs > 1 or config.has_seqlen_warmup
    # Where each use will be one packed entry and nothing is gathered through the orders, those
    # passes are read as ranges (`MixtureEntries.chunk_samples`): not written (4 bytes a use).
    ranges_read = one_each and loss_tokens is None and carried is not None
    drawn = draw_sources(
        mixture,
        sized,
        offsets,
        seed=config.seed,
        threads=threads,
        resume=resume,
        out=out,
        along=carried,
        shuffled=shuffled,
        in_order_written=not ranges_read,
    )
    return _Gathered.of(
        drawn,
        out,
        lengths if carried is None else None,
        along,
        None if loss_tokens is None else np.asarray(loss_tokens),
        config.epochs,
        run_fractions(mixture, config.epochs),
        lambda used: sizing_lengths(used, config),
    )


def _phases(mixture: Mixture, selections) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """``(phase_starts, phase_weights)`` of `MixtureEntries`."""
    if mixture.by_epochs:
        starts, weights = [0], [[selection.weight for selection in selections]]
    else:
        starts, weights = mixture.phase_weights()
    return np.asarray(starts, dtype=np.float64), np.asarray(weights, dtype=np.float64)


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
    def of(cls, drawn, out, lengths, used, loss, epochs: int, fractions, sized) -> _Gathered:
        """Each source of ``drawn`` (`draw_sources`, into ``out`` or not) as it comes: its
        lengths along its order gathered into ``used`` (None: `draw_sources` wrote them
        there), and its loss tokens; its epochs are cut on the tokens sizing counts
        (``sized``: `sizing_lengths` of lengths along an order)."""
        used_loss = None if loss is None else new_buffer(used.shape[0], loss.dtype)
        gathers = [
            (values, into)
            for values, into in ((lengths, used), (loss, used_loss))
            if values is not None and into is not None
        ]
        selections, base, cuts, at = [], [0], [], 0
        for source, selection in enumerate(drawn):
            order, count = selection.order, selection.num_uses
            for values, into in gathers:  # valid indices: no checked copy
                np.take(values, order, out=into[at : at + count], mode="clip")
            counted = sized(used[at : at + count])
            cuts.append(_epoch_cuts(counted, epochs, None if fractions is None else fractions[source]))
            del counted
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
