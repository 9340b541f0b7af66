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
- ``idle_ranks``: ranks whose micro-batches are all empty (more ranks than micro-batches to
  share): they only run zero-weight dummies.

A statistic with nothing to average (no regular step, no micro-batch) is None, not 0.

- ``mixture`` (a mixture's plans): per source, its weight, target, planned and trained tokens,
  passes, and its share of each step: mean and worst miss (`batchplan.reports.mixture`).

- ``rampup`` (plans built with a ramp-up, ``rampup_start``): tokens of the first step and of the ramp's
  last step, the first step past the ramp (``end_step``, None if the plan ends inside it),
  and the mean tokens per step after it.
- ``seqlen_warmup`` (plans built with ``seqlen_warmup_min``): the cap's range, the longest
  sequence of the first step, and the first step past the warmup.

A resharded plan (``batchplan reshard``) starts at step ``first_step`` and its epochs
before the resumed one are empty; the numbers cover the steps it holds.

The plan is read one (epoch, rank) record batch at a time (`scan_plan`): memory holds one
record batch, one epoch's sums per (step, rank) and a few numbers per step, never the whole
table. With ``histograms`` (the figure, `batchplan.reports.plot`) it adds up to four counts of
the integers 0..max_tokens and as many values waiting to be counted (8 MiB at most at
max_tokens 131,072), not numbers per micro-batch: the 60 M micro-batches of a 10⁹-sample plan
take no more than a small plan's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from numpy.typing import NDArray

from batchplan.errors import PlanFormatError
from batchplan.formats.opened_plan import OpenedPlan
from batchplan.formats.plan_rows import PlanRows
from batchplan.plan import PackingBound
from batchplan.reports.mixture import summarize_phases, summarize_sources
from batchplan.reports.statistics import imbalance_over_steps, last_steps_of, regular_steps, step_imbalance

__all__ = ["PlanScan", "scan_plan", "summarize_plan"]

_ZERO = np.int64(0)  # totals start as numpy int64, as the column sums added to them


@dataclasses.dataclass
class PlanScan:
    """What one pass over a plan's record batches gathers (`scan_plan`): a few numbers per
    step, totals, and with ``histograms`` the counts of per-micro-batch values.

    Steps count from the plan's first step. Totals are numpy int64, as the sums of the
    columns they come from.

    ``histograms`` maps a name to an int64 array of shape (max_tokens + 2,): entry ``v`` counts
    the micro-batches whose value is ``v``, the last entry those above max_tokens (only a
    corrupt plan has any; a value below 0 counts at 0). Its size is O(max_tokens) whatever the
    plan's size:
    - ``tokens``, ``padded``: tokens, padded tokens (`PlanRows.numbers`) of every micro-batch;
    - ``nonempty_tokens``: tokens of the non-empty micro-batches;
    - ``longest`` (pad plans): the longest sample (padded // samples) of the non-empty ones.
    """

    step_tokens: NDArray[np.float64]  # (num_steps,): tokens of each step, all ranks
    token_imbalance: NDArray[np.float64]  # (num_steps,): `statistics.step_imbalance` of the ranks' tokens
    cost_imbalance: NDArray[np.float64] | None  # the same of the ``cost`` column; None without one
    step_micro_batches: NDArray[np.int64]  # (num_steps,): micro-batches of each step, all ranks
    rank_nonempty: NDArray[np.int64]  # (world_size,): non-empty micro-batches of each rank
    micro_batches: int = 0
    empty_micro_batches: int = 0
    tokens: np.int64 = _ZERO
    loss_tokens: np.int64 = _ZERO
    padded_tokens: np.int64 = _ZERO
    regular_tokens: np.int64 = _ZERO  # over the regular steps (`statistics.regular_steps`)
    regular_micro_batches: int = 0
    first_step_longest: int | None = None  # the longest entry of the first step (plans with spans)
    histograms: dict[str, NDArray[np.int64]] | None = None  # counts of values 0..max_tokens (+ above): `histograms`


def scan_plan(plan: OpenedPlan, *, histograms: bool = False) -> PlanScan:
    """Per-step numbers and totals of ``plan``, read one (epoch, rank) record batch at a time;
    ``histograms`` also counts per-micro-batch values (`PlanScan.histograms`, O(max_tokens)).
    Beyond those, memory holds one record batch and one epoch's sums per (step, rank).

    Raises:
        PlanFormatError: a record batch holds steps outside its epoch (`batchplan validate`
            says more).
    """
    num_steps, world_size = plan.num_steps, plan.world_size
    summed = ("tokens", "cost") if "cost" in plan.schema.names else ("tokens",)
    scan = PlanScan(
        step_tokens=np.zeros(num_steps),
        token_imbalance=np.zeros(num_steps),
        cost_imbalance=np.zeros(num_steps) if "cost" in summed else None,
        step_micro_batches=np.zeros(num_steps, np.int64),
        rank_nonempty=np.zeros(world_size, np.int64),
    )
    counters = _histogram_counters(plan) if histograms else None
    regular = regular_steps(num_steps, last_steps_of(plan.metadata["steps_per_epoch"]))
    first_step = int(plan.metadata.get("first_step", 0))
    bounds = np.concatenate([[0], np.cumsum(plan.metadata["steps_per_epoch"], dtype=np.int64)])
    longest = []
    for epoch in range(plan.num_epochs):
        steps = slice(int(bounds[epoch]), int(bounds[epoch + 1]))
        # shape (world_size, steps of the epoch) each: sums per rank and step, rank-major as read
        sums = {name: np.zeros((world_size, steps.stop - steps.start)) for name in summed}
        for rank in range(world_size):
            rows = plan.rank_rows(epoch, rank)
            step = rows.numbers("step") - first_step
            if step.size and (step.min() < steps.start or step.max() >= steps.stop):
                raise PlanFormatError(
                    f"{plan.path}: epoch {epoch} rank {rank} holds steps outside the epoch's "
                    f"{first_step + steps.start:,}..{first_step + steps.stop - 1:,}; "
                    "run batchplan validate on it"
                )
            for name, per_rank in sums.items():  # each (step, rank) lies in this record batch alone
                per_rank[rank] = np.bincount(
                    step - steps.start, weights=rows.numbers(name), minlength=steps.stop - steps.start
                )
            scan.rank_nonempty[rank] += _add_rows(scan, rows, step, steps, regular, counters)
            if "lengths" in rows and steps.start == 0:
                longest.append(_first_step_longest(rows, step))
        _add_epoch(scan, sums, steps)
    if "lengths" in plan.schema.names and scan.micro_batches:
        scan.first_step_longest = max(longest, default=0)
    if counters is not None:
        scan.histograms = {name: counter.flush() for name, counter in counters.items()}
    return scan


def _add_epoch(scan: PlanScan, sums: dict[str, np.ndarray], steps: slice) -> None:
    """The per-step numbers of one epoch, from its sums per rank and step."""
    tokens = np.ascontiguousarray(sums["tokens"].T)  # shape (steps, world_size), as `statistics` takes it
    scan.step_tokens[steps] = tokens.sum(axis=1)
    scan.token_imbalance[steps] = step_imbalance(tokens)
    if scan.cost_imbalance is not None:
        scan.cost_imbalance[steps] = step_imbalance(np.ascontiguousarray(sums["cost"].T))


def _add_rows(scan: PlanScan, rows: PlanRows, step, steps: slice, regular, counters) -> int:
    """Add one (epoch, rank) record batch's counts and totals to ``scan``, and its values to
    ``counters`` (`_histogram_counters`, or None); its rows' ``step`` lie in ``steps``.
    Returns its non-empty micro-batches."""
    tokens = rows.numbers("tokens")
    padded = rows.numbers("padded_tokens")
    counts = rows.counts("samples")
    scan.step_micro_batches[steps] += np.bincount(step - steps.start, minlength=steps.stop - steps.start)
    scan.micro_batches += int(tokens.shape[0])
    scan.empty_micro_batches += int((counts == 0).sum())
    scan.tokens += tokens.sum()
    scan.loss_tokens += rows.numbers("loss_tokens").sum()
    scan.padded_tokens += padded.sum()
    in_regular = regular[step]
    scan.regular_tokens += tokens[in_regular].sum()
    scan.regular_micro_batches += int(in_regular.sum())
    if counters is not None:
        nonempty = counts > 0
        counters["tokens"].add(tokens)
        counters["padded"].add(padded)
        counters["nonempty_tokens"].add(tokens[nonempty])
        if "longest" in counters:  # pad: every sample of a micro-batch is padded to its longest
            counters["longest"].add(padded[nonempty] // counts[nonempty])
    return int((counts > 0).sum())


class _Counter:
    """Counts of the integers 0..top (above: at top + 1; below 0: at 0), added a record batch at
    a time. The values wait until there are as many as counts, then one `np.bincount` adds
    them: the cost is linear in the values however small the record batches, and memory holds
    at most top + 2 waiting values beyond the last record batch's."""

    def __init__(self, top: int) -> None:
        self.counts = np.zeros(top + 2, np.int64)
        self._waiting: list[np.ndarray] = []
        self._num_waiting = 0

    def add(self, values: np.ndarray) -> None:
        # clip copies: a view would keep the whole record batch alive while it waits
        self._waiting.append(np.clip(values, 0, self.counts.shape[0] - 1).astype(np.int64, copy=False))
        self._num_waiting += values.shape[0]
        if self._num_waiting >= self.counts.shape[0]:
            self.flush()

    def flush(self) -> NDArray[np.int64]:
        """Add the waiting values; returns the counts."""
        if self._waiting:
            values = np.concatenate(self._waiting)
            self.counts += np.bincount(values, minlength=self.counts.shape[0])
            self._waiting, self._num_waiting = [], 0
        return self.counts


def _histogram_counters(plan: OpenedPlan) -> dict[str, _Counter]:
    """One `_Counter` per `PlanScan.histograms` entry of ``plan``."""
    names = ["tokens", "padded", "nonempty_tokens"] + (["longest"] if plan.metadata["mode"] == "pad" else [])
    return {name: _Counter(int(plan.metadata["max_tokens"])) for name in names}


def _first_step_longest(rows: PlanRows, step) -> int:
    """The longest entry (``lengths``) of the rows of the plan's first step (0 if none)."""
    values = rows.entries("lengths")[np.repeat(step == 0, rows.counts("lengths"))]
    return int(values.max()) if values.size else 0


def summarize_plan(
    plan: OpenedPlan, *, scan: PlanScan | None = None, source_tokens: NDArray[np.int64] | None = None
) -> dict[str, Any]:
    """Key numbers of a plan as a JSON-able dict; ``scan`` is `scan_plan`'s and ``source_tokens``
    a mixture's `batchplan.reports.mixture.step_source_tokens`, when already made."""
    meta = plan.metadata
    scan = scan_plan(plan) if scan is None else scan
    world_size = plan.world_size
    first_step = int(meta.get("first_step", 0))
    num_steps = plan.num_steps
    last_steps = last_steps_of(meta["steps_per_epoch"])
    capacity = scan.regular_micro_batches * plan.metadata["max_tokens"]
    imbalance = imbalance_over_steps(scan.token_imbalance, last_steps)
    cost_imbalance = None if scan.cost_imbalance is None else imbalance_over_steps(scan.cost_imbalance, last_steps)
    step_tokens = scan.step_tokens
    # shape (num_steps,): tokens of the run before each step this plan holds
    tokens_before = int(meta.get("tokens_before_first_step", 0)) + np.cumsum(step_tokens) - step_tokens
    micro_per_step = scan.step_micro_batches // world_size
    # drop_last_spans: the pieces of the samples drop_last lists, not more samples
    dropped = {reason: v for reason, v in meta.get("dropped", {}).items() if reason != "drop_last_spans"}
    return {
        "num_samples": plan.num_samples,
        "num_epochs": plan.num_epochs,
        "num_steps": num_steps,
        "world_size": world_size,
        "mode": meta["mode"],
        "max_tokens": meta["max_tokens"],
        "micro_batches": scan.micro_batches,
        "empty_micro_batches": scan.empty_micro_batches,
        "tokens": int(scan.tokens),
        "loss_tokens": int(scan.loss_tokens),
        "idle_ranks": int((scan.rank_nonempty == 0).sum()),
        "fill": float(scan.regular_tokens / capacity) if capacity else None,
        "padding_fraction": _padding(scan),
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
        "seqlen_warmup": _seqlen_warmup(meta["config"], scan.first_step_longest, tokens_before, first_step),
        "first_step": first_step,
        "resharded_from": _parent(meta.get("resharded_from")),
        "dropped_samples": _count_dropped(dropped),
        "dropped": {reason: _count_dropped({reason: v}) for reason, v in dropped.items()},
        "mixture": summarize_sources(plan, source_tokens),
        "mixture_phases": summarize_phases(plan, source_tokens),
    }


def _imbalance_fields(name: str, imbalance) -> dict[str, float | None]:
    """``name``, ``name_p99``, ``name_max``, ``name_last_step`` (None without a value)."""
    stats = ("mean", "p99", "max", "last_step")
    keys = [name] + [f"{name}_{stat}" for stat in stats[1:]]
    return {key: None if imbalance is None else getattr(imbalance, stat) for key, stat in zip(keys, stats)}


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


def _seqlen_warmup(config: dict[str, Any], first_longest, tokens_before, first_step: int) -> dict[str, Any] | None:
    if config.get("seqlen_warmup_min") is None:
        return None
    end = np.flatnonzero(tokens_before >= config["seqlen_warmup_tokens"])
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


def _padding(scan: PlanScan) -> float | None:
    """Padded-away tokens / computed tokens; None without a micro-batch (0 in pack mode)."""
    if not scan.micro_batches:
        return None
    return float(1.0 - scan.tokens / scan.padded_tokens) if scan.padded_tokens else 0.0


def _spread(values: np.ndarray) -> dict[str, float | None]:
    if values.size == 0:
        return {"mean": None, "min": None, "max": None, "std": None}
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
