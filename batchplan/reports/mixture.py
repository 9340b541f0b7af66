"""Per-source numbers of a mixture's plan, for `batchplan inspect` (`summarize_plan`'s
``mixture``): each source's weight, target and planned tokens and passes (from the
metadata), and its share of every step's tokens (from the rows' ``source`` column): the mean
share over the regular steps (all but each epoch's last), and the worst miss, the largest
``|share - weight|`` over them, in percentage points, with the bound a step is held to
there, ``max(0.5 pp, max_tokens / the step's tokens)``.

Read one (epoch, rank) record batch at a time; memory holds one epoch's tokens per (step,
source).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from batchplan.formats.arrow import numpy_of
from batchplan.formats.plan_file import OpenedPlan

__all__ = ["summarize_sources"]


def summarize_sources(plan: OpenedPlan) -> list[dict[str, Any]] | None:
    """One dict per source of a mixture's plan, in the mixture's order; None for one dataset."""
    mixture = plan.metadata.get("mixture")
    if mixture is None:
        return None
    sources = mixture["sources"]
    weights = np.array([source["weight"] for source in sources], dtype=np.float64)
    tokens = np.zeros(len(sources), dtype=np.int64)
    share_sum = np.zeros(len(sources))
    worst = np.zeros(len(sources))
    worst_bound = np.zeros(len(sources))
    regular = 0
    first_step = int(plan.metadata.get("first_step", 0))
    for epoch, steps in enumerate(plan.metadata["steps_per_epoch"]):
        per_step = np.zeros((steps, len(sources)), dtype=np.int64)
        for rank in range(plan.world_size):
            batch = plan.read_rank(epoch, rank)
            source = numpy_of(batch.column("source"))
            held = source >= 0
            # shape (rows,): the epoch-local step of each micro-batch that holds samples
            step = numpy_of(batch.column("step"))[held] - first_step - _epoch_start(plan, epoch)
            np.add.at(per_step, (step, source[held]), numpy_of(batch.column("tokens"))[held])
        tokens += per_step.sum(axis=0)
        totals = per_step[:-1].sum(axis=1)  # each epoch's last step is not held to its shares
        held_steps = totals > 0
        shares = per_step[:-1][held_steps] / totals[held_steps, None]
        share_sum += shares.sum(axis=0)
        regular += int(held_steps.sum())
        if shares.shape[0]:
            misses = np.abs(shares - weights)
            at = misses.argmax(axis=0)
            better = misses[at, np.arange(len(sources))] > worst
            bound = np.maximum(0.005, plan.metadata["max_tokens"] / totals[held_steps][at])
            worst = np.where(better, misses[at, np.arange(len(sources))], worst)
            worst_bound = np.where(better, bound, worst_bound)
    return [
        {
            "name": source["name"],
            "weight": source["weight"],
            "target_tokens": source["target_tokens"],
            "planned_tokens": source["planned_tokens"],
            "tokens": int(tokens[index]),
            "passes": source["passes"],
            "mean_share": float(share_sum[index] / regular) if regular else None,
            "worst_miss": float(worst[index]) if regular else None,
            "worst_miss_bound": float(worst_bound[index]) if regular else None,
        }
        for index, source in enumerate(sources)
    ]


def _epoch_start(plan: OpenedPlan, epoch: int) -> int:
    """The step number (from the plan's first) at which ``epoch`` starts."""
    return int(sum(plan.metadata["steps_per_epoch"][:epoch]))
