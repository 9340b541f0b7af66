"""Mixture sizing: which samples of each source a run uses, and in what order.

A source's tokens target is ``weight_s / sum(weights) x tokens`` (a mixture with ``tokens``;
with phases, the sum over the phases of the phase's normalised weight times its tokens) or
``epochs_s x`` the source's tokens (a mixture sized by epochs). It is met in whole passes
while a whole pass fits, then a partial pass: the prefix of one more pass whose tokens are
nearest the rest of the target, so the planned tokens are within one document of the
target. Pass ``p`` of a source is a fresh permutation of its samples drawn from
`batchplan.planning.randomness.source_pass_rng` (seed, the source's *name*, ``p``): a source's
order is a prefix of the same sequence of passes whatever the other sources are, and within
a source no sample is used a (k+1)-th time before every sample was used k times.

Cost: one permutation per whole pass (`batchplan.planning.randomness.permute`, about 4x
faster than ``rng.permutation`` at 10^7), the lengths carried along by its shuffles (no
gather); a partial pass shuffles its permutation only as far as its prefix reaches
(`batchplan.planning.randomness.PermutedPrefix`) and looks up only the prefix's lengths.
Memory: the orders (4 bytes per selected sample below 2^31 samples, else 8) plus, for a
partial pass, one permutation of its source. No loop runs per sample. `draw_sources` hands
the sources over one at a time, drawing their orders (and lengths) into the caller's arrays
if given; a caller that keeps only what it gathers along the orders holds one at a time, and
a selection draws any pass of its order again from the seed (`SourceSelection.draw`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from fractions import Fraction
from typing import NamedTuple, TypeVar

import numpy as np
from numpy.typing import NDArray

from batchplan.errors import DatasetError
from batchplan.mixture import Mixture
from batchplan.plan import index_dtype
from batchplan.planning.randomness import PermutedPrefix, permute, source_pass_rng

__all__ = [
    "SourceResume", "SourceSelection", "count_uses", "draw_sources", "run_fractions", "select_sources", "with_shares",
]  # fmt: skip

_T = TypeVar("_T")

_CHUNK = 1 << 20  # prefix sums of a partial pass computed at a time (8 MiB)


@dataclasses.dataclass(frozen=True)
class SourceResume:
    """Where a source's order goes on from (a run re-planned part-way): pass ``pass_index`` is
    under way and ``left`` (one bool per sample of the source) marks the samples it has not
    used yet; the order takes them first, in that pass's order, then whole passes on."""

    pass_index: int
    left: NDArray[np.bool_]


