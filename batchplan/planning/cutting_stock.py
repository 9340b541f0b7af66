"""Packing a length histogram near its cutting-stock bound, with that bound.

The bound is the largest of three, each valid for any packing:

- ``volume``: ceil(tokens / C);
- ``l2``: Martello and Toth's L2 (counts the items longer than C / 2 and what cannot
  share their bins);
- ``lp``: the Gilmore-Gomory linear relaxation, by column generation (HiGHS for the
  restricted master, an O(m C) knapsack over the m lengths for pricing). Every round
  turns the duals ``y`` into a proof: ``y / z``, ``z`` the most a bin can hold by the
  knapsack, is dual feasible, so ceil(y . n / z) bins are needed (Farley's bound), valid
  whatever the floating point error of the solver. The rounds stop when that ceiling
  meets the master's or after min(`MAX_ROUNDS`, `LP_WORK` / m); above `MAX_LP_LENGTHS`
  distinct lengths (an argument) the LP is not solved: its master slows as m^2.

`pack_histogram` runs best fit decreasing first; where that is within `slack(bound)` =
max(bound + 1, bound x 1.0001) of the cheap bounds it stands (most histograms: many items
per bin, or lengths that pair up), at best fit's cost. Otherwise it also fills bins
greedily toward exact fills (`fill_exact`) and keeps the better; if that still misses, it
solves the LP, takes the whole copies of its patterns and packs the rest greedily (SQuAD at
384: 40,196 micro-batches for a bound of 40,195, in under a second).

Everything is deterministic: the same histogram gives the same arrays (the rounds are
counted, not timed, and HiGHS's simplex runs serially; its version goes with numba's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

import numpy as np
from numpy.typing import NDArray

from batchplan.kernels.pack import _best_fit_decreasing
from batchplan.kernels.patterns import (
    fill_exact,
    histogram_bounds,
    lay_out_patterns,
    patterns_of_bins,
    price_patterns,
    take_patterns,
)
from batchplan.plan import index_dtype, packing_fill

__all__ = ["Bound", "HistogramPacking", "lower_bound", "pack_histogram", "slack"]

# Column generation stops after this many rounds, fewer for many lengths: at most
# LP_WORK / m (the bound found so far is valid).
MAX_ROUNDS = 400
LP_WORK = 200_000
# Patterns priced into the master per round.
PATTERNS_PER_ROUND = 10
# Above this many distinct lengths the LP is not solved (the cheap bounds stand).
MAX_LP_LENGTHS = 1024
# Relative margin taken off a computed LP bound before its ceiling (float rounding).
_MARGIN = 1e-9


@dataclass(frozen=True)
class Bound:
    """A lower bound on the bins of any packing of a histogram.

    Attributes:
        bins: no packing has fewer bins.
        kind: which bound gave it: ``"lp"``, ``"l2"`` or ``"volume"``.
        fill: the fill it allows, tokens / (bins x max_tokens) (1.0 for no items).
    """

    bins: int
    kind: str
    fill: float


class HistogramPacking(NamedTuple):
    """A packing in the contract of `batchplan.kernels.pack.pack_bins`, with its bound."""

    slot_bin: NDArray[np.int64]
    offsets: NDArray[np.int64]
    tokens: NDArray[np.int64]
    bound: Bound


def slack(bins: int) -> int:
    """The most bins a packing may have to count as reaching a bound of ``bins``."""
    return max(bins + 1, math.floor(bins * 1.0001))


def _make_bound(bins: int, kind: str, histogram: NDArray, max_tokens: int) -> Bound:
    tokens = int(np.dot(np.arange(max_tokens + 1, dtype=np.int64), histogram[: max_tokens + 1]))
    return Bound(bins=bins, kind=kind, fill=packing_fill(tokens, bins, max_tokens))


def _prepared(histogram, max_tokens: int) -> tuple[NDArray[np.int64], int, str]:
    """A checked int64 copy of the histogram without length 0, and its cheap bound and kind."""
    histogram = _checked(histogram, max_tokens).copy()
    histogram[0] = 0
    volume, l2 = histogram_bounds(histogram, max_tokens)
    known, kind = (int(l2), "l2") if l2 > volume else (int(volume), "volume")
    return histogram, known, kind


def _checked(histogram, max_tokens: int) -> NDArray[np.int64]:
    histogram = np.ascontiguousarray(histogram, dtype=np.int64)
    if max_tokens < 1 or histogram.shape != (max_tokens + 1,):
        raise ValueError(
            f"expected a histogram of max_tokens + 1 = {max_tokens + 1:,} counts (lengths 0..max_tokens), "
            f"found shape {histogram.shape}; build it with numpy.bincount(lengths, minlength=max_tokens + 1)"
        )
    if histogram.min(initial=0) < 0:
        raise ValueError("histogram counts must be >= 0")
    return histogram


class _Master:
    """The restricted master LP: min sum x_p subject to sum_p a_ip x_p >= n_i, x >= 0."""

    def __init__(self, counts: NDArray[np.int64]) -> None:
        from highspy import _core  # the solver class without the start-up banner on stdout

        self.highs = _core._Highs()
        self.highs.setOptionValue("output_flag", False)
        self.highs.setOptionValue("threads", 1)
        self.highs.setOptionValue("simplex_strategy", 4)  # primal: a new column keeps the basis feasible
        self.infinity = self.highs.getInfinity()
        rows = counts.shape[0]
        none = np.zeros(0, dtype=np.int32)
        self.highs.addRows(rows, counts.astype(np.float64), np.full(rows, self.infinity), 0, none, none, np.zeros(0))
        self.columns: list[tuple[NDArray[np.int64], NDArray[np.int64]]] = []
        self.seen: set[bytes] = set()

    def add(self, rows: NDArray[np.int64], counts: NDArray[np.int64]) -> bool:
        """Add the pattern with ``counts`` of rows ``rows`` (False: it is there already)."""
        key = rows.tobytes() + counts.tobytes()
        if key in self.seen:
            return False
        self.seen.add(key)
        self.columns.append((rows, counts))
        self.highs.addCol(1.0, 0.0, self.infinity, rows.shape[0], rows.astype(np.int32), counts.astype(np.float64))
        return True

    def solve(self) -> tuple[float, NDArray[np.float64]]:
        """``(objective, duals)``, duals clipped at 0."""
        self.highs.run()
        duals = np.maximum(np.asarray(self.highs.getSolution().row_dual, dtype=np.float64), 0.0)
        return self.highs.getInfo().objective_function_value, duals

    def values(self) -> NDArray[np.float64]:
        return np.asarray(self.highs.getSolution().col_value, dtype=np.float64)


def _farley_bound(duals: NDArray[np.float64], counts: NDArray[np.int64], most: float) -> int:
    """ceil(y . n / max(z, 1)) less the float margin: a valid bound for dual values ``y`` whose
    best pattern holds ``z``."""
    value = float(np.dot(duals, counts.astype(np.float64))) / max(most, 1.0)
    return math.ceil(value * (1.0 - _MARGIN) - _MARGIN)


def _price(master: _Master, lengths: NDArray[np.int64], duals, max_tokens: int) -> tuple[float, int]:
    """Price new patterns into the master; ``(z, added)``: the best pattern's dual value."""
    rows = np.flatnonzero(duals > 0.0)
    if rows.shape[0] == 0:
        return 0.0, 0
    most, patterns, values = price_patterns(lengths[rows], duals[rows], max_tokens, PATTERNS_PER_ROUND)
    added = 0
    for pattern, value in zip(patterns, values):
        if value > 1.0 + 1e-9:
            used = np.flatnonzero(pattern)
            added += master.add(rows[used], pattern[used])
    return most, added


