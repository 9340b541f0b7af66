"""Group rounds (one micro-batch per rank each) into steps by a global token target.

Greedy, O(n): a step takes the next round while that brings its token count closer
to the target (a step always takes at least one round). Every step then holds the
same number of micro-batches on every rank, and its tokens stay within half a
round of the target except where one round alone exceeds it.

Ramp-up (`ramp_steps`): the target of a step depends on the tokens done before it,
``done``: ``start + (target - start) * done / ramp_tokens`` until ``done`` reaches
``ramp_tokens``, then ``target`` (Megatron's batch-size ramp-up, in tokens). With a
round limit (steps of at most ``max_rounds`` rounds), steps past the ramp hold
exactly ``max_rounds`` (the epoch's last may hold fewer): a fixed micro-batch count
per rank reached by a ramp.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["ramp_steps", "ramp_target", "steps_by_tokens"]


@njit(cache=True, nogil=True)
def ramp_target(done, start, target, ramp_tokens):
    """Global tokens wanted for a step that begins after ``done`` tokens of the run."""
    if done >= ramp_tokens:
        return target
    return start + (target - start) * (done / ramp_tokens)


@njit(cache=True, nogil=True)
def ramp_steps(round_tokens, tokens_before, start, target, ramp_tokens, max_rounds):
    """Step boundaries over rounds, for a target that ramps up with the tokens done.

    Args:
        round_tokens: tokens of each round, in schedule order.
        tokens_before: tokens of the run done before the first round (earlier epochs).
        start: tokens per step at the start of the ramp (float).
        target: tokens per step once the ramp is over (float).
        ramp_tokens: tokens of the run over which the target grows (0: no ramp).
        max_rounds: most rounds per step (0: no limit); once the ramp is over every
            step takes exactly this many (the last one what is left).

    Returns:
        int64 offsets: step ``s`` holds rounds ``offsets[s]:offsets[s + 1]``.
    """
    num_rounds = round_tokens.shape[0]
    offsets = np.empty(num_rounds + 1, dtype=np.int64)
    offsets[0] = 0
    num_steps = 0
    total = 0
    done = tokens_before
    goal = ramp_target(done, start, target, ramp_tokens)
    fixed = max_rounds > 0 and done >= ramp_tokens
    for round in range(num_rounds):
        tokens = round_tokens[round]
        taken = round - offsets[num_steps]
        if taken > 0:
            if fixed:
                close = taken == max_rounds
            else:
                close = abs(total + tokens - goal) >= abs(total - goal) or taken == max_rounds
            if close:
                num_steps += 1
                offsets[num_steps] = round
                done += total
                total = 0
                goal = ramp_target(done, start, target, ramp_tokens)
                fixed = max_rounds > 0 and done >= ramp_tokens
        total += tokens
    if num_rounds > 0:
        num_steps += 1
        offsets[num_steps] = num_rounds
    return offsets[: num_steps + 1].copy()


@njit(cache=True, nogil=True)
def steps_by_tokens(round_tokens, target):
    """Step boundaries over rounds for a constant target (`ramp_steps` without a ramp).

    Args:
        round_tokens: tokens of each round, in schedule order.
        target: global tokens wanted per step.

    Returns:
        int64 offsets: step ``s`` holds rounds ``offsets[s]:offsets[s + 1]``.
    """
    goal = float(target)
    zero = np.int64(0)  # int64, as `batchplan.planning.step_bounds` passes them: one compiled specialisation
    return ramp_steps(round_tokens, zero, goal, goal, zero, zero)
