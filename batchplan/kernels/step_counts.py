"""How many micro-batches each source gives one step of a mixture (`batchplan.kernels.interleave`).

Each source's count ``n_s`` is kept where its tokens in the step lie within ``max_tokens`` of
what it is due of the step's tokens (a window two micro-batches wide, which always holds a
count): every source first takes the least count of its window, then places go one at a time
to the micro-batch that finishes first on its source's clock among sources not ahead of their
share, within windows where they can (WF2Q). The step's tokens, on which the windows depend,
are found by iterating from an estimate (at most `_PASSES` times); a last repair moves
micro-batches while a source misses its window.

A source's prefix sums (its tokens in its first ``n`` micro-batches of the queue) are summed
only as far as a count looks (`_fill`): about its share of a step, not the whole step, for
each source.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["compose_counts", "due_tokens", "prefix_room"]

_PASSES = 4


@njit(cache=True, nogil=True)
def compose_counts(seats, mean, tokens, cursor, ends, due, shares, taken, max_tokens, count, room):
    """Counts per source (``count``) for a step of ``seats`` micro-batches, each source's from
    its ``cursor`` and before its ``ends`` (``mean``: the tokens of a micro-batch left, on
    average; ``due``: `due_tokens`'s phases, the step's phase and the run's tokens before it);
    returns the step's tokens. ``room``: float64, (sources, at least ``seats + 1``), the
    prefix sums' (`prefix_room`; its values are not read), one array for every step."""
    num_sources = shares.shape[0]
    # prefix[s, n]: the tokens of source s's first n micro-batches, summed up to filled[s]
    prefix = room if room.shape[1] > seats else np.empty((num_sources, seats + 1), dtype=np.float64)
    filled = np.zeros(num_sources, dtype=np.int64)
    avail = np.zeros(num_sources, dtype=np.int64)
    for source in range(num_sources):
        avail[source] = min(seats, ends[source] - cursor[source])
        prefix[source, 0] = 0.0
    sums = (prefix, filled, tokens, cursor)
    estimate = seats * mean
    low = np.zeros(num_sources, dtype=np.int64)
    high = np.zeros(num_sources, dtype=np.int64)
    so_far = 0.0
    for source in range(num_sources):
        so_far += taken[source]
    step_tokens = 0.0
    for _ in range(_PASSES):
        for source in range(num_sources):
            low[source], high[source] = _window(
                sums, source, avail[source], due_tokens(due, source, estimate), max_tokens
            )
            count[source] = low[source]
        _fit(seats, sums, shares, taken, so_far, avail, low, high, count)
        step_tokens = 0.0
        for source in range(num_sources):
            step_tokens += prefix[source, count[source]]
        if step_tokens == estimate:
            break
        estimate = step_tokens
    return _repair(sums, avail, due, max_tokens, count, step_tokens)


@njit(cache=True, nogil=True)
def prefix_room(num_sources, seats):
    """`compose_counts`' ``room`` for steps of up to ``seats`` micro-batches (a step of more
    makes its own)."""
    return np.empty((num_sources, seats + 1), dtype=np.float64)


@njit(cache=True, nogil=True)
def due_tokens(due, source, step_tokens):
    """The tokens ``source`` is due in a step of ``step_tokens`` tokens: its weight of the
    step's phase times them, and where later phases begin within the step, each phase's
    weight times the step's tokens in it. ``due``: ``(phase_starts, phase_weights, phase,
    done)``, the run's tokens before the step ``done``."""
    starts, weights, phase, done = due
    end = done + step_tokens
    if phase + 1 >= starts.shape[0] or end <= starts[phase + 1]:
        return weights[phase, source] * step_tokens
    owed = weights[phase, source] * (starts[phase + 1] - done)
    for later in range(phase + 1, starts.shape[0]):
        stop = end if later + 1 == starts.shape[0] else min(end, starts[later + 1])
        if stop <= starts[later]:
            break
        owed += weights[later, source] * (stop - starts[later])
    return owed


@njit(cache=True, nogil=True)
def _fill(sums, source, n):
    """Sum ``source``'s prefix up to its count ``n`` (``sums``: ``(prefix, filled, tokens,
    cursor)``, `compose_counts`'), in order: the sums are those of summing the whole queue."""
    prefix, filled, tokens, cursor = sums
    for k in range(filled[source], n):
        prefix[source, k + 1] = prefix[source, k] + tokens[cursor[source] + k]
    filled[source] = max(filled[source], n)


@njit(cache=True, nogil=True)
def _window(sums, source, avail, target, max_tokens):
    """``(low, high)``: the counts of ``source`` whose tokens lie within ``max_tokens`` of
    ``target`` (prefix sums do not decrease: the first count past them ends the search)."""
    prefix = sums[0]
    low = avail
    for n in range(avail + 1):
        _fill(sums, source, n)
        if prefix[source, n] >= target - max_tokens:
            low = n
            break
    high = low
    for n in range(low, avail + 1):
        _fill(sums, source, n)
        if prefix[source, n] > target + max_tokens:
            break
        high = n
    return low, high


@njit(cache=True, nogil=True)
def _fit(seats, sums, shares, taken, so_far, avail, low, high, count):
    """Bring the counts to ``seats`` a micro-batch at a time, within windows where it can.

    Added: of the sources not ahead of their share of the run (``so_far`` tokens before the
    step, and those placed), the next micro-batch that finishes first on its source's clock
    (its source's tokens after it, over the source's share); taken back: the placed one
    that finishes last. This is worst-case fair weighted fair queueing (WF2Q): each source
    stays within a micro-batch of its share of the run at every step."""
    prefix = sums[0]
    num_sources = shares.shape[0]
    placed = 0
    now = so_far
    for source in range(num_sources):
        placed += count[source]
        now += prefix[source, count[source]]
    while placed != seats:
        grow = placed < seats
        best, best_key = -1, -np.inf
        for tier in range(4):  # within windows and not ahead; within windows; not ahead; any
            bounded, eligible = tier < 2, tier % 2 == 0
            for source in range(num_sources):
                n = count[source]
                if grow and (n >= avail[source] or (bounded and n >= high[source])):
                    continue
                if not grow and (n <= 0 or (bounded and n <= low[source])):
                    continue
                done = taken[source] + prefix[source, n]
                if grow and eligible and done > shares[source] * now:
                    continue
                if grow:
                    _fill(sums, source, n + 1)
                clock = max(shares[source], 1e-300)
                key = -(taken[source] + prefix[source, n + 1]) / clock if grow else done / clock
                if key > best_key:
                    best, best_key = source, key
            if best >= 0:
                break
        if grow:
            now += prefix[best, count[best] + 1] - prefix[best, count[best]]
            count[best] += 1
            placed += 1
        else:
            now -= prefix[best, count[best]] - prefix[best, count[best] - 1]
            count[best] -= 1
            placed -= 1


@njit(cache=True, nogil=True)
def _repair(sums, avail, due, max_tokens, count, step_tokens):
    """While a source lies more than ``max_tokens`` off what it is due of the step's actual
    tokens, move a micro-batch from the source furthest ahead to the one furthest behind, as
    long as that lowers the largest miss; returns the step's tokens."""
    prefix = sums[0]
    num_sources = prefix.shape[0]
    worst = _worst_miss(prefix, due, count, step_tokens)
    while worst > max_tokens:
        ahead, behind, most_ahead, most_behind = -1, -1, -np.inf, -np.inf
        for source in range(num_sources):
            miss = prefix[source, count[source]] - due_tokens(due, source, step_tokens)
            if count[source] > 0 and miss > most_ahead:
                ahead, most_ahead = source, miss
            if count[source] < avail[source] and -miss > most_behind:
                behind, most_behind = source, -miss
        if ahead < 0 or behind < 0 or ahead == behind:
            break
        _fill(sums, behind, count[behind] + 1)
        count[ahead] -= 1
        count[behind] += 1
        moved = step_tokens - (prefix[ahead, count[ahead] + 1] - prefix[ahead, count[ahead]])
        moved += prefix[behind, count[behind]] - prefix[behind, count[behind] - 1]
        after = _worst_miss(prefix, due, count, moved)
        if after >= worst:  # no better: undo, and keep the step as it is
            count[ahead] += 1
            count[behind] -= 1
            break
        worst, step_tokens = after, moved
    return step_tokens


@njit(cache=True, nogil=True)
def _worst_miss(prefix, due, count, step_tokens):
    worst = 0.0
    for source in range(prefix.shape[0]):
        worst = max(worst, abs(prefix[source, count[source]] - due_tokens(due, source, step_tokens)))
    return worst