def _solve_lp(histogram, max_tokens: int, known: int, greedy) -> tuple[int, _Master, NDArray[np.int64]]:
    """Column generation from single-length patterns and ``greedy``'s patterns (CSR over lengths,
    or None). Returns ``(bins, master, lengths)``: the LP bound (at least ``known``), the master
    as solved last, and the lengths its rows stand for."""
    lengths = np.flatnonzero(histogram[1:]) + 1
    counts = histogram[lengths]
    row_of = np.zeros(max_tokens + 1, dtype=np.int64)
    row_of[lengths] = np.arange(lengths.shape[0])
    master = _Master(counts)
    for row, length in enumerate(lengths):
        master.add(np.array([row]), np.array([max_tokens // length]))
    if greedy is not None:
        offsets, pattern_lengths, pattern_counts, _ = greedy
        for p in range(offsets.shape[0] - 1):
            part = slice(offsets[p], offsets[p + 1])
            order = np.argsort(row_of[pattern_lengths[part]], kind="stable")
            master.add(row_of[pattern_lengths[part]][order], pattern_counts[part][order])
    bins = known
    for _ in range(min(MAX_ROUNDS, LP_WORK // lengths.shape[0])):
        objective, duals = master.solve()
        most, added = _price(master, lengths, duals, max_tokens)
        bins = max(bins, _farley_bound(duals, counts, most))
        if added == 0 or bins >= math.ceil(objective * (1.0 - _MARGIN)):
            break
    else:
        master.solve()
    return bins, master, lengths


# Best fit decreasing's packing, ``(slot_bin, offsets, tokens)``, and patterns (the kernels of
# `batchplan.kernels.patterns`): ``(pattern_offsets, pattern_lengths, pattern_counts, copies)``.
_Packing: TypeAlias = tuple[NDArray, NDArray, NDArray]
_Patterns: TypeAlias = tuple[NDArray, NDArray, NDArray, NDArray]


def _best_fit(histogram: NDArray[np.int64], max_tokens: int) -> _Packing:
    """Best fit decreasing's ``(slot_bin, offsets, tokens)`` (slots counted in int32 when they fit)."""
    index = np.empty(0, dtype=index_dtype(int(histogram.sum())))
    return _best_fit_decreasing(histogram, max_tokens, index, None, None, None, None)


def _pack_greedily(histogram: NDArray[np.int64], max_tokens: int, best: _Packing | None = None) -> _Patterns:
    """The patterns of `fill_exact` where they need fewer bins than best fit decreasing's
    (``best``, its packing when already made), else best fit's."""
    greedy = fill_exact(histogram, max_tokens)
    slot_bin, offsets, _ = _best_fit(histogram, max_tokens) if best is None else best
    if greedy[3].sum() < offsets.shape[0] - 1:
        return greedy
    return patterns_of_bins(slot_bin, offsets, histogram, max_tokens)


def _round_lp(master: _Master, lengths, histogram: NDArray[np.int64], max_tokens: int) -> _Patterns:
    """The whole copies of the LP's patterns, then the items left packed greedily: patterns."""
    values = master.values()
    offsets = np.zeros(len(master.columns) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([rows.shape[0] for rows, _ in master.columns])
    # Rows ascend with length; a pattern lists its lengths longest first.
    pattern_lengths = np.concatenate([lengths[rows[::-1]] for rows, _ in master.columns])
    pattern_counts = np.concatenate([counts[::-1] for _, counts in master.columns]).astype(np.int64)
    copies = np.floor(values + 1e-9).astype(np.int64)
    taken, left = take_patterns(histogram, offsets, pattern_lengths, pattern_counts, copies)
    rest = _pack_greedily(left, max_tokens)
    used = np.flatnonzero(taken)
    keep = np.concatenate([np.arange(offsets[p], offsets[p + 1]) for p in used] or [np.zeros(0, dtype=np.int64)])
    sizes = np.diff(offsets)[used]
    return (
        np.concatenate([np.concatenate([[0], np.cumsum(sizes)]), sizes.sum() + rest[0][1:]]),
        np.concatenate([pattern_lengths[keep], rest[1]]),
        np.concatenate([pattern_counts[keep], rest[2]]),
        np.concatenate([taken[used], rest[3]]),
    )


def pack_histogram(
    histogram,
    max_tokens: int,
    *,
    buffers: tuple[NDArray | None, ...] | None = None,
    max_lp_lengths: int = MAX_LP_LENGTHS,
) -> HistogramPacking:
    """Pack a histogram of lengths (counts of lengths 0..max_tokens; length 0 is not packed).

    Best fit decreasing first: where it is within `slack` of the cheap bounds (most
    histograms), that packing stands. Otherwise the better of it and `fill_exact`, and,
    with at most ``max_lp_lengths`` distinct lengths (more: slower, by about m^2 per
    round), the LP's rounded patterns when they need fewer bins.

    Args:
        buffers: best fit's arrays made by the caller, ``(slot_bin, counts, below, tokens)``
            as `batchplan.kernels.pack.pack_bins` takes them; ``slot_bin`` (int32 or
            int64, one per item) is filled whichever packing stands. Default: new arrays.

    Returns:
        ``(slot_bin, offsets, tokens, bound)``: the contract of
        `batchplan.kernels.pack.pack_bins` (slots longest first, bins in a fixed order)
        and the best lower bound found on the way. Never more bins than best fit
        decreasing; the same histogram gives the same arrays.
    """
    histogram, known, kind = _prepared(histogram, max_tokens)
    slot_bin, counts, below, tokens = buffers or (None, None, None, None)
    index = slot_bin if slot_bin is not None else np.empty(0, dtype=index_dtype(int(histogram.sum())))
    best: _Packing = _best_fit_decreasing(histogram, max_tokens, index, slot_bin, counts, below, tokens)
    bins = best[1].shape[0] - 1
    if bins <= slack(known):
        return HistogramPacking(*best, _make_bound(known, kind, histogram, max_tokens))
    patterns = _pack_greedily(histogram, max_tokens, best)
    bins = int(patterns[3].sum())
    if bins > slack(known) and np.count_nonzero(histogram) <= max_lp_lengths:
        lp_bins, master, lengths = _solve_lp(histogram, max_tokens, known, patterns)
        if lp_bins > known:
            known, kind = lp_bins, "lp"
        rounded = _round_lp(master, lengths, histogram, max_tokens)
        if rounded[3].sum() < bins:
            patterns = rounded
    slot_bin, offsets, tokens = lay_out_patterns(histogram, max_tokens, *patterns, best[0])
    return HistogramPacking(slot_bin, offsets, tokens, _make_bound(known, kind, histogram, max_tokens))


def lower_bound(histogram, max_tokens: int, *, max_lp_lengths: int = MAX_LP_LENGTHS) -> Bound:
    """The best of the volume, L2 and (up to ``max_lp_lengths`` distinct lengths; 0: never)
    LP bounds on the bins of any packing of ``histogram`` (counts of lengths 0..max_tokens).

    The LP starts from a greedy packing's patterns and is skipped when that packing already
    meets the cheap bounds (no bound can then be higher).
    """
    histogram, known, kind = _prepared(histogram, max_tokens)
    if 0 < np.count_nonzero(histogram) <= max_lp_lengths:
        patterns = _pack_greedily(histogram, max_tokens)
        if patterns[3].sum() > known:
            lp_bins, _, _ = _solve_lp(histogram, max_tokens, known, patterns)
            if lp_bins > known:
                known, kind = lp_bins, "lp"
    return _make_bound(known, kind, histogram, max_tokens)
