"""Compose steps of sources' micro-batches so that every step holds each source's token share.

Step by step: a step of ``seats`` micro-batches (a fixed number of rounds, or the rounds
whose tokens come nearest a token target, which a ramp-up grows) takes ``n_s`` micro-batches
from the front of each source's queue. Each ``n_s`` is kept where the source's tokens in the
step lie within ``max_tokens`` of ``weight_s x`` the step's tokens (a window two micro-batches
wide, which always holds a count): every source first takes the least count of its window,
then places go one at a time to the micro-batch that finishes first on its source's clock
(its tokens over its share) among sources not ahead of their share, within windows where
they can: worst-case fair weighted fair queueing (WF2Q, Bennett and Zhang 1996), so that
no source drifts from its share of the epoch by more than a step. The step's
tokens, on which the windows depend, are found by iterating from an estimate (at most four
times); a last repair moves micro-batches while a source misses its window.

Weights may change at phases: a phase holds from the first step whose tokens before it reach
the phase's start (a step in which later phases begin is due each phase's weight of its
tokens in that phase), and the clocks restart there (each source's tokens counted from the
switch): due on the phase's weights while another switch lies ahead in the epoch, and on
what is left of each source in the epoch's last phase, so that all run out together.
O(n x sources) per pass.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from batchplan.kernels.step_counts import compose_counts, due_tokens, prefix_room
from batchplan.kernels.steps import ramp_target

__all__ = ["compose_segments", "compose_steps"]


@njit(cache=True, nogil=True)
def compose_steps(
    source_offsets, tokens, phase_starts, phase_weights, shares, world_size, max_tokens, sizing, out, step_offsets
):
    """Fill ``out`` with micro-batch ids step by step and ``step_offsets`` with the steps'
    bounds over it; return the number of steps.

    Args:
        source_offsets: int64, ``sources + 1`` bounds: source ``s`` holds micro-batches
            ``source_offsets[s]:source_offsets[s + 1]``, in the order they are to be taken.
        tokens: int64 tokens of every micro-batch.
        phase_starts: float64, increasing, ``phase_starts[0] <= sizing[1]``: the run's tokens
            before each phase.
        phase_weights: float64, (phases, sources): the share each source is held to in every
            step of a phase (each row summing to 1): its window is ``max_tokens`` around
            ``weight x`` the step's tokens.
        shares: float64 share each source has of all the tokens (summing to 1; near the
            weights): the clock each source is due on when no phase begins within the epoch,
            so that all run out together.
        world_size: micro-batches per round.
        max_tokens: the half-width of a source's window, in tokens.
        sizing: float64 ``(rounds, tokens_before, start, target, ramp_tokens, max_rounds)``:
            ``rounds > 0``: every step that many rounds; else the rounds nearest
            ``ramp_target(done, start, target, ramp_tokens)`` (at most ``max_rounds`` when > 0,
            exactly that many once the ramp is over).
        out: int64, ``source_offsets[-1]`` long.
        step_offsets: int64, at least ``len(out) + 1`` long.
    """
    limits = source_offsets[1:].copy().reshape((1, source_offsets.shape[0] - 1))
    return compose_segments(
        source_offsets,
        limits,
        np.zeros(1),
        tokens,
        phase_starts,
        phase_weights,
        shares,
        world_size,
        max_tokens,
        sizing,
        out,
        step_offsets,
    )


@njit(cache=True, nogil=True)
def compose_segments(
    source_offsets,
    limits,
    joins,
    tokens,
    phase_starts,
    phase_weights,
    shares,
    world_size,
    max_tokens,
    sizing,
    out,
    step_offsets,
):
    """`compose_steps` over queues in segments: ``limits`` (int64, (segments, sources),
    non-decreasing down each column, the last row ``source_offsets[1:]``): segment ``g`` of
    source ``s`` ends at ``limits[g, s]``. A step takes micro-batches of the segments so far
    only. The next segment joins where what they have left would be the last step (it fits
    in the step), so a micro-batch of segment ``g`` is taken in a step that begins after
    every token of segments ``0..g-1`` but what fits in one step; or, once the run's tokens
    reach ``joins[g]`` (float64, per segment), where a source has too little left in them
    for its share of the step."""
    num_sources = shares.shape[0]
    total = out.shape[0]
    cursor = source_offsets[:-1].copy()
    taken = np.zeros(num_sources, dtype=np.float64)  # tokens of each source so far
    count = np.zeros(num_sources, dtype=np.int64)
    rounds, done = int(sizing[0]), sizing[1]
    remaining = float(tokens.sum())  # int64: exact
    cumulative = np.zeros(total + 1 if limits.shape[0] > 1 else 1, dtype=np.float64)
    for i in range(cumulative.shape[0] - 1):
        cumulative[i + 1] = cumulative[i] + tokens[i]
    position, steps, phase, segment = 0, 0, -1, 0
    step_offsets[0] = 0
    clock, room = shares.copy(), prefix_room(num_sources, world_size * max(rounds, int(sizing[5]), 1))
    while position < total:
        phase = _enter_phase(
            phase, done, remaining, phase_starts, phase_weights, tokens, cursor, source_offsets, taken, clock
        )
        due = (phase_starts, phase_weights, phase, done)
        while True:  # the step's seats, and the segments it takes from (module docstring)
            ends = limits[segment]
            left, ahead = total - position, remaining
            if limits.shape[0] > 1:
                left, ahead = _available(cursor, ends, cumulative)
            seats = world_size * _step_rounds(
                rounds,
                done,
                sizing,
                tokens,
                cursor,
                ends,
                due,
                clock,
                taken,
                world_size,
                max_tokens,
                left,
                ahead,
                count,
                room,
            )
            if segment + 1 == limits.shape[0]:
                break
            if seats < left and not (
                done >= joins[segment + 1]
                and _short(seats, seats * ahead / left, tokens, cursor, ends, cumulative, due, max_tokens)
            ):
                break
            segment += 1
        if seats >= left:  # the epoch's last step takes what is left
            for source in range(num_sources):
                count[source] = ends[source] - cursor[source]
        else:
            compose_counts(seats, ahead / left, tokens, cursor, ends, due, clock, taken, max_tokens, count, room)
        position, step_tokens = _take(count, cursor, tokens, taken, out, position)
        done += step_tokens
        remaining -= step_tokens
        steps += 1
        step_offsets[steps] = position
    return steps


@njit(cache=True, nogil=True)
def _short(seats, step_tokens, tokens, cursor, ends, cumulative, due, max_tokens):
    """Whether the queues before their ``ends`` fall short of a step of ``seats`` micro-batches
    and about ``step_tokens`` tokens: a source holds less than it is due, or together they
    hold fewer micro-batches within the sources' windows."""
    room = 0
    for source in range(cursor.shape[0]):
        target = due_tokens(due, source, step_tokens)
        if cumulative[ends[source]] - cumulative[cursor[source]] < target:
            return True
        held, at = 0.0, cursor[source]
        while at < ends[source] and at - cursor[source] < seats and held + tokens[at] <= target + max_tokens:
            held += tokens[at]
            at += 1
        room += at - cursor[source]
    return room < seats


