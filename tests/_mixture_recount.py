"""A mixture's plan counted again from its rows, the sources' offsets and the lengths the
test wrote (not from the planner's arrays, the ``source`` column or validate): tokens per
step and source, every use and when it comes (a use ``drop_last`` drops: after its epoch's
last step), the longest sequence of each step, and the tokens each sample's uses cover."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from batchplan.formats.opening import open_plan


@dataclasses.dataclass
class Recount:
    """A plan read back (module docstring)."""

    meta: dict
    per_step: np.ndarray  # shape (steps, sources): tokens
    epoch_of_step: np.ndarray
    rows_per_step: np.ndarray  # micro-batches of each step on one rank
    empty_rows: int  # micro-batches without samples
    longest: np.ndarray  # per step: the longest sequence (entry) it holds
    use_when: np.ndarray  # per use: its step, or its epoch's last step + 0.5 when dropped
    use_sample: np.ndarray
    dropped_tokens: np.ndarray  # per source: tokens of what drop_last drops
    covered: np.ndarray  # per sample: tokens of its entries, planned or dropped

    @property
    def bounds(self) -> np.ndarray:
        sources = self.meta["mixture"]["sources"]
        return np.array([s["offset"] for s in sources] + [sources[-1]["offset"] + sources[-1]["num_samples"]])

    def source_of(self, samples) -> np.ndarray:
        return np.searchsorted(self.bounds, samples, side="right") - 1

    def tokens_before(self) -> np.ndarray:
        totals = self.per_step.sum(axis=1)
        return self.meta.get("tokens_before_first_step", 0) + np.cumsum(totals) - totals


def recount(path: Path, lengths: np.ndarray) -> Recount:
    """``lengths``: every sample's, in the plan's global order (the sources' concatenated)."""
    plan = open_plan(path)
    meta = plan.metadata
    sources = meta["mixture"]["sources"]
    bounds = np.array([s["offset"] for s in sources] + [plan.num_samples])
    first_step = meta.get("first_step", 0)
    per_step = np.zeros((plan.num_steps, len(sources)), dtype=np.int64)
    rows_per_step = np.zeros(plan.num_steps, dtype=np.int64)
    longest = np.zeros(plan.num_steps, dtype=np.int64)
    covered = np.zeros(plan.num_samples, dtype=np.int64)
    when, samples, empty = [], [], 0
    for epoch in range(plan.num_epochs):
        for rank in range(plan.world_size):
            for row in plan.read_rank(epoch, rank).to_pylist():
                step = row["step"] - first_step
                if rank == 0:
                    rows_per_step[step] += 1
                if not row["samples"]:
                    empty += 1
                    continue
                owners = set(np.searchsorted(bounds, row["samples"], side="right") - 1)
                assert len(owners) == 1, "a micro-batch holds two sources"
                per_step[step, owners.pop()] += row["tokens"]
                starts = row.get("starts") or [0] * len(row["samples"])
                spans = row.get("lengths") or [int(lengths[s]) for s in row["samples"]]
                longest[step] = max(longest[step], max(spans))
                np.add.at(covered, row["samples"], spans)
                for sample, start in zip(row["samples"], starts):
                    if start == 0:
                        when.append(float(step))
                        samples.append(sample)
    epoch_of_step = np.repeat(np.arange(plan.num_epochs), meta["steps_per_epoch"])
    dropped_tokens = np.zeros(len(sources), dtype=np.int64)
    last_steps = np.cumsum(meta["steps_per_epoch"]) - 1
    for epoch, pieces in _dropped_pieces(meta, lengths).items():
        for sample, start, length in pieces:
            dropped_tokens[np.searchsorted(bounds, sample, side="right") - 1] += length
            covered[sample] += length
            if start == 0:
                when.append(last_steps[epoch] + 0.5)
                samples.append(sample)
    return Recount(
        meta,
        per_step,
        epoch_of_step,
        rows_per_step,
        empty,
        longest,
        np.array(when),
        np.array(samples, dtype=np.int64),
        dropped_tokens,
        covered,
    )


def _dropped_pieces(meta: dict, lengths: np.ndarray) -> dict[int, list[tuple[int, int, int]]]:
    """Per epoch, what drop_last drops: ``(sample, start, tokens)`` of each dropped entry."""
    dropped = meta["dropped"]
    if meta["has_spans"]:
        return {int(e): [tuple(piece) for piece in pieces] for e, pieces in dropped.get("drop_last_spans", {}).items()}
    return {int(e): [(s, 0, int(lengths[s])) for s in samples] for e, samples in dropped.get("drop_last", {}).items()}


def assert_repetition_in_order(counted: Recount) -> None:
    """Within a source, every sample is used floor or ceil of the passes' times (dropped uses
    counted), and no sample's (k+1)-th use comes before the last k-th use of another."""
    for source in counted.meta["mixture"]["sources"]:
        lo, hi = source["offset"], source["offset"] + source["num_samples"]
        mine = (counted.use_sample >= lo) & (counted.use_sample < hi)
        when, samples = counted.use_when[mine], counted.use_sample[mine]
        order = np.argsort(when, kind="stable")
        seen: dict[int, int] = {}
        nth = np.empty(order.shape[0], dtype=np.int64)
        for position in order:
            nth[position] = seen.get(int(samples[position]), 0)
            seen[int(samples[position])] = nth[position] + 1
        counts = np.bincount(samples - lo, minlength=hi - lo)
        assert not counts.size or counts.max() - counts.min() <= 1, source["name"]
        for k in range(int(nth.max(initial=0))):
            assert when[nth == k + 1].min() >= when[nth == k].max(), (source["name"], k)


def assert_planned_tokens_add_up(counted: Recount) -> None:
    """Each source's planned tokens are what the plan trains of it and what drop_last drops."""
    for index, source in enumerate(counted.meta["mixture"]["sources"]):
        assert counted.per_step[:, index].sum() + counted.dropped_tokens[index] == source["planned_tokens"]


def assert_shares_hold(counted: Recount, due: np.ndarray) -> None:
    """Every step but each epoch's last holds each source within max(0.5 %, max_tokens) of
    what it is due (``due``: shape (steps, sources))."""
    totals = counted.per_step.sum(axis=1)
    last = np.append(counted.epoch_of_step[1:] != counted.epoch_of_step[:-1], True)
    allowed = np.maximum(0.005 * totals, counted.meta["max_tokens"])
    off = (np.abs(counted.per_step - due) > allowed[:, None] + 1e-6) & ~last[:, None]
    assert not off.any(), np.argwhere(off)[:3]


def warmup_cap(tokens_done: int, low: int, span: int, max_tokens: int) -> int:
    """The sequence-length warmup's cap after ``tokens_done`` tokens of the run."""
    return max_tokens if tokens_done >= span else low + (max_tokens - low) * tokens_done // span


def assert_warmup_caps_hold(counted: Recount) -> None:
    """No step holds a sequence longer than the warmup's cap when the step ends."""
    config = counted.meta["config"]
    ends = counted.tokens_before() + counted.per_step.sum(axis=1)
    caps = [
        warmup_cap(int(end), config["seqlen_warmup_min"], config["seqlen_warmup_tokens"], config["max_tokens"])
        for end in ends
    ]
    assert (counted.longest <= np.array(caps)).all(), np.flatnonzero(counted.longest > np.array(caps))[:3]
