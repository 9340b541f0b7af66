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

Cost: one permutation per pass (`batchplan.planning.randomness.permute`, about 4x faster
than ``rng.permutation`` at 10^7); memory: the orders (4 bytes per selected sample below
2^31 samples, else 8) plus, for a partial pass, one permutation of its source and a chunk
of 2^20 prefix sums. No loop runs per sample.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import numpy as np
from numpy.typing import NDArray

from batchplan.errors import DatasetError
from batchplan.mixture import Mixture
from batchplan.plan import index_dtype
from batchplan.planning.randomness import permute, source_pass_rng

__all__ = ["SourceResume", "SourceSelection", "run_fractions", "select_sources"]

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

    def without_order(self) -> SourceSelection:
        """The same selection without its order (4 bytes per use, let go once copied)."""
        return dataclasses.replace(self, order=None)


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
    offsets = np.asarray(offsets, dtype=np.int64)
    _check_offsets(mixture, lengths, offsets)
    dtype = index_dtype(int(lengths.shape[0]))
    bounds = [(int(offsets[k]), int(offsets[k + 1])) for k in range(len(mixture.sources))]
    source_tokens = [int(lengths[start:end].sum(dtype=np.int64)) for start, end in bounds]
    targets = _targets(mixture, source_tokens)
    selections = []
    for source, (start, end), tokens, target in zip(mixture.sources, bounds, source_tokens, targets):
        if target > 0 and tokens == 0:
            raise DatasetError(
                f"source {source.name!r}: has {end - start:,} samples and 0 tokens but is asked for {target:,} "
                f"tokens; give it samples with tokens, or set its {'epochs' if mixture.by_epochs else 'weight'} to 0"
            )
        at = (resume or {}).get(source.name)
        order, planned, head = _draw_order(source.name, lengths, start, end, tokens, target, seed, dtype, threads, at)
        selection = SourceSelection(
            name=source.name,
            offset=start,
            num_samples=end - start,
            weight=0.0,  # set below, once every source's planned tokens are known
            target_tokens=target,
            planned_tokens=planned,
            passes=planned / tokens if tokens else 0.0,
            order=order,
            head=head,
        )
        selections.append(selection)
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
            epochs = Fraction(source.epochs)
            whole = math.floor(epochs)
            targets.append(whole * tokens + round((epochs - whole) * tokens))
        return targets
    return [round(target) for target in _phase_targets(mixture, mixture.tokens)]


def _phase_targets(mixture: Mixture, point: int) -> list[Fraction]:
    """Each source's tokens in the run's first ``point`` tokens: every phase's normalised
    weights times the phase's tokens before ``point``, summed (exact fractions)."""
    starts = [0] + [phase.from_tokens for phase in mixture.phases]
    ends = starts[1:] + [mixture.tokens]
    rows = [[Fraction(source.weight) for source in mixture.sources]]
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
    points = [mixture.tokens * epoch // epochs for epoch in range(epochs + 1)]
    whole = _phase_targets(mixture, mixture.tokens)
    fractions = np.zeros((len(mixture.sources), epochs + 1), dtype=np.float64)
    for column, point in enumerate(points):
        for row, (part, total) in enumerate(zip(_phase_targets(mixture, point), whole)):
            fractions[row, column] = float(part / total) if total else 0.0
    return fractions


def _shares(mixture: Mixture, planned: list[int]) -> list[float]:
    """Each source's share of the run's tokens: its normalised weight (with phases, its
    target over the run's tokens), or its planned tokens over all (sized by epochs)."""
    if mixture.phases:
        return [float(target / mixture.tokens) for target in _phase_targets(mixture, mixture.tokens)]
    if not mixture.by_epochs:
        total = sum(source.weight for source in mixture.sources)
        return [source.weight / total for source in mixture.sources]
    total = sum(planned)
    return [tokens / total if total else 0.0 for tokens in planned]


def _draw_order(
    name: str, lengths: NDArray, start: int, end: int, tokens: int, target: int, seed: int, dtype: np.dtype,
    threads: int, resume: SourceResume | None = None,
) -> tuple[NDArray, int]:
    """What is left of a pass under way (``resume``), whole passes, then the prefix of one more
    nearest the rest: ``(order, planned tokens, positions before the first whole pass)``."""
    count = end - start
    if target == 0:
        return np.empty(0, dtype=dtype), 0, 0
    head, first_pass = np.empty(0, dtype=dtype), 0
    if resume is not None:
        first_pass = resume.pass_index
        if not resume.left.all():
            head = _pass_order(name, start, count, first_pass, seed, dtype, threads)
            head = head[resume.left[head - start]]
            head_tokens = int(lengths[head].sum(dtype=np.int64))
            if target <= head_tokens:
                order, planned = _nearest_prefix(head, lengths, target)
                return order, planned, order.shape[0]
            target -= head_tokens
            first_pass += 1
    whole, rest = divmod(target, tokens)
    partial, partial_tokens = np.empty(0, dtype=dtype), 0
    if rest:
        partial, partial_tokens = _nearest_prefix(
            _pass_order(name, start, count, first_pass + whole, seed, dtype, threads), lengths, rest
        )
    order = np.empty(head.shape[0] + whole * count + partial.shape[0], dtype=dtype)
    order[: head.shape[0]] = head
    for index in range(whole):
        at = head.shape[0] + index * count
        permute(source_pass_rng(seed, name, first_pass + index), order[at : at + count], start, threads=threads)
    order[head.shape[0] + whole * count :] = partial
    planned = int(lengths[head].sum(dtype=np.int64)) + whole * tokens + partial_tokens
    return order, planned, head.shape[0]


def _pass_order(name: str, start: int, count: int, index: int, seed: int, dtype: np.dtype, threads: int) -> NDArray:
    """Pass ``index`` of a source: its global sample indices in that pass's seeded order."""
    order = np.empty(count, dtype=dtype)
    permute(source_pass_rng(seed, name, index), order, start, threads=threads)
    return order


def _nearest_prefix(order: NDArray, lengths: NDArray, rest: int) -> tuple[NDArray, int]:
    """The prefix of ``order`` whose tokens are nearest ``rest`` (a tie takes the shorter):
    ``(its global sample indices, its tokens)``; ``order`` holds at least ``rest`` tokens."""
    done = 0
    for first in range(0, order.shape[0], _CHUNK):
        sums = np.cumsum(lengths[order[first : first + _CHUNK]], dtype=np.int64)
        sums += done
        if sums[-1] < rest:
            done = int(sums[-1])
            continue
        # sums[at] is the first prefix (of first + at + 1 samples) reaching rest; the one before it falls short.
        at = int(np.searchsorted(sums, rest, side="left"))
        before = int(sums[at - 1]) if at else done
        if rest - before <= int(sums[at]) - rest:
            return order[: first + at].copy(), before
        return order[: first + at + 1].copy(), int(sums[at])
    raise AssertionError(f"a prefix of {rest:,} tokens is asked of an order of {done:,}")
