"""Group chunks (one micro-batch per rank each) into steps by a global token target.

Greedy, O(n): a step takes the next chunk while that brings its token count closer
to the target (a step always takes at least one chunk). Every step then holds the
same number of micro-batches on every rank, and its tokens stay within half a
chunk of the target except where one chunk alone exceeds it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["steps_by_tokens"]


@njit(cache=True, nogil=True)
def steps_by_tokens(chunk_tokens, target):
    """Step boundaries over chunks.

    Args:
        chunk_tokens: tokens of each chunk, in schedule order.
        target: global tokens wanted per step.

    Returns:
        int64 offsets: step ``s`` holds chunks ``offsets[s]:offsets[s + 1]``.
    """
    num_chunks = chunk_tokens.shape[0]
    offsets = np.empty(num_chunks + 1, dtype=np.int64)
    offsets[0] = 0
    num_steps = 0
    total = 0
    for chunk in range(num_chunks):
        tokens = chunk_tokens[chunk]
        if chunk > offsets[num_steps] and abs(total + tokens - target) >= abs(total - target):
            num_steps += 1
            offsets[num_steps] = chunk
            total = 0
        total += tokens
    if num_chunks > 0:
        num_steps += 1
        offsets[num_steps] = num_chunks
    return offsets[: num_steps + 1].copy()
