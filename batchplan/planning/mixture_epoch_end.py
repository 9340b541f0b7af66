"""A mixture's epoch end under ``drop_last``: its last step, which takes what the composed
steps leave (`batchplan.planning.mixture_steps`), is dropped when it is incomplete, by the
rules of one dataset (`batchplan.planning.epoch_end`):

- ``M`` micro-batches per rank per step: the last step is incomplete when it holds fewer than
  ``M`` rounds (one micro-batch per rank each), and is dropped whole.
- A token target (or a ramp-up): the micro-batches past its last whole round are dropped; then
  the step is dropped too when another round, of the epoch's mean, would bring it nearer its
  target (under a ramp-up to ``M`` per rank, once the ramp is over: fewer than ``M`` rounds).

The micro-batches a step drops past its whole rounds are taken from the ends of its sources'
queues (so repetition order holds: a use is never dropped before a later one of its source
is kept), each from the source furthest above its share of what the step keeps. The dropped
micro-batches' entries are the epoch's ``dropped_entries`` (the plan lists their samples, a
sample once per dropped use); every kept step is whole.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig
from batchplan.errors import DatasetError
from batchplan.kernels.steps import ramp_target
from batchplan.planning.mixture_steps import Composed

__all__ = ["drop_incomplete_end"]


def drop_incomplete_end(composed: Composed, config: PlanConfig, epoch: int) -> Composed:
    """``composed`` with its incomplete end moved past its steps' end (its order holds every
    micro-batch still: the kept ones, then the dropped ones, which `schedule_epoch` lists).

    Raises:
        DatasetError: the epoch's micro-batches do not fill one step: all would be dropped.
    """
    order, steps, world_size = composed.order, composed.steps, config.world_size
    begin = int(steps[-2])
    last = order[begin:]
    tokens = composed.batches.tokens()
    kept = _whole_rounds(composed, last, tokens, world_size)
    if kept.shape[0] == 0 or _incomplete(composed, tokens, begin, last[kept], config):
        kept = kept[:0]
    if begin + kept.shape[0] == 0:
        raise DatasetError(
            f"`drop_last=True` would drop all {order.shape[0]:,} micro-batches of the mixture's epoch {epoch}: they "
            f"do not fill one step of {world_size} ranks; use fewer ranks or micro-batches per step, or leave "
            "`drop_last` off"
        )
    dropped = np.ones(last.shape[0], dtype=bool)
    dropped[kept] = False
    reordered = np.concatenate([order[:begin], last[kept], last[dropped]]).astype(order.dtype)
    ends = steps[:-1] if kept.shape[0] == 0 else np.append(steps[:-1], begin + kept.shape[0])
    return dataclasses.replace(composed, order=reordered, steps=ends)


def _whole_rounds(composed: Composed, last: NDArray[np.integer], tokens, world_size: int) -> NDArray[np.int64]:
    """Positions in ``last`` (the last step, source after source, each source's in queue
    order) of its micro-batches but the ``len(last) % world_size`` it drops past its whole
    rounds: each from the end of the source furthest above its share of what is kept."""
    source = composed.sources_of(last)
    held = np.ones(last.shape[0], dtype=bool)
    counts = tokens[last].astype(np.float64)
    shares = _epoch_shares(composed, tokens)
    for _ in range(last.shape[0] % world_size):
        present = np.unique(source[held])
        step_tokens = float(counts[held].sum())
        over = [float(counts[held & (source == s)].sum()) - shares[s] * step_tokens for s in present]
        chosen = present[int(np.argmax(over))]
        held[np.flatnonzero(held & (source == chosen))[-1]] = False
    return np.flatnonzero(held)


def _epoch_shares(composed: Composed, tokens) -> NDArray[np.float64]:
    """Each source's share of the epoch's tokens (by source index)."""
    part_tokens = np.add.reduceat(tokens.astype(np.int64), composed.part_bounds[:-1])
    shares = np.zeros(int(composed.part_source.max()) + 1, dtype=np.float64)
    np.add.at(shares, composed.part_source, part_tokens.astype(np.float64))
    return shares / max(float(shares.sum()), 1.0)


def _incomplete(composed: Composed, tokens, begin: int, kept: NDArray[np.integer], config: PlanConfig) -> bool:
    """Whether the last step, of the whole rounds ``kept``, is incomplete (module docstring)."""
    world_size, per_step = config.world_size, config.micro_batches_per_step
    rounds = kept.shape[0] // world_size
    if per_step is not None and not config.has_rampup:
        return rounds < per_step
    sizing = composed.sizing
    done = composed.sizing[1] + float(tokens[composed.order[:begin]].sum(dtype=np.int64))
    if per_step is not None and (done >= sizing[4] or rounds >= per_step):
        return rounds < per_step
    whole = begin + kept.shape[0]
    next_round = float(tokens[composed.order[:begin]].sum(dtype=np.int64) + tokens[kept].sum(dtype=np.int64))
    next_round /= max(1, whole // world_size)
    last_step = float(tokens[kept].sum(dtype=np.int64))
    target = float(ramp_target(done, sizing[2], sizing[3], sizing[4]))
    return abs(last_step + next_round - target) < abs(last_step - target)
