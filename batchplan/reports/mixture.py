"""Per-source numbers of a mixture's plan, for `batchplan inspect` (`summarize_plan`'s
``mixture``): each source's weight, target and planned tokens and passes (from the
metadata), and its share of every step's tokens (from the rows' ``source`` column): the mean
share over the regular steps (all but each epoch's last), and the worst miss, the largest
``|share - weight|`` over them, in percentage points, with the bound a step is held to
there, ``max(0.5 pp, max_tokens / the step's tokens)``; and the tokens ``drop_last`` drops of
it (its planned tokens less the plan's: `batchplan validate` checks that they add up). With
phases, a step's weight is its phase's (a step in which later phases begin: each phase's
weight of its tokens in that phase, `step_weights`), and `summarize_phases` gives each
phase's first step and tokens.

Read one (epoch, rank) record batch at a time; memory holds the tokens of every (step,
source), 8 bytes each (`step_source_tokens`, which the figure draws too).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from batchplan.formats.opened_plan import OpenedPlan

__all__ = ["step_source_tokens", "step_weights", "summarize_phases", "summarize_sources"]


def step_source_tokens(plan: OpenedPlan) -> NDArray[np.int64] | None:
    """Shape (steps, sources): the tokens of each source in each step of a mixture's plan (from
    its ``source`` column); None for one dataset."""
    mixture = plan.metadata.get("mixture")
    return None if mixture is None else _source_tokens(plan, mixture)


def _source_tokens(plan: OpenedPlan, mixture: dict[str, Any]) -> NDArray[np.int64]:
    """`step_source_tokens` of a mixture's plan (``mixture``: its metadata key)."""
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


def _phases(plan: OpenedPlan) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """``(from_tokens, weights)`` of a mixture's phases (one phase, its sources' weights, without)."""
    mixture = plan.metadata["mixture"]
    phases = mixture.get("phases") or [{"from_tokens": 0, "weights": [s["weight"] for s in mixture["sources"]]}]
    starts = np.array([phase["from_tokens"] for phase in phases], dtype=np.int64)
    return starts, np.array([phase["weights"] for phase in phases], dtype=np.float64).reshape(len(phases), -1)


def _tokens_before(plan: OpenedPlan, per_step: NDArray[np.int64]) -> NDArray[np.int64]:
    totals = per_step.sum(axis=1)
    return int(plan.metadata.get("tokens_before_first_step", 0)) + np.cumsum(totals) - totals


def step_weights(plan: OpenedPlan, per_step: NDArray[np.int64]) -> NDArray[np.float64]:
    """Shape (steps, sources): the share of each step's tokens each source is held to: its
    phase's weight, and in a step where later phases begin, each phase's weight over the
    step's tokens in that phase (a step of no tokens: its phase's weights)."""
    starts, weights = _phases(plan)
    totals = per_step.sum(axis=1)
    before = _tokens_before(plan, per_step)
    phase = np.searchsorted(starts, before, side="right") - 1
    held = weights[phase]
    ends = np.append(starts[1:], np.iinfo(np.int64).max)
    straddle = np.flatnonzero(before + totals > ends[phase])
    if straddle.shape[0]:
        blend = np.zeros((straddle.shape[0], weights.shape[1]), dtype=np.float64)
        first, last = before[straddle], before[straddle] + totals[straddle]
        for start, end, row in zip(starts, ends, weights):
            inside = np.maximum(np.minimum(last, end) - np.maximum(first, start), 0)
            blend += inside[:, None] * row[None, :]
        held[straddle] = blend / totals[straddle, None]
    return held


def summarize_phases(plan: OpenedPlan, per_step: NDArray[np.int64] | None = None) -> list[dict[str, Any]] | None:
    """One dict per phase of a mixture's plan (``from_tokens``, ``first_step``: the first step
    whose tokens before it reach it, None past the plan's last; ``weights`` by source name;
    ``tokens``: the plan's tokens in the phase's steps); None without phases."""
    mixture = plan.metadata.get("mixture")
    if mixture is None or not mixture.get("phases"):
        return None
    per_step = _source_tokens(plan, mixture) if per_step is None else per_step
    starts, weights = _phases(plan)
    before = _tokens_before(plan, per_step)
    totals = per_step.sum(axis=1)
    first = np.searchsorted(before, starts, side="left")  # the first step whose tokens before reach it
    bounds = np.append(first, before.shape[0])
    offset = int(plan.metadata.get("first_step", 0))
    names = [source["name"] for source in mixture["sources"]]
    return [
        {
            "from_tokens": int(start),
            "first_step": offset + int(first[index]) if first[index] < before.shape[0] else None,
            "weights": dict(zip(names, weights[index].tolist())),
            "tokens": int(totals[bounds[index] : bounds[index + 1]].sum()),
        }
        for index, start in enumerate(starts)
    ]


def summarize_sources(plan: OpenedPlan, per_step: NDArray[np.int64] | None = None) -> list[dict[str, Any]] | None:
    """One dict per source of a mixture's plan, in the mixture's order; None for one dataset.
    ``per_step``: `step_source_tokens`, when already read."""
    mixture = plan.metadata.get("mixture")
    if mixture is None:
        return None
    sources = mixture["sources"]
    per_step = _source_tokens(plan, mixture) if per_step is None else per_step
    # A resharded plan keeps its parent's sources' numbers: its planned tokens are not its own.
    own_numbers = "resharded_from" not in plan.metadata or "replanned" in mixture
    weights = step_weights(plan, per_step)
    regular = np.ones(per_step.shape[0], dtype=bool)  # each epoch's last step is not held to its shares
    regular[np.cumsum(plan.metadata["steps_per_epoch"]) - 1] = False
    totals = per_step.sum(axis=1)
    regular &= totals > 0
    shares = per_step[regular] / totals[regular, None]
    misses = np.abs(shares - weights[regular])
    rows = []
    for index, source in enumerate(sources):
        row = {
            "name": source["name"],
            "weight": source["weight"],
            "target_tokens": source["target_tokens"],
            "planned_tokens": source["planned_tokens"],
            "tokens": int(per_step[:, index].sum()),
            "passes": source["passes"],
            "mean_share": None,
            "worst_miss": None,
            "worst_miss_bound": None,
        }
        row["dropped_tokens"] = source["planned_tokens"] - row["tokens"] if own_numbers else None
        if shares.shape[0]:
            at = int(misses[:, index].argmax())
            row["mean_share"] = float(shares[:, index].mean())  # against the run's share when phases change it
            row["worst_miss"] = float(misses[at, index])
            row["worst_miss_bound"] = float(max(0.005, plan.metadata["max_tokens"] / totals[regular][at]))
        rows.append(row)
    return rows