@dataclasses.dataclass(frozen=True)
class SourceSelection:
    """What a run uses of one source.

    Attributes:
        name: the source's name.
        offset: its first global sample index.
        num_samples: its rows.
        weight: its share of the run's tokens: the normalised weight (a mixture with
            ``tokens``), or its planned tokens over all sources' (a mixture sized by epochs).
        target_tokens: the tokens asked of it (whole tokens).
        planned_tokens: the tokens of ``order``, within one document of ``target_tokens``.
        passes: ``planned_tokens`` over the source's tokens (2.5: two passes and half of one).
        order: global sample indices in the order they are used, pass after pass
            (int32 when the mixture has fewer than 2^31 samples, else int64); None once
            they are laid out as a plan's entries (`without_order`).
        head: positions of ``order`` before its first whole pass: the rest of a pass under
            way (`SourceResume`), 0 for an order that starts with a pass.
        num_uses: positions of ``order``: ``head``, then ``whole_passes`` whole passes, then
            the prefix of one more.
        whole_passes: the whole passes after the head.
        pass_index: the pass the order begins with (the head's, or the first whole pass).
        left: the head's pass: the samples it had not used yet (`SourceResume.left`); None
            without a head.
    """

    name: str
    offset: int
    num_samples: int
    weight: float
    target_tokens: int
    planned_tokens: int
    passes: float
    order: NDArray[np.int32] | NDArray[np.int64] | None
    head: int = 0
    num_uses: int = 0
    whole_passes: int = 0
    pass_index: int = 0
    left: NDArray[np.bool_] | None = None

    def without_order(self) -> SourceSelection:
        """The same selection without its order (4 bytes per use, let go once copied)."""
        return dataclasses.replace(self, order=None)

    def draw(self, first: int, last: int, seed: int, dtype: np.dtype, threads: int = 1) -> NDArray:
        """Positions ``first:last`` of the order, drawn again from ``seed`` (what ``order``
        holds there): inside the head or inside one pass, as `batchplan.planning.mixture_epochs`
        cuts the order. Costs one permutation of the source (none held beyond the result
        when ``first:last`` is a whole pass)."""
        if last <= first:
            return np.empty(0, dtype=dtype)
        if not 0 <= first < last <= self.num_uses:
            raise ValueError(f"positions {first:,}:{last:,} of an order of {self.num_uses:,}")
        count = self.num_samples
        if last <= self.head:
            assert self.left is not None  # a head is what its pass had left
            head = _pass_order(self.name, self.offset, count, self.pass_index, seed, dtype, threads)
            return head[self.left[head - self.offset]][first:last].copy()
        index, at = divmod(first - self.head, count)
        if first < self.head or at + last - first > count:
            raise ValueError(f"positions {first:,}:{last:,} of {self.name!r}'s order are not inside one pass")
        pass_index = self.pass_index + (1 if self.head else 0) + index
        if last - first == count:
            return _pass_order(self.name, self.offset, count, pass_index, seed, dtype, threads)
        order = np.empty(count, dtype=dtype)
        PermutedPrefix(source_pass_rng(seed, self.name, pass_index), order, self.offset, threads=threads).extend(
            at + last - first
        )
        return order[at : at + last - first].copy()


def select_sources(
    mixture: Mixture,
    lengths: NDArray[np.integer],
    offsets: NDArray[np.integer],
    *,
    seed: int,
    threads: int = 1,
    resume: dict[str, SourceResume] | None = None,
) -> tuple[SourceSelection, ...]:
    """Size each source of ``mixture`` and draw the order of its selected samples.

    Args:
        mixture: the sources, with weights and ``tokens`` or with epochs.
        lengths: tokens of every sample, sources one after another in the mixture's order.
        offsets: ``len(mixture.sources) + 1`` bounds: source ``k`` is samples
            ``offsets[k]:offsets[k + 1]``.
        seed: the build's seed.
        threads: threads for each permutation (the result is the same for any number).
        resume: by source name, where its order goes on from (`SourceResume`); a source
            not named starts at its first pass.

    Raises:
        DatasetError: a source asked for tokens that has none (no samples, or all of length 0).
    """
    drawn = draw_sources(mixture, lengths, offsets, seed=seed, threads=threads, resume=resume)
    return with_shares(mixture, tuple(drawn))


def draw_sources(
    mixture: Mixture,
    lengths: NDArray[np.integer],
    offsets: NDArray[np.integer],
    *,
    seed: int,
    threads: int = 1,
    resume: dict[str, SourceResume] | None = None,
    out: NDArray[np.integer] | None = None,
    along: NDArray[np.integer] | None = None,
) -> Iterator[SourceSelection]:
    """`select_sources`, one source at a time in the mixture's order, before the weights are
    known (``weight`` 0: `with_shares` sets them once every source is drawn). Each order is
    drawn when its source is asked for: a caller that keeps only what it gathers through
    the orders holds one at a time. With ``out`` (at least `count_uses`' most, of the
    orders' dtype), the orders are drawn into it one after another (each a view of it); with
    ``along`` (as many, of the lengths' dtype), the lengths along them are written into it
    the same way, carried by the shuffles."""
    bounds, source_tokens, targets = _sized(mixture, lengths, offsets)
    dtype = index_dtype(int(lengths.shape[0]))
    at = 0
    for source, (start, end), tokens, target in zip(mixture.sources, bounds, source_tokens, targets):
        if target > 0 and tokens == 0:
            raise DatasetError(
                f"source {source.name!r}: has {end - start:,} samples and 0 tokens but is asked for {target:,} "
                f"tokens; give it samples with tokens, or set its {'epochs' if mixture.by_epochs else 'weight'} to 0"
            )
        where = (resume or {}).get(source.name)
        room = None if out is None else out[at:]
        drawn = _draw_order(source.name, lengths, start, end, tokens, target, seed, dtype, threads, where, room,
                            None if along is None else along[at:])  # fmt: skip
        at += drawn.order.shape[0]
        yield SourceSelection(
            name=source.name,
            offset=start,
            num_samples=end - start,
            weight=0.0,  # `with_shares`, once every source's planned tokens are known
            target_tokens=target,
            planned_tokens=drawn.planned,
            passes=drawn.planned / tokens if tokens else 0.0,
            order=drawn.order,
            head=drawn.head,
            num_uses=int(drawn.order.shape[0]),
            whole_passes=drawn.whole,
            pass_index=drawn.pass_index,
            left=where.left if where is not None and drawn.head else None,
        )
        del drawn  # before the next source's order is drawn