@njit(cache=True, nogil=True)
def _available(cursor, ends, cumulative):
    """The micro-batches the queues hold before ``ends`` (from each ``cursor``), and their tokens."""
    left, ahead = 0, 0.0
    for source in range(cursor.shape[0]):
        left += ends[source] - cursor[source]
        ahead += cumulative[ends[source]] - cumulative[cursor[source]]
    return left, ahead


@njit(cache=True, nogil=True)
def _take(count, cursor, tokens, taken, out, position):
    """Write a step's micro-batches to ``out`` from ``position`` on: ``count`` of each source
    from its ``cursor`` on (moved past them), adding their tokens to ``taken``; returns the
    position after them and the step's tokens."""
    step_tokens = 0.0
    for source in range(count.shape[0]):
        for i in range(count[source]):
            out[position] = cursor[source] + i
            taken[source] += tokens[cursor[source] + i]
            step_tokens += tokens[cursor[source] + i]
            position += 1
        cursor[source] += count[source]
    return position, step_tokens


@njit(cache=True, nogil=True)
def _enter_phase(phase, done, remaining, phase_starts, phase_weights, tokens, cursor, source_offsets, taken, clock):
    """The phase of the step after ``done`` tokens of the run (``phase``: the last step's, -1
    before the first); where a phase begins, the clocks restart (``taken`` from 0) and are due
    on the phase's weights while another phase begins within the epoch (``remaining`` tokens
    left), else on what is left of each source, so that all run out together."""
    num_phases = phase_starts.shape[0]
    begins = phase
    while begins + 1 < num_phases and done >= phase_starts[begins + 1]:
        begins += 1
    if begins == phase:
        return phase
    taken[:] = 0.0
    if begins + 1 < num_phases and phase_starts[begins + 1] < done + remaining:
        clock[:] = phase_weights[begins]
    elif phase >= 0:  # the epoch's last phase: due on what is left of each source
        for source in range(clock.shape[0]):
            clock[source] = 0.0
            for i in range(cursor[source], source_offsets[source + 1]):
                clock[source] += tokens[i]
            clock[source] /= max(remaining, 1.0)
    return begins


@njit(cache=True, nogil=True)
def _step_rounds(
    rounds, done, sizing, tokens, cursor, ends, due, shares, taken, world_size, max_tokens, left, remaining, count, room
):
    """Rounds of the next step: fixed, or those whose composed tokens come nearest the goal
    (``left`` micro-batches of ``remaining`` tokens to take, each source's before its ``ends``;
    ``room``: `compose_counts`')."""
    if rounds > 0:
        return rounds
    max_rounds = int(sizing[5])
    if max_rounds > 0 and done >= sizing[4]:
        return max_rounds
    goal = ramp_target(done, sizing[2], sizing[3], sizing[4])
    per_round = world_size * remaining / max(left, 1)
    guess = max(1, int(round(goal / max(per_round, 1.0))))
    best, best_off = 1, np.inf
    for candidate in range(max(1, guess - 1), guess + 2):
        if max_rounds > 0 and candidate > max_rounds:
            break
        seats = candidate * world_size
        if seats >= left:
            off = abs(remaining - goal)
        else:
            mean = remaining / left
            composed = compose_counts(seats, mean, tokens, cursor, ends, due, shares, taken, max_tokens, count, room)
            off = abs(composed - goal)
        if off < best_off:
            best, best_off = candidate, off
        if seats >= left:
            break
    return best
