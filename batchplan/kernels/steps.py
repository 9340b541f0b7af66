"""Group chunks (one micro-batch per rank each) into steps by a global token target.

Greedy, O(n): a step takes the next chunk while that brings its token count closer
to the target (a step always takes at least one chunk). Every step then holds the
same number of micro-batches on every rank, and its tokens stay within half a
chunk of the target except where one chunk alone exceeds it.

Ramp-up (`ramp_steps`): the target of a step depends on the tokens done before it,
``done``: ``start + (target - start) * done / ramp_tokens`` until ``done`` reaches
``ramp_tokens``, then ``target`` (Megatron's batch-size ramp-up, in tokens). With a
chunk limit (steps of at most ``max_chunks`` chunks), steps past the ramp hold
exactly ``max_chunks`` (the epoch's last may hold fewer): a fixed micro-batch count
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
def ramp_steps(chunk_tokens, tokens_before, start, target, ramp_tokens, max_chunks):
    """Step boundaries over chunks, for a target that ramps up with the tokens done.

    Args:
        chunk_tokens: tokens of each chunk, in schedule order.
        tokens_before: tokens of the run done before the first chunk (earlier epochs).
        start: tokens per step at the start of the ramp (float).
        target: tokens per step once the ramp is over (float).
        ramp_tokens: tokens of the run over which the target grows (0: no ramp).
        max_chunks: most chunks per step (0: no limit); once the ramp is over every
            step takes exactly this many (the last one what is left).

    Returns:
        int64 offsets: step ``s`` holds chunks ``offsets[s]:offsets[s + 1]``.
    """
    num_chunks = chunk_tokens.shape[0]
    offsets = np.empty(num_chunks + 1, dtype=np.int64)
    offsets[0] = 0
    num_steps = 0
    total = 0
    done = tokens_before
    goal = ramp_target(done, start, target, ramp_tokens)
    fixed = max_chunks > 0 and done >= ramp_tokens
    for chunk in range(num_chunks):
        tokens = chunk_tokens[chunk]
        taken = chunk - offsets[num_steps]
        if taken > 0:
            if fixed:
                close = taken == max_chunks
            else:
                close = abs(total + tokens - goal) >= abs(total - goal) or taken == max_chunks
            if close:
                num_steps += 1
                offsets[num_steps] = chunk
                done += total
                total = 0
                goal = ramp_target(done, start, target, ramp_tokens)
                fixed = max_chunks > 0 and done >= ramp_tokens
        total += tokens
    if num_chunks > 0:
        num_steps += 1
        offsets[num_steps] = num_chunks
    return offsets[: num_steps + 1].copy()


@njit(cache=True, nogil=True)
def steps_by_tokens(chunk_tokens, target):
    """Step boundaries over chunks for a constant target (`ramp_steps` without a ramp).

    Args:
        chunk_tokens: tokens of each chunk, in schedule order.
        target: global tokens wanted per step.

    Returns:
        int64 offsets: step ``s`` holds chunks ``offsets[s]:offsets[s + 1]``.
    """
    goal = float(target)
    return ramp_steps(chunk_tokens, 0, goal, goal, 0, 0)