def count_uses(
    mixture: Mixture,
    lengths: NDArray[np.integer],
    offsets: NDArray[np.integer],
    *,
    resume: dict[str, SourceResume] | None = None,
) -> tuple[float, int]:
    """``(about, most)``: about how many uses `draw_sources` draws for the run (each source's
    target over its tokens, in samples: within a document of each), and at most how many
    (the room its ``out`` needs), without drawing anything."""
    bounds, source_tokens, targets = _sized(mixture, lengths, offsets)
    about, most = 0.0, 0
    for source, (start, end), tokens, target in zip(mixture.sources, bounds, source_tokens, targets):
        if target == 0 or tokens == 0:
            continue
        where = (resume or {}).get(source.name)
        about += target / tokens * (end - start)
        head = 0 if where is None else int(np.count_nonzero(where.left))
        most += head + (target // tokens + 1) * (end - start)
    return about, most


def _sized(mixture: Mixture, lengths: NDArray[np.integer], offsets: NDArray[np.integer]):
    """Each source's ``(start, end)``, tokens and target (offsets checked)."""
    checked = np.asarray(offsets, dtype=np.int64)
    _check_offsets(mixture, lengths, checked)
    bounds = [(int(checked[k]), int(checked[k + 1])) for k in range(len(mixture.sources))]
    source_tokens = [int(lengths[start:end].sum(dtype=np.int64)) for start, end in bounds]
    return bounds, source_tokens, _targets(mixture, source_tokens)


def with_shares(mixture: Mixture, selections: tuple[SourceSelection, ...]) -> tuple[SourceSelection, ...]:
    """``selections`` (`draw_sources`, every source in order) with their ``weight`` set."""
    shares = _shares(mixture, [selection.planned_tokens for selection in selections])
    return tuple(dataclasses.replace(selection, weight=share) for selection, share in zip(selections, shares))


def _check_offsets(mixture: Mixture, lengths: NDArray, offsets: NDArray[np.int64]) -> None:
    count = len(mixture.sources)
    if (
        offsets.shape != (count + 1,)
        or offsets[0] != 0
        or offsets[-1] != lengths.shape[0]
        or np.any(np.diff(offsets) < 0)
    ):
        raise ValueError(
            f"offsets must be {count + 1} non-decreasing bounds from 0 to the {lengths.shape[0]:,} samples "
            f"(one more than the {count} sources), got {offsets.tolist()}"
        )


def _targets(mixture: Mixture, source_tokens: list[int]) -> list[int]:
    """Each source's target in whole tokens, computed exactly (fractions, rounded once)."""
    if mixture.by_epochs:
        targets = []
        for source, tokens in zip(mixture.sources, source_tokens):
            epochs = Fraction(_given(source.epochs))
            whole = math.floor(epochs)
            targets.append(whole * tokens + round((epochs - whole) * tokens))
        return targets
    return [round(target) for target in _phase_targets(mixture, _given(mixture.tokens))]


def _phase_targets(mixture: Mixture, point: int) -> list[Fraction]:
    """Each source's tokens in the run's first ``point`` tokens: every phase's normalised
    weights times the phase's tokens before ``point``, summed (exact fractions)."""
    starts = [0] + [phase.from_tokens for phase in mixture.phases]
    ends = starts[1:] + [_given(mixture.tokens)]
    rows = [[Fraction(_given(source.weight)) for source in mixture.sources]]
    rows += [[Fraction(phase.weights[name]) for name in mixture.names] for phase in mixture.phases]
    targets = [Fraction(0)] * len(mixture.sources)
    for start, end, row in zip(starts, ends, rows):
        span, total = max(0, min(end, point) - start), sum(row)
        targets = [target + weight / total * span for target, weight in zip(targets, row)]
    return targets


def run_fractions(mixture: Mixture, epochs: int) -> NDArray[np.float64] | None:
    """Shape (sources, epochs + 1): the part of each source's target that falls in the run's
    first ``e / epochs`` of its tokens, for ``e`` in ``0..epochs``; None where that is ``e /
    epochs`` for every source (no phases: sources' shares are the same all run long)."""
    if not mixture.phases:
        return None
    tokens = _given(mixture.tokens)
    points = [tokens * epoch // epochs for epoch in range(epochs + 1)]
    whole = _phase_targets(mixture, tokens)
    fractions = np.zeros((len(mixture.sources), epochs + 1), dtype=np.float64)
    for column, point in enumerate(points):
        for row, (part, total) in enumerate(zip(_phase_targets(mixture, point), whole)):
            fractions[row, column] = float(part / total) if total else 0.0
    return fractions


def _shares(mixture: Mixture, planned: list[int]) -> list[float]:
    """Each source's share of the run's tokens: its normalised weight (with phases, its
    target over the run's tokens), or its planned tokens over all (sized by epochs)."""
    if mixture.phases:
        tokens = _given(mixture.tokens)
        return [float(target / tokens) for target in _phase_targets(mixture, tokens)]
    if not mixture.by_epochs:
        weights = [_given(source.weight) for source in mixture.sources]
        total = sum(weights)
        return [weight / total for weight in weights]
    total = sum(planned)
    return [tokens / total if total else 0.0 for tokens in planned]


def _given(value: _T | None) -> _T:
    """A mixture's ``tokens``, or a source's ``weight`` or ``epochs``, where its sizing gives
    them (`batchplan.mixture.Mixture` checks: tokens and weights, or epochs)."""
    assert value is not None
    return value


class _Drawn(NamedTuple):
    """A source's order and how it was drawn (`SourceSelection`'s fields of the same names)."""

    order: NDArray
    planned: int
    head: int
    whole: int
    pass_index: int


def _draw_order(
    name: str, lengths: NDArray, start: int, end: int, tokens: int, target: int, seed: int, dtype: np.dtype,
    threads: int, resume: SourceResume | None = None, room: NDArray | None = None, along: NDArray | None = None,
) -> _Drawn:
    """What is left of a pass under way (``resume``), whole passes, then the prefix of one more
    nearest the rest; the order is drawn into the start of ``room`` when given, and the
    lengths along it written to the start of ``along`` when given (carried by the shuffles:
    no gather)."""
    count = end - start
    first_pass = 0 if resume is None else resume.pass_index
    if target == 0:
        return _Drawn(np.empty(0, dtype=dtype) if room is None else room[:0], 0, 0, 0, first_pass)
    head, whole_from = np.empty(0, dtype=dtype), first_pass
    if resume is not None and not resume.left.all():
        head = _pass_order(name, start, count, first_pass, seed, dtype, threads)
        head = head[resume.left[head - start]]
        head_tokens = int(lengths[head].sum(dtype=np.int64))
        if target <= head_tokens:
            head, planned = _nearest_prefix(head, lengths, target)
            return _Drawn(_laid(head, lengths, room, along), planned, head.shape[0], 0, first_pass)
        target -= head_tokens
        whole_from += 1
    whole, rest = divmod(target, tokens)
    partial, partial_lengths, partial_tokens = np.empty(0, dtype=dtype), np.empty(0, dtype=lengths.dtype), 0
    if rest:
        partial, partial_lengths, partial_tokens = _partial_pass(
            name, lengths, start, count, whole_from + whole, rest, seed, dtype, threads
        )
    size = head.shape[0] + whole * count + partial.shape[0]
    order = np.empty(size, dtype=dtype) if room is None else room[:size]
    values = None if along is None else along[:size]
    _laid(head, lengths, order, values)
    for index in range(whole):
        at = head.shape[0] + index * count
        carried = {} if values is None else {"values": lengths[start:end], "carried": values[at : at + count]}
        permute(source_pass_rng(seed, name, whole_from + index), order[at : at + count], start, **carried,
                threads=threads)  # fmt: skip
    order[head.shape[0] + whole * count :] = partial
    if values is not None:
        values[head.shape[0] + whole * count :] = partial_lengths
    planned = int(lengths[head].sum(dtype=np.int64)) + whole * tokens + partial_tokens
    return _Drawn(order, planned, head.shape[0], whole, first_pass if head.shape[0] else whole_from)


def _laid(order: NDArray, lengths: NDArray, room: NDArray | None, along: NDArray | None) -> NDArray:
    """``order`` at the start of ``room`` (itself without one), and its lengths at the start of ``along``."""
    if along is not None:
        np.take(lengths, order, out=along[: order.shape[0]], mode="clip")
    if room is None:
        return order
    room[: order.shape[0]] = order
    return room[: order.shape[0]]


def _pass_order(name: str, start: int, count: int, index: int, seed: int, dtype: np.dtype, threads: int) -> NDArray:
    """Pass ``index`` of a source: its global sample indices in that pass's seeded order."""
    order = np.empty(count, dtype=dtype)
    permute(source_pass_rng(seed, name, index), order, start, threads=threads)
    return order


def _partial_pass(
    name: str, lengths: NDArray, start: int, count: int, index: int, rest: int, seed: int, dtype: np.dtype,
    threads: int,
) -> tuple[NDArray, NDArray, int]:
    """The prefix of pass ``index`` whose tokens are nearest ``rest`` (`_nearest_prefix`):
    ``(its samples, their lengths, its tokens)``. The pass is shuffled only as far as the
    prefix reaches (`PermutedPrefix`), and only the prefix's lengths are looked up."""
    order = np.empty(count, dtype=dtype)
    drawn = PermutedPrefix(source_pass_rng(seed, name, index), order, start, threads=threads)
    done, along = 0, []
    for first in range(0, count, _CHUNK):
        drawn.extend(first + _CHUNK)
        along.append(lengths[order[first : first + _CHUNK]])
        found = _nearest(along[-1], done, rest)
        if found is not None:
            size, tokens = first + found[0], found[1]
            return order[:size].copy(), np.concatenate(along)[:size], tokens
        done += int(along[-1].sum(dtype=np.int64))
    raise AssertionError(f"a prefix of {rest:,} tokens is asked of a pass of {done:,}")


def _nearest_prefix(order: NDArray, lengths: NDArray, rest: int) -> tuple[NDArray, int]:
    """The prefix of ``order`` whose tokens are nearest ``rest`` (a tie takes the shorter):
    ``(its global sample indices, its tokens)``; ``order`` holds at least ``rest`` tokens."""
    done = 0
    for first in range(0, order.shape[0], _CHUNK):
        chunk = lengths[order[first : first + _CHUNK]]
        found = _nearest(chunk, done, rest)
        if found is not None:
            return order[: first + found[0]].copy(), found[1]
        done += int(chunk.sum(dtype=np.int64))
    raise AssertionError(f"a prefix of {rest:,} tokens is asked of an order of {done:,}")


def _nearest(chunk: NDArray, done: int, rest: int) -> tuple[int, int] | None:
    """Where, in a chunk of lengths after ``done`` tokens, the prefix nearest ``rest`` tokens
    ends (a tie takes the shorter): ``(positions of the chunk in it, its tokens)``; None when
    the chunk does not reach ``rest``."""
    sums = np.cumsum(chunk, dtype=np.int64)
    sums += done
    if sums[-1] < rest:
        return None
    # sums[at] is the first prefix (of at + 1 positions) reaching rest; the one before it falls short.
    at = int(np.searchsorted(sums, rest, side="left"))
    before = int(sums[at - 1]) if at else done
    if rest - before <= int(sums[at]) - rest:
        return at, before
    return at + 1, int(sums[at])
