"""Summary statistics of a plan, for `batchplan inspect` and for library users.

All numbers come from the plan file alone (no dataset needed); each statistic is
defined once, in `batchplan.reports.statistics`:
- ``fill``: real tokens / (micro-batches x max_tokens) over the regular steps (all
  but each epoch's last): packing efficiency.
- ``packing`` (pack plans): the micro-batches as packed, summed over epochs (before each
  epoch's end is completed or dropped), against the lower bound on any packing of the same
  entries (`batchplan.planning.cutting_stock`): ``fill`` = tokens / (micro-batches x
  max_tokens) and ``bound_fill`` = tokens / (bound x max_tokens), the most any packing
  reaches; ``kind`` says which bound (``lp``, ``l2``, ``volume``).
- ``padding_fraction``: padding / (count x longest) over all micro-batches (pad mode;
  0 in pack mode).
- ``token_imbalance`` / ``_p99`` / ``_max``: mean, p99 and max over the regular steps
  of (max rank tokens / mean rank tokens - 1); ``token_imbalance_last_step``: the
  same for each epoch's last step (completed by splitting and empty micro-batches,
  imbalanced by design), averaged over epochs.
- ``cost_imbalance`` (``_p99``, ``_max``, ``_last_step``): the same over the plan's predicted
  compute (``cost`` column, plans built with a hidden size; None otherwise).

- ``rampup`` (plans built with ``--rampup``): tokens of the first step and of the ramp's
  last step, the first step past the ramp (``end_step``, None if the plan ends inside it),
  and the mean tokens per step after it.
- ``seqlen_warmup`` (plans built with ``--seqlen-warmup``): the cap's range, the longest
  sequence of the first step, and the first step past the warmup.

A resharded plan (``batchplan reshard``) starts at step ``first_step`` and its epochs
before the resumed one are empty; the numbers cover the steps it holds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from batchplan.formats.plan_file import PlanFile, padded_tokens_column
from batchplan.plan import PackingBound
from batchplan.reports.statistics import last_steps_of, rank_imbalance, regular_steps

__all__ = ["per_step_and_rank", "samples_per_row", "summarize_plan"]


def _imbalance_fields(name: str, imbalance) -> dict[str, float | None]:
    """``name``, ``name_p99``, ``name_max``, ``name_last_step`` (None without a value)."""
    stats = ("mean", "p99", "max", "last_step")
    keys = [name] + [f"{name}_{stat}" for stat in stats[1:]]
    return {key: None if imbalance is None else getattr(imbalance, stat) for key, stat in zip(keys, stats)}


def summarize_plan(plan: PlanFile) -> dict[str, Any]:
    """Key numbers of a plan as a JSON-able dict."""
    meta = plan.metadata
    table = plan.read_all()
    world_size = plan.world_size
    first_step = int(meta.get("first_step", 0))
    step = table.column("step").to_numpy() - first_step  # 0-based over the steps this plan holds
    rank = table.column("rank").to_numpy()
    tokens = table.column("tokens").to_numpy()
    padded = padded_tokens_column(table).to_numpy()
    counts = samples_per_row(table)
    num_steps = plan.num_steps

    last_steps = last_steps_of(meta["steps_per_epoch"])
    not_last = regular_steps(num_steps, last_steps)[step]  # per micro-batch
    capacity = int(not_last.sum()) * plan.metadata["max_tokens"]
    # shape (num_steps, world_size): tokens of each rank in each step
    rank_tokens = per_step_and_rank(step, rank, tokens, num_steps, world_size)
    imbalance = rank_imbalance(rank_tokens, last_steps)
    cost_imbalance = None
    if "cost" in table.column_names:
        rank_cost = per_step_and_rank(step, rank, table.column("cost").to_numpy(), num_steps, world_size)
        cost_imbalance = rank_imbalance(rank_cost, last_steps)
    step_tokens = rank_tokens.sum(axis=1)
    # shape (num_steps,): tokens of the run before each step this plan holds
    tokens_before = int(meta.get("tokens_before_first_step", 0)) + np.cumsum(step_tokens) - step_tokens
    micro_per_step = np.bincount(step, minlength=num_steps) // world_size
    dropped = meta.get("dropped", {})
    return {
        "num_samples": plan.num_samples,
        "num_epochs": plan.num_epochs,
        "num_steps": num_steps,
        "world_size": world_size,
        "mode": meta["mode"],
        "max_tokens": meta["max_tokens"],
        "micro_batches": int(tokens.shape[0]),
        "empty_micro_batches": int((counts == 0).sum()),
        "tokens": int(tokens.sum()),
        "loss_tokens": int(table.column("loss_tokens").to_numpy().sum()),
        "fill": float(tokens[not_last].sum() / capacity) if capacity else 0.0,
        "padding_fraction": float(1.0 - tokens.sum() / padded.sum()) if padded.sum() else 0.0,
        **_imbalance_fields("token_imbalance", imbalance),
        **_imbalance_fields("cost_imbalance", cost_imbalance),
        "hidden_size": meta.get("hidden_size"),
        "attention_coefficient": meta.get("attention_coefficient"),
        "balance": meta["config"].get("balance", "tokens"),
        "tokens_per_step": _spread(step_tokens),
        "micro_batches_per_rank_per_step": _spread(micro_per_step),
        "steps_per_epoch": meta["steps_per_epoch"],
        "packing": _packing(meta),
        "rampup": _rampup(meta["config"], step_tokens.astype(np.int64), tokens_before, first_step),
        "seqlen_warmup": _seqlen_warmup(meta["config"], table, step, tokens_before, first_step),
        "first_step": first_step,
        "resharded_from": _parent(meta.get("resharded_from")),
        "dropped_samples": _count_dropped(dropped),
        "dropped": {reason: _count_dropped({reason: v}) for reason, v in dropped.items()},
    }


def _rampup(config: dict[str, Any], step_tokens, tokens_before, first_step: int) -> dict[str, Any] | None:
    if config.get("rampup_start") is None:
        return None
    inside = tokens_before < config["rampup_tokens"]
    after = step_tokens[~inside]
    end = np.flatnonzero(~inside)
    return {
        "start_tokens": config["rampup_start"],
        "ramp_tokens": config["rampup_tokens"],
        "target": config.get("tokens_per_step"),
        "micro_batches": config.get("micro_batches"),
        "steps_in_ramp": int(inside.sum()),
        "first_step_tokens": int(step_tokens[0]) if step_tokens.size else 0,
        "last_ramp_step_tokens": int(step_tokens[inside][-1]) if inside.any() else None,
        "end_step": first_step + int(end[0]) if end.size else None,
        "tokens_per_step_after": float(after.mean()) if after.size else None,
    }


def _seqlen_warmup(config: dict[str, Any], table, step, tokens_before, first_step: int) -> dict[str, Any] | None:
    if config.get("seqlen_warmup_min") is None:
        return None
    end = np.flatnonzero(tokens_before >= config["seqlen_warmup_tokens"])
    first_longest = None
    if "lengths" in table.column_names and step.size:
        rows = np.flatnonzero(step == 0)
        lengths = table.column("lengths").take(rows).combine_chunks().values.to_numpy()
        first_longest = int(lengths.max()) if lengths.size else 0
    return {
        "min_tokens": config["seqlen_warmup_min"],
        "max_tokens": config["max_tokens"],
        "warmup_tokens": config["seqlen_warmup_tokens"],
        "first_step_longest": first_longest,
        "end_step": first_step + int(end[0]) if end.size else None,
    }


def _parent(parent: dict[str, Any] | None) -> dict[str, Any] | None:
    if not parent:
        return None
    return {key: parent.get(key) for key in ("content_hash", "world_size", "from_step", "epoch")}


def per_step_and_rank(step, rank, values, num_steps: int, world_size: int) -> np.ndarray:
    """Sums of the rows' ``values`` per (step, rank): float64, shape (num_steps, world_size).
    ``step`` counts from the plan's first step. Binned by ``rank x num_steps + step``: rows
    come rank by rank, steps in order, so the bins are written in order rather than at a
    stride of world_size (a cache miss per row)."""
    sums = np.bincount(rank.astype(np.int64) * num_steps + step, weights=values, minlength=num_steps * world_size)
    return np.ascontiguousarray(sums.reshape(world_size, num_steps).T)


def samples_per_row(table) -> np.ndarray:
    """Entries in each row's ``samples`` list, chunk by chunk (no combined copy of the lists)."""
    counts = [np.diff(chunk.offsets.to_numpy()) for chunk in table.column("samples").chunks]
    return np.concatenate(counts) if counts else np.zeros(0, dtype=np.int32)


def _spread(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {"mean": 0.0, "min": 0, "max": 0, "std": 0.0}
    return {
        "mean": float(values.mean()),
        "min": int(values.min()),
        "max": int(values.max()),
        "std": float(values.std()),
    }


def _packing(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The epochs' packings against their bound (`summarize_plan`), over the epochs that
    record one (a resharded plan's own epochs do not)."""
    epochs = [PackingBound(**p) for p in meta.get("packing") or [] if p is not None]
    if not epochs:
        return None
    total = sum(epochs[1:], epochs[0])
    return {
        "micro_batches": total.micro_batches,
        "bound": total.bound,
        "kind": total.kind,
        "fill": total.fill(meta["max_tokens"]),
        "bound_fill": total.bound_fill(meta["max_tokens"]),
        "epochs": len(epochs),
    }


def _count_dropped(dropped: dict[str, Any]) -> int:
    total = 0
    for value in dropped.values():
        if isinstance(value, dict):  # drop_last: epoch -> samples
            total += sum(len(samples) for samples in value.values())
        else:
            total += len(value)
    return total
