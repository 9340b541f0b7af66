"""An epoch's end: its micro-batches rarely fill the last round (one per rank).

Without ``drop_last`` the last round is completed: micro-batches are split in two,
largest first, then empty micro-batches fill the rest. With ``drop_last`` the
incomplete final step is dropped, and its entries listed.
"""

from __future__ import annotations

import heapq

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig
from batchplan.errors import DatasetError
from batchplan.planning.epoch_batches import EpochBatches
from batchplan.planning.scheduled import Scheduled
from batchplan.planning.step_bounds import StepSizing, cut_steps

__all__ = ["complete_last_round", "drop_last_ramp_step", "drop_last_step"]


def complete_last_round(batches: EpochBatches, room, count: int, world_size: int):
    """Make the scheduled count a multiple of world_size: split micro-batches, then add empties.

    The schedule is ``room[:count]``; ``room`` holds ``world_size`` more, so the completed
    schedule is written in place. Returns the new schedule and the (no) entries dropped.
    """
    schedule = room[:count]
    full = count - count % world_size
    no_drop = np.zeros(0, dtype=np.int64)
    if full == count:
        return schedule, no_drop
    # The last round as (start, end, lengths): split the largest in two until every rank
    # has one, then add empties; appended to the micro-batches at once.
    last = schedule[full:]
    pieces = _split_largest(zip(*batches.bounds(last), batches.range_lengths(last)), world_size)
    tokens = [tokens for _, _, tokens in pieces] + [0] * (world_size - len(pieces))
    pairs = [(start, end) for start, end, _ in pieces] + [(0, 0)] * (world_size - len(pieces))
    last = batches.extend(np.array(pairs, dtype=np.int64).reshape(-1, 2), np.array(tokens, dtype=np.int64))
    completed = room[: full + world_size]
    completed[full:] = last
    return completed, no_drop


def _split_largest(last, world_size: int) -> list[tuple[int, int, int]]:
    """``(start, end, tokens)`` of the last round's micro-batches (``(start, end, lengths)``) once
    the one of most tokens that has two entries or more (the first made, among equals) is
    split in two, again and again, until there are ``world_size`` or none can be split; in
    the order they were made (a split one replaced by its halves at the end).
    O(world_size log world_size): a heap of (-tokens, order made)."""
    made = [(int(start), int(end), lengths, int(lengths.sum())) for start, end, lengths in last]
    heap = [(-tokens, i) for i, (start, end, _, tokens) in enumerate(made) if end - start > 1]
    heapq.heapify(heap)
    split, count = set(), len(made)
    while count < world_size and heap:
        _, i = heapq.heappop(heap)
        start, end, lengths, _ = made[i]
        split.add(i)
        cut = _halving_point(lengths)
        for piece in ((start, start + cut, lengths[:cut]), (start + cut, end, lengths[cut:])):
            made.append((*piece, int(piece[2].sum())))
            if piece[1] - piece[0] > 1:
                heapq.heappush(heap, (-made[-1][3], len(made) - 1))
        count += 1
    return [(start, end, tokens) for i, (start, end, _, tokens) in enumerate(made) if i not in split]


def _halving_point(lengths: NDArray[np.int32]) -> int:
    """Where to cut a micro-batch into a prefix and a suffix of about equal tokens (both non-empty)."""
    cumulative = np.cumsum(lengths)
    cut = int(np.searchsorted(cumulative, cumulative[-1] / 2))
    return min(max(cut, 1), lengths.shape[0] - 1)


def drop_last_step(batches: EpochBatches, schedule, config: PlanConfig, epoch: int):
    """Drop the micro-batches of an incomplete final step (``drop_last``).

    Incomplete: fewer than ``micro_batches`` per rank, or, with a token target, a last
    step that would still have taken another (average) round. Returns the kept schedule
    and the dropped entries.
    """
    world_size = config.world_size
    full = schedule.shape[0] - schedule.shape[0] % world_size
    per_step = config.micro_batches_per_step
    if per_step is not None:
        keep = full - full % (world_size * per_step)
    else:
        target = config.tokens_per_step
        assert target is not None  # steps are sized by tokens when not by micro-batches
        tokens = batches.tokens()[schedule[:full]]
        step_offsets = cut_steps(tokens, config, StepSizing(0, 0.0))
        keep = full
        if step_offsets.shape[0] > 1:
            last_step = int(tokens[step_offsets[-2] :].sum())
            next_round = tokens.sum() / max(1, full // world_size)
            if abs(last_step + next_round - target) < abs(last_step - target):
                keep = int(step_offsets[-2])
    _check_keeps_some(keep, schedule.shape[0], config, epoch)
    return schedule[:keep], batches.members_of(schedule[keep:])


def drop_last_ramp_step(batches: EpochBatches, at: Scheduled, step_offsets, config: PlanConfig, epoch: int, sizing):
    """``drop_last`` under a ramp-up, on the final steps over the whole rounds of the
    schedule: drop the partial round, and the last step if it is incomplete (see
    `_last_step_incomplete`). Returns how many to keep, their step offsets, the dropped entries."""
    tokens = at.tokens[: step_offsets[-1]]
    keep = int(step_offsets[-1])
    if step_offsets.shape[0] > 1 and _last_step_incomplete(tokens, step_offsets, config, sizing):
        keep, step_offsets = int(step_offsets[-2]), step_offsets[:-1]
    _check_keeps_some(keep, at.batch.shape[0], config, epoch)
    return keep, step_offsets, batches.members_of(at.batch[keep:])


def _last_step_incomplete(tokens, step_offsets, config: PlanConfig, sizing: StepSizing) -> bool:
    """Under a ramp-up, would the last step have taken another (average) round: fewer than
    ``micro_batches`` per rank once the ramp is over, or (during the ramp, or with a
    token target) further from its target than with one more round."""
    world_size = config.world_size
    begin = int(step_offsets[-2])
    rounds = (tokens.shape[0] - begin) // world_size
    per_step = config.micro_batches_per_step
    done = sizing.tokens_before + int(tokens[:begin].sum())
    assert config.rampup_tokens is not None  # under a ramp-up
    if per_step is not None and (done >= config.rampup_tokens or rounds >= per_step):
        return rounds < per_step
    last_step = int(tokens[begin:].sum())
    next_round = tokens.sum() / max(1, tokens.shape[0] // world_size)
    target = sizing.target(config, done)
    return abs(last_step + next_round - target) < abs(last_step - target)


def _check_keeps_some(keep: int, count: int, config: PlanConfig, epoch: int) -> None:
    if keep == 0:
        raise DatasetError(
            f"`drop_last=True` would drop all {count:,} micro-batches of epoch {epoch}: they do "
            f"not fill one step of {config.world_size} ranks; use fewer ranks or micro-batches per step, "
            "or leave `drop_last` off"
        )
