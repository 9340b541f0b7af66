"""Reshard of a mixture's plan (`batchplan.operations.reshard`): each parent step dealt whole
to the new ranks, and what the new plan records of the run before its first step.

A parent step of ``n`` micro-batches becomes one step of ``ceil(n / W2)`` micro-batches per
rank: its micro-batches, then empty ones, placed on ranks largest cost first
(`batchplan.kernels.balance.assign_step`, as a build places a mixture's composed step). The
steps' tokens, per-source tokens and uses are the parent's, step by step, and what its
epochs' ``drop_last`` dropped stays dropped (listed again, a sample once per dropped use).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig
from batchplan.errors import PlanFormatError
from batchplan.formats.bitmap import decode_bitmap, encode_bitmap
from batchplan.formats.opened_plan import OpenedPlan
from batchplan.operations.mixture_checks import dropped_uses
from batchplan.operations.parent_rows import ParentRows, always_dropped
from batchplan.plan import Entries, EpochPlan, index_dtype
from batchplan.planning.epoch_batches import EpochBatches
from batchplan.planning.schedule import schedule_epoch

__all__ = ["deal_steps", "mixture_consumed"]


def deal_steps(part: ParentRows, config: PlanConfig, epoch: int, tokens_before: int) -> EpochPlan:
    """Schedule one epoch's parent micro-batches (``part``, in (step, rank, micro) order, none
    empty) step by step for ``config.world_size`` ranks: entry ``i`` stands for row ``i`` of
    ``part``; the empty micro-batches that complete a step hold no entry."""
    count, world_size = part.num_rows, config.world_size
    _, first, per_step = np.unique(part.step, return_index=True, return_counts=True)
    room = -(-per_step // world_size) * world_size  # each step's micro-batches and empty ones
    step_offsets = np.zeros(room.shape[0] + 1, dtype=np.int64)
    np.cumsum(room, out=step_offsets[1:])
    step_of_row = np.repeat(np.arange(per_step.shape[0]), per_step)
    total = int(step_offsets[-1])
    held = np.zeros(total, dtype=np.int64)  # 1 where a parent micro-batch goes, 0 for an empty one
    held[step_offsets[step_of_row] + np.arange(count) - first[step_of_row]] = 1
    starts = np.cumsum(held) - held  # micro-batch k holds entries starts[k]:starts[k] + held[k]
    ends = starts + held
    length = part.tokens.astype(np.int32)
    entries = Entries(sample=np.arange(count), length=length, loss_tokens=part.loss_tokens.astype(np.int32), dropped={})
    batches = EpochBatches.of_ranges(np.arange(count, dtype=index_dtype(count)), length, starts, ends)
    costs = None
    if part.cost is not None:
        costs = np.zeros(total, dtype=np.float64)
        costs[held == 1] = part.cost
    return schedule_epoch(
        entries,
        batches,
        config,
        epoch,
        tokens_before=tokens_before,
        costs=costs,
        steps=step_offsets,
        order=np.arange(total, dtype=np.int64),
    )


def mixture_consumed(
    plan: OpenedPlan, before: ParentRows, epoch: int, from_step: int, earlier: list[ParentRows]
) -> dict[str, Any]:
    """``consumed`` of a mixture's plan resharded at ``from_step`` (module docstring of
    `batchplan.operations.reshard`).

    Args:
        plan: the parent.
        before: the parent's rows of ``epoch`` before ``from_step``.
        epoch: the resumed epoch.
        from_step: where the new plan starts.
        earlier: the parent's rows of the epochs before ``epoch``.
    """
    sources = plan.metadata["mixture"]["sources"]
    inherited = (plan.metadata.get("consumed") or {}).get("mixture")
    used = np.zeros(plan.num_samples, dtype=bool)
    used[before.sample] = True
    steps = int(np.unique(before.step).shape[0])
    tokens = np.zeros(len(sources), dtype=np.int64)
    assert before.source is not None  # a mixture's rows say their source
    np.add.at(tokens, before.source.astype(np.int64), before.tokens)
    uses = np.zeros(plan.num_samples, dtype=np.int64)
    if inherited is not None:
        if plan.metadata["consumed"]["epoch"] == epoch:
            used |= decode_bitmap(plan.metadata["consumed"]["samples"], plan.num_samples)
            steps += int(inherited["steps"])
            tokens += np.asarray(inherited["source_tokens"], dtype=np.int64)
        uses += _inherited_uses(plan, inherited, sources)
    for rows in [*earlier, before]:
        counted = rows.sample if rows.start is None else rows.sample[rows.start == 0]  # a split sample: once
        uses += np.bincount(counted, minlength=plan.num_samples)
    for earlier_epoch in range(epoch):  # what drop_last dropped at their ends was consumed too
        uses += np.bincount(dropped_uses(plan.metadata, earlier_epoch), minlength=plan.num_samples)
    base, more = _uses_as_base_and_bitmap(plan, uses, sources, from_step)
    record = {"steps": steps, "source_tokens": tokens.tolist(), "uses_base": base, "uses_more": encode_bitmap(more)}
    return {"epoch": epoch, "samples": encode_bitmap(used), "spans": [], "mixture": record}


def _inherited_uses(plan: OpenedPlan, inherited: dict[str, Any], sources) -> NDArray[np.int64]:
    """Each sample's uses before the parent's own first step (a chain of reshards)."""
    uses = decode_bitmap(inherited["uses_more"], plan.num_samples).astype(np.int64)
    for source, base in zip(sources, inherited["uses_base"]):
        uses[source["offset"] : source["offset"] + source["num_samples"]] += int(base)
    return uses


def _uses_as_base_and_bitmap(plan: OpenedPlan, uses: NDArray[np.int64], sources, from_step: int):
    """Per source the fewest uses of a kept sample (``uses_base``), and which samples have one
    more (``uses_more``): the repetition guarantee allows no other spread at a step's start."""
    kept = np.ones(plan.num_samples, dtype=bool)
    for samples in always_dropped(plan).values():
        kept[samples] = False
    base, more = [], np.zeros(plan.num_samples, dtype=bool)
    for source in sources:
        part = slice(source["offset"], source["offset"] + source["num_samples"])
        mine = uses[part][kept[part]]
        low = int(mine.min()) if mine.size else 0
        if mine.size and int(mine.max()) - low > 1:
            raise PlanFormatError(
                f"{plan.path}: before step {from_step:,} source {source['name']!r} has samples used from {low} to "
                f"{int(mine.max())} times, which its repetition guarantee rules out; run `batchplan validate` on it"
            )
        base.append(low)
        more[part] = kept[part] & (uses[part] > low)
    return base, more
