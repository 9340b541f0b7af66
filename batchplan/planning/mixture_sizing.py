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

Each order is drawn by `batchplan.planning.mixture_orders` (its cost is there). Memory: the
orders (4 bytes per selected sample below 2^31 samples, else 8) plus, for each partial pass
being drawn (one per thread), one permutation of its source. `draw_sources` hands the
sources over one at a time, drawing their orders (and lengths) into the caller's arrays if
given; a caller that keeps only what it gathers along the orders holds one at a time, and a
selection draws any pass of its order again from the seed (`SourceSelection.draw`). A caller
that shuffles every whole pass again takes them in sample order (`draw_sources`'
``shuffled``): no permutation to draw.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from typing import TypeVar

import numpy as np
from numpy.typing import NDArray

from batchplan.errors import DatasetError
from batchplan.mixture import Mixture
from batchplan.plan import index_dtype
from batchplan.planning.mixture_orders import SourceResume, draw_order, partial_pass_of, pass_order
from batchplan.planning.randomness import PermutedPrefix, source_pass_rng

__all__ = [
    "SourceResume",
    "SourceSelection",
    "count_uses",
    "draw_sources",
    "run_fractions",
    "select_sources",
    "with_shares",
]

_T = TypeVar("_T")


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
        shuffled: whether whole passes are permutations; False: in sample order
            (`draw_sources`' ``shuffled``).
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
    shuffled: bool = True

    def is_range(self, position: int) -> bool:
        """Whether ``position`` of the order is in a whole pass taken in sample order (a range
        of the source's samples)."""
        return not self.shuffled and self.head <= position < self.head + self.whole_passes * self.num_samples

    def without_order(self) -> SourceSelection:
        """The same selection without its order (4 bytes per use, freed once copied)."""
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
            head = pass_order(self.name, self.offset, count, self.pass_index, seed, dtype, threads)
            return head[self.left[head - self.offset]][first:last].copy()
        index, at = divmod(first - self.head, count)
        if first < self.head or at + last - first > count:
            raise ValueError(f"positions {first:,}:{last:,} of {self.name!r}'s order are not inside one pass")
        pass_index = self.pass_index + (1 if self.head else 0) + index
        if self.is_range(first):
            return np.arange(self.offset + at, self.offset + at + last - first, dtype=dtype)
        if last - first == count:
            return pass_order(self.name, self.offset, count, pass_index, seed, dtype, threads)
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
    shuffled: bool = True,
    in_order_written: bool = True,
) -> Iterator[SourceSelection]:
    """`select_sources`, one source at a time in the mixture's order, before the weights are
    known (``weight`` 0: `with_shares` sets them once every source is drawn). Each order is
    drawn when its source is asked for: a caller that keeps only what it gathers through
    the orders holds one at a time. With ``out`` (at least `count_uses`' most, of the
    orders' dtype), the orders are drawn into it one after another (each a view of it); with
    ``along`` (as many, of the lengths' dtype), the lengths along them are written into it
    the same way, carried by the shuffles. The partial passes of the next ``threads`` sources
    are drawn on threads of their own while a source's order is drawn (`partial_pass_of`: the
    same draws; each holds a permutation of its source while it is drawn). With
    ``shuffled`` False, whole passes are in sample order: for a caller that shuffles each
    whole pass again (`batchplan.planning.mixture_orders`); with ``in_order_written`` False
    too, those passes are not written into ``out`` (each order holds nothing there: read
    them through `SourceSelection.draw`, a range each)."""
    bounds, source_tokens, targets = _sized(mixture, lengths, offsets)
    dtype = index_dtype(int(lengths.shape[0]))
    wheres = [(resume or {}).get(source.name) for source in mixture.sources]
    partials = [
        partial_pass_of(source.name, lengths, start, end, tokens, target, seed, dtype, where)
        for source, (start, end), tokens, target, where in zip(mixture.sources, bounds, source_tokens, targets, wheres)
    ]
    at, window = 0, max(1, threads)
    with ThreadPoolExecutor(max_workers=window) as ahead:
        coming = {index: ahead.submit(draw) for index, draw in enumerate(partials[:window]) if draw is not None}
        for index, (source, (start, end), tokens, target) in enumerate(
            zip(mixture.sources, bounds, source_tokens, targets)
        ):
            draw = partials[index + window] if index + window < len(partials) else None
            if draw is not None:
                coming[index + window] = ahead.submit(draw)
            partial = coming.pop(index, None)
            if target > 0 and tokens == 0:
                raise DatasetError(
                    f"source {source.name!r}: has {end - start:,} samples and 0 tokens but is asked for {target:,} "
                    f"tokens; give it samples with tokens, or set its "
                    f"{'epochs' if mixture.by_epochs else 'weight'} to 0"
                )
            where = wheres[index]
            drawn = draw_order(
                source.name,
                lengths,
                start,
                end,
                tokens,
                target,
                seed,
                dtype,
                threads,
                where,
                None if out is None else out[at:],
                None if along is None else along[at:],
                None if partial is None else partial.result,
                shuffled,
                in_order_written,
            )
            del partial
            at += drawn.order.shape[0]
            yield _selection(source.name, start, end, tokens, target, drawn, where, shuffled)
            del drawn  # before the next source's order is drawn


def _selection(
    name: str, start: int, end: int, tokens: int, target: int, drawn, where, shuffled: bool = True
) -> SourceSelection:
    """A source's selection from its drawn order (`mixture_orders.Drawn`), before the weights are known."""
    return SourceSelection(
        name=name,
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
        shuffled=shuffled,
    )


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
