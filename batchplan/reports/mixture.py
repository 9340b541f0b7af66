"""Per-source numbers of a mixture's plan, for `batchplan inspect` (`summarize_plan`'s
``mixture``): each source's weight, target and planned tokens and passes (from the
metadata), and its share of every step's tokens (from the rows' ``source`` column): the mean
share over the regular steps (all but each epoch's last), and the worst miss, the largest
``|share - weight|`` over them, in percentage points, with the bound a step is held to
there, ``max(0.5 pp, max_tokens / the step's tokens)``.

Read one (epoch, rank) record batch at a time; memory holds the tokens of every (step,
source), 8 bytes each (`step_source_tokens`, which the figure draws too).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from batchplan.formats.opened_plan import OpenedPlan

__all__ = ["step_source_tokens", "summarize_sources"]


def step_source_tokens(plan: OpenedPlan) -> NDArray[np.int64] | None:
    """Shape (steps, sources): the tokens of each source in each step of a mixture's plan (from
    its ``source`` column); None for one dataset."""
    mixture = plan.metadata.get("mixture")
    if mixture is None:
        return None
    first_step = int(plan.metadata.get("first_step", 0))
    per_step = np.zeros((plan.num_steps, len(mixture["sources"])), dtype=np.int64)
    for epoch in range(plan.num_epochs):
        for rank in range(plan.world_size):
            rows = plan.rank_rows(epoch, rank)
            source = rows.numbers("source")
            held = source >= 0
            step = rows.numbers("step")[held] - first_step
            np.add.at(per_step, (step, source[held]), rows.numbers("tokens")[held])
    return per_step


def summarize_sources(plan: OpenedPlan, per_step: NDArray[np.int64] | None = None) -> list[dict[str, Any]] | None:
    """One dict per source of a mixture's plan, in the mixture's order; None for one dataset.
    ``per_step``: `step_source_tokens`, when already read."""
    mixture = plan.metadata.get("mixture")
    if mixture is None:
        return None
    sources = mixture["sources"]
    per_step = step_source_tokens(plan) if per_step is None else per_step
    weights = np.array([source["weight"] for source in sources], dtype=np.float64)
    regular = np.ones(per_step.shape[0], dtype=bool)  # each epoch's last step is not held to its shares
    regular[np.cumsum(plan.metadata["steps_per_epoch"]) - 1] = False
    totals = per_step.sum(axis=1)
    regular &= totals > 0
    shares = per_step[regular] / totals[regular, None]
    misses = np.abs(shares - weights)
    rows = []
    for index, source in enumerate(sources):
        row = {
            "name": source["name"],
            "weight": source["weight"],
            "target_tokens": source["target_tokens"],
            "planned_tokens": source["planned_tokens"],
            "tokens": int(per_step[:, index].sum()),
            "passes": source["passes"],
            "mean_share": None, "worst_miss": None, "worst_miss_bound": None,
        }  # fmt: skip
        if shares.shape[0]:
            at = int(misses[:, index].argmax())
            row["mean_share"] = float(shares[:, index].mean())
            row["worst_miss"] = float(misses[at, index])
            row["worst_miss_bound"] = float(max(0.005, plan.metadata["max_tokens"] / totals[regular][at]))
        rows.append(row)
    return rows
