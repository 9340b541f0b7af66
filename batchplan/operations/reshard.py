"""Reshard: re-plan what a run has not trained yet for another number of ranks.

A run planned for ``W`` ranks that must continue on ``W2`` (a node lost or added)
from global step ``S`` gets a new plan:

1. The parent's micro-batches from step ``S`` on (the rest of ``S``'s epoch, then
   every later epoch) are read back from the file with their samples, spans and
   counts. A micro-batch does not depend on the world size (packs and padded batches
   are formed before ranks are assigned), so each is kept whole, as one unit; empty
   fillers are discarded. In pack mode the micro-batches of each epoch's last step,
   which the parent split so that every rank had one, are packed again (the
   planner's best fit decreasing within ``max_tokens``; counts and costs are sums of the pieces').
2. Each epoch's micro-batches are scheduled again for ``W2`` ranks by
   `batchplan.planning.schedule.schedule_epoch`: seeded shuffle, an incomplete last round
   completed with empty micro-batches (units are never split) or dropped under
   ``drop_last``, balanced steps, rank assignment. Each unit is balanced by its
   micro-batch's exact ``cost`` (the parent's column), so ``balance=compute`` keeps
   ranks as balanced as a fresh build for the new world size.
3. Steps are numbered on from ``S`` and ``tokens_before_step`` runs on from the
   parent's count at ``S``. Epochs before ``S``'s stay in the file with no rows, so
   a rank still reads record batch ``epoch * W2 + rank``.

Step size: explicit ``micro_batches`` or ``tokens_per_step``; by default as close to
the parent's global step as ``W2`` ranks allow. A token target is kept (it does not
depend on ranks; ``M2 = 1`` if one micro-batch per rank already exceeds it). ``M``
micro-batches per rank become ``M2 = max(1, round(W * M / W2))``: the same global
step when ``W2`` divides ``W * M``, else the nearest whole number of micro-batches per
rank (4 ranks x 1 -> 3 ranks x 1 is 25 % fewer tokens per step). A token target equal
to the parent's mean step would not do better: a step is a whole number of rounds of
``W2`` micro-batches, and the target picks that same nearest number, only with more
variation between steps.

Guarantees (checked by `batchplan.operations.validate` through the metadata written with the
plan, ``resharded_from``/``consumed``): what the parent trained before ``S`` plus
what the new plan holds from ``S`` is every sample of every epoch exactly once
(split samples: the pieces tile it), except what a policy dropped, which is listed;
every DESIGN.md guarantee holds for the new plan; same parent and options give a
byte-identical file. With ``drop_last`` what the parent dropped stays dropped, and a
new plan drops at most one more incomplete step per epoch (all of the resumed
epoch's rest when it does not fill one step of ``W2`` ranks).

Cost: one pass over the parent's rows, then O(micro-batches) per epoch: 0.4 s for the
1 M-sample Wikipedia plan (8 ranks, 2 epochs, 250 k micro-batches) resharded to 6.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from batchplan.formats.bitmap import decode_bitmap, encode_bitmap
from batchplan.config import PlanConfig
from batchplan.plan import Entries, EpochPlan, Plan, index_dtype
from batchplan.errors import ConfigError
from batchplan.kernels.pack import pack_segments
from batchplan.formats.plan_file import PlanFile, open_plan, padded_tokens_column
from batchplan.formats.plan_writer import write_plan
from batchplan.planning.micro_batches import MicroBatches
from batchplan.planning.schedule import schedule_epoch

__all__ = ["ReshardedPlan", "default_step_sizing", "reshard_plan", "reshard_plan_file"]


@dataclasses.dataclass(frozen=True)
class ReshardedPlan:
    """A plan continuing another one from a step, and what its file records about that.

    Attributes:
        plan: the new plan. Epochs before ``lineage["resharded_from"]["epoch"]`` have no
            rows; epoch-local steps are numbered on from ``first_step`` when written.
            ``plan.entries`` says which sample (and span) each entry is; their
            ``length``/``loss_tokens`` are exact for plans with spans, and 0 otherwise
            (a plan without spans records only each micro-batch's totals, which the
            epochs' per-row counts carry exactly).
        lineage: metadata keys merged into the file (`write_plan` ``lineage=``):
            ``first_step``, ``tokens_before_first_step``, ``resharded_from``,
            ``consumed``, ``num_entries``. See docs/plan-format.md.
        dataset, lengths_fingerprint: the parent's, stored again.
    """

    plan: Plan
    lineage: dict[str, Any]
    dataset: dict[str, Any] | None
    lengths_fingerprint: str | None

    @property
    def first_step(self) -> int:
        return int(self.lineage["first_step"])

    def write(self, path: str | os.PathLike) -> dict[str, Any]:
        """Write the plan atomically; return its metadata."""
        return write_plan(
            self.plan, path, dataset=self.dataset, lengths_fingerprint=self.lengths_fingerprint, lineage=self.lineage
        )


def reshard_plan_file(
    plan_path: str | os.PathLike,
    output: str | os.PathLike,
    *,
    world_size: int,
    from_step: int,
    micro_batches: int | None = None,
    tokens_per_step: int | None = None,
) -> dict[str, Any]:
    """Open and verify a plan, reshard it (`reshard_plan`), write the result; return its metadata."""
    plan_path, output = Path(plan_path), Path(output)
    if output.resolve() == plan_path.resolve():
        raise ConfigError(
            f"output {output} is the plan being resharded; write the new plan to another file "
            "(keep the parent: the new plan resumes from the parent's sampler states)"
        )
    if not output.parent.is_dir():
        raise ConfigError(f"output directory {output.parent} does not exist; create it or choose another -o")
    parent = open_plan(plan_path)
    parent.verify()
    resharded = reshard_plan(
        parent, world_size=world_size, from_step=from_step, micro_batches=micro_batches, tokens_per_step=tokens_per_step
    )
    return resharded.write(output)


def reshard_plan(
    plan: PlanFile,
    *,
    world_size: int,
    from_step: int,
    micro_batches: int | None = None,
    tokens_per_step: int | None = None,
) -> ReshardedPlan:
    """Re-plan the micro-batches of ``plan`` not trained at global step ``from_step`` for ``world_size`` ranks.

    Args:
        plan: the parent plan (the one the run trained on until ``from_step``).
        world_size: ranks of the continued run.
        from_step: the first global step the new plan holds: the optimizer steps done
            when the checkpoint to resume from was saved.
        micro_batches: micro-batches per rank per step; default: see the module docstring.
        tokens_per_step: global token target per step instead.

    Raises:
        ConfigError: ``from_step`` is not a step of the plan; an invalid size; with
            ``drop_last``, a whole later epoch does not fill one step of ``world_size`` ranks.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"--world-size must be an integer >= 1, got {world_size!r}")
    epoch, position, tokens_before = _locate_step(plan, from_step)
    sizing = {"micro_batches": micro_batches, "tokens_per_step": tokens_per_step}
    if micro_batches is None and tokens_per_step is None:
        sizing = default_step_sizing(plan, world_size)
    config = PlanConfig.from_dict({**plan.metadata["config"], "world_size": world_size, **sizing})
    rows = [_read_epoch(plan, k) for k in range(epoch, plan.num_epochs)]
    consumed = _consumed(plan, rows[0], from_step, epoch)
    rows[0] = rows[0].take(np.flatnonzero(rows[0].step >= from_step))
    if config.mode == "pack":
        rows = [_merge_epoch_end(part, config.max_tokens) for part in rows]
    drops = [_parent_drops(plan, k) for k in range(epoch, plan.num_epochs)]
    entries, entry_ids, drop_ids = _index_entries(plan, rows, drops)
    epochs = [_empty_epoch(k, config, np.zeros(0, np.int64)) for k in range(epoch)]
    for k, (part, ids, dropped) in enumerate(zip(rows, entry_ids, drop_ids), start=epoch):
        epochs.append(_schedule(part, ids, dropped, config, k, resumed=k == epoch))
    lineage = {
        "first_step": from_step,
        "tokens_before_first_step": tokens_before,
        "num_entries": plan.metadata.get("num_entries", entries.num_entries),
        "resharded_from": _parent_record(plan, from_step, epoch, position),
        "consumed": consumed,
    }
    new_plan = Plan(config=config, num_samples=plan.num_samples, entries=entries, epochs=tuple(epochs))
    meta = plan.metadata
    return ReshardedPlan(new_plan, lineage, meta.get("dataset"), meta.get("lengths_fingerprint"))


def default_step_sizing(plan: PlanFile, world_size: int) -> dict[str, int | None]:
    """``{"micro_batches": M2, "tokens_per_step": T2}`` (one of them None) that keeps the
    parent's global step for ``world_size`` ranks (rules in the module docstring)."""
    config = plan.metadata["config"]
    smallest = world_size * int(config["max_tokens"])  # one micro-batch per rank
    if config.get("tokens_per_step") is not None:
        target = int(config["tokens_per_step"])
        return {"micro_batches": None, "tokens_per_step": target} if target >= smallest else _fixed(1)
    count = plan.world_size * int(config.get("micro_batches") or 1)
    return _fixed(max(1, (2 * count + world_size) // (2 * world_size)))  # round half up


def _fixed(per_rank: int) -> dict[str, int | None]:
    return {"micro_batches": per_rank, "tokens_per_step": None}


def _locate_step(plan: PlanFile, from_step: int) -> tuple[int, int, int]:
    """``(epoch, position, tokens_before_step)`` of global step ``from_step`` in the parent:
    its epoch, the micro-batches each rank ran in that epoch before it, the tokens before it."""
    first = int(plan.metadata.get("first_step", 0))
    end = first + plan.num_steps
    if isinstance(from_step, bool) or not isinstance(from_step, int) or not first <= from_step < end:
        raise ConfigError(
            f"--from-step {from_step!r} is not a step of {plan.path}, which holds steps {first:,}..{end - 1:,}; "
            "pass the optimizer steps done at the checkpoint you resume from"
        )
    ends = first + np.cumsum(plan.metadata["steps_per_epoch"])
    epoch = int(np.searchsorted(ends, from_step, side="right"))
    rows = plan.read_rank(epoch, 0)
    step = rows.column("step").to_numpy()
    position = int(np.count_nonzero(step < from_step))
    return epoch, position, int(rows.column("tokens_before_step").to_numpy()[position])


def _parent_record(plan: PlanFile, from_step: int, epoch: int, position: int) -> dict[str, Any]:
    """``resharded_from``: what identifies the parent, where the new plan takes over, and
    what a sampler needs to accept the parent's states (``rows_per_rank``, ``position``)."""
    meta = plan.metadata
    record = {
        "content_hash": meta["content_hash"],
        "config_fingerprint": meta.get("config_fingerprint"),
        "world_size": plan.world_size,
        "config": meta["config"],
        "from_step": from_step,
        "epoch": epoch,
        "position": position,
        "rows_per_rank": meta["rows_per_rank"],
    }
    if "resharded_from" in meta:  # a chain: the parent continued its own parent
        record["resharded_from"] = meta["resharded_from"]
    return record


@dataclasses.dataclass(frozen=True)
class _Rows:
    """A parent epoch's micro-batches, all ranks, in (step, rank, micro) order.

    Row ``i`` holds entries ``offsets[i]:offsets[i + 1]`` of ``sample`` (and of
    ``start``/``length`` when the plan has spans).
    """

    step: NDArray[np.int64]
    offsets: NDArray[np.int64]
    sample: NDArray[np.int64]
    start: NDArray[np.int64] | None
    length: NDArray[np.int64] | None
    tokens: NDArray[np.int64]
    loss_tokens: NDArray[np.int64]
    padded_tokens: NDArray[np.int64]
    cost: NDArray[np.float64] | None

    @property
    def num_rows(self) -> int:
        return int(self.step.shape[0])

    def take(self, rows: NDArray[np.int64]) -> _Rows:
        """These rows, in this order."""
        flat = _segment_positions(self.offsets, rows)
        counts = np.diff(self.offsets)[rows]
        return _Rows(
            step=self.step[rows], offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            sample=self.sample[flat], start=_pick(self.start, flat), length=_pick(self.length, flat),
            tokens=self.tokens[rows], loss_tokens=self.loss_tokens[rows], padded_tokens=self.padded_tokens[rows],
            cost=None if self.cost is None else self.cost[rows],
        )  # fmt: skip


def _merge_epoch_end(part: _Rows, max_tokens: int) -> _Rows:
    """Pack mode: the parent's last step of the epoch, whose micro-batches the parent split to
    give every rank one, packed again by the planner's best fit decreasing within
    ``max_tokens``: left as they are, its small pieces would sit in ordinary steps of the new
    plan beside full micro-batches and leave ranks idle. Counts and costs of a packed
    micro-batch are sums of its pieces', so they stay exact."""
    if part.num_rows == 0:
        return part
    last = np.flatnonzero(part.step == part.step.max())
    # (bins + 1,) offsets and (pieces,) members: pieces of the last step packed into bins
    offsets, members = pack_segments(part.tokens[last], np.arange(last.shape[0], dtype=np.int64), max_tokens)
    if offsets.shape[0] - 1 == last.shape[0]:
        return part
    merged = part.take(last[members])
    group_of = np.repeat(np.arange(offsets.shape[0] - 1), np.diff(offsets))

    def summed(values):
        return np.bincount(group_of, weights=values).astype(values.dtype)

    ends = _Rows(
        step=merged.step[offsets[1:] - 1], offsets=np.concatenate([[0], np.cumsum(summed(np.diff(merged.offsets)))]),
        sample=merged.sample, start=merged.start, length=merged.length, tokens=summed(merged.tokens),
        loss_tokens=summed(merged.loss_tokens), padded_tokens=summed(merged.padded_tokens),
        cost=None if merged.cost is None else summed(merged.cost),
    )  # fmt: skip
    return _concat_rows(part.take(np.flatnonzero(part.step != part.step.max())), ends)


def _concat_rows(first: _Rows, second: _Rows) -> _Rows:
    def both(a, b):
        return None if a is None else np.concatenate([a, b])

    return _Rows(
        step=both(first.step, second.step), offsets=np.concatenate([first.offsets, first.offsets[-1] + second.offsets[1:]]),
        sample=both(first.sample, second.sample), start=both(first.start, second.start),
        length=both(first.length, second.length), tokens=both(first.tokens, second.tokens),
        loss_tokens=both(first.loss_tokens, second.loss_tokens),
        padded_tokens=both(first.padded_tokens, second.padded_tokens), cost=both(first.cost, second.cost),
    )  # fmt: skip


def _pick(values: NDArray | None, positions: NDArray[np.int64]) -> NDArray | None:
    return None if values is None else values[positions]


def _read_epoch(plan: PlanFile, epoch: int) -> _Rows:
    """Every non-empty micro-batch of one parent epoch, in the order the run trains them."""
    table = plan.read_epoch(epoch)
    column = {name: table.column(name).combine_chunks() for name in table.column_names}
    column["padded_tokens"] = padded_tokens_column(table).combine_chunks()
    numbers = {name: column[name].to_numpy().astype(np.int64)
               for name in ("step", "rank", "micro", "tokens", "loss_tokens", "padded_tokens")}  # fmt: skip
    spans = "starts" in column
    rows = _Rows(
        step=numbers["step"], offsets=_offsets(column["samples"]), sample=_values(column["samples"]),
        start=_values(column["starts"]) if spans else None, length=_values(column["lengths"]) if spans else None,
        tokens=numbers["tokens"], loss_tokens=numbers["loss_tokens"], padded_tokens=numbers["padded_tokens"],
        cost=column["cost"].to_numpy() if "cost" in column else None,
    )  # fmt: skip
    order = np.lexsort((numbers["micro"], numbers["rank"], numbers["step"]))
    return rows.take(order[np.diff(rows.offsets)[order] > 0])


def _offsets(array) -> NDArray[np.int64]:
    offsets = array.offsets.to_numpy().astype(np.int64)
    return offsets - offsets[0]


def _values(array) -> NDArray[np.int64]:
    offsets = array.offsets.to_numpy()
    return array.values.to_numpy()[offsets[0] : offsets[-1]].astype(np.int64)


def _segment_positions(offsets: NDArray[np.int64], segments: NDArray[np.int64]) -> NDArray[np.int64]:
    """Positions of the items of ``segments`` (CSR ``offsets``), segment after segment."""
    counts = offsets[segments + 1] - offsets[segments]
    placed = np.cumsum(counts) - counts  # where each segment starts in the output
    return np.repeat(offsets[segments] - placed, counts) + np.arange(int(counts.sum()), dtype=np.int64)


def _parent_drops(plan: PlanFile, epoch: int) -> NDArray[np.int64]:
    """What the parent dropped by drop_last in ``epoch``: shape (n, 3) ``[sample, start, length]``
    with spans, else shape (n, 1) ``[sample]``."""
    dropped = plan.metadata["dropped"]
    if plan.metadata.get("has_spans"):
        return np.asarray(dropped.get("drop_last_spans", {}).get(str(epoch), []), dtype=np.int64).reshape(-1, 3)
    return np.asarray(dropped.get("drop_last", {}).get(str(epoch), []), dtype=np.int64).reshape(-1, 1)


def _always_dropped(plan: PlanFile) -> dict[str, NDArray[np.int64]]:
    dropped = plan.metadata["dropped"]
    return {r: np.asarray(dropped[r], dtype=np.int64) for r in ("empty", "oversize") if r in dropped}


def _index_entries(plan: PlanFile, rows: list[_Rows], drops: list[NDArray[np.int64]]):
    """The new plan's `Entries`, and the entry of each row item and each dropped piece, per epoch.

    Without spans: entry ``i`` is the ``i``-th sample not always dropped (as the planner
    numbers them). With spans: every piece the new plan holds or drops, in (sample,
    start) order.
    """
    always = _always_dropped(plan)
    if not plan.metadata.get("has_spans"):
        keep = np.ones(plan.num_samples, dtype=bool)
        for samples in always.values():
            keep[samples] = False
        sample = np.flatnonzero(keep).astype(index_dtype(plan.num_samples))
        unknown = np.zeros(sample.shape[0], dtype=np.int32)  # per-sample lengths are not in the file
        entries = Entries(sample=sample, start=None, length=unknown, loss_tokens=unknown, dropped=always)
        return entries, [_entry_of(sample, part.sample) for part in rows], [_entry_of(sample, d[:, 0]) for d in drops]
    pieces = [np.stack([part.sample, part.start, part.length], axis=1) for part in rows] + list(drops)
    every = np.concatenate(pieces)
    order = np.lexsort((every[:, 2], every[:, 1], every[:, 0]))
    ordered = every[order]
    new = np.ones(ordered.shape[0], dtype=bool)
    new[1:] = np.any(ordered[1:] != ordered[:-1], axis=1)
    inverse = np.empty(every.shape[0], dtype=np.int64)
    inverse[order] = np.cumsum(new) - 1
    unique = ordered[new]
    length = unique[:, 2].astype(np.int32)
    entries = Entries(sample=unique[:, 0].astype(index_dtype(plan.num_samples)), start=unique[:, 1].copy(),
                      length=length, dropped=always)  # fmt: skip
    bounds = np.cumsum([0] + [p.shape[0] for p in pieces])
    ids = [inverse[bounds[i] : bounds[i + 1]] for i in range(len(pieces))]
    return entries, ids[: len(rows)], ids[len(rows) :]


def _entry_of(kept: NDArray[np.integer], samples: NDArray[np.int64]) -> NDArray[np.int64]:
    return np.searchsorted(kept, samples).astype(np.int64)


def _schedule(part: _Rows, entry_ids, dropped_ids, config: PlanConfig, epoch: int, *, resumed: bool) -> EpochPlan:
    """Schedule one epoch's micro-batches for the new world size, each as one unit."""
    count = part.num_rows
    per_step = config.micro_batches_per_step
    fills_a_step = count >= config.world_size * (per_step or 1)
    if count == 0 or (config.drop_last and not fills_a_step):
        if not resumed and count:
            raise ConfigError(
                f"with drop_last, epoch {epoch}'s {count:,} micro-batches do not fill one step of "
                f"{config.world_size} ranks x {per_step or 1} micro-batches and the whole epoch would be dropped; "
                "reshard to fewer ranks or fewer micro-batches per step"
            )
        # The rest of the resumed epoch is an incomplete final step: drop_last drops it.
        return _empty_epoch(epoch, config, np.concatenate([entry_ids, dropped_ids]).astype(np.int64))
    # One unit per parent micro-batch: its length is the micro-batch's tokens.
    starts = np.arange(count, dtype=np.int64)
    length = part.tokens.astype(np.int32)
    units = Entries(sample=starts, start=None, length=length, loss_tokens=part.loss_tokens.astype(np.int32), dropped={})
    batches = MicroBatches(members=starts.astype(index_dtype(count)), lengths=length, starts=starts, ends=starts + 1)
    scheduled = schedule_epoch(units, batches, config, epoch, costs=part.cost)
    return _expand(scheduled, part, entry_ids, dropped_ids)


def _expand(scheduled: EpochPlan, part: _Rows, entry_ids, dropped_ids) -> EpochPlan:
    """Replace each scheduled unit by the parent micro-batch it stands for: its entries and counts."""
    has_unit = np.diff(scheduled.offsets) > 0  # False for an empty micro-batch added as filler
    unit = scheduled.members[scheduled.offsets[:-1][has_unit]].astype(np.int64)
    counts = np.zeros(scheduled.num_rows, dtype=np.int64)
    counts[has_unit] = np.diff(part.offsets)[unit]

    def per_row(values):
        out = np.zeros(scheduled.num_rows, dtype=values.dtype)
        out[has_unit] = values[unit]
        return out

    tokens, loss_tokens = per_row(part.tokens), per_row(part.loss_tokens)
    gone = scheduled.dropped_entries.astype(np.int64)  # units dropped by drop_last
    return dataclasses.replace(
        scheduled,
        offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        members=entry_ids[_segment_positions(part.offsets, unit)],
        tokens=tokens,
        loss_tokens=loss_tokens,
        padded_tokens=per_row(part.padded_tokens),
        cost=None if part.cost is None else per_row(part.cost),
        step_tokens=_sum_by_step(scheduled.step, tokens, scheduled.num_steps),
        step_loss_tokens=_sum_by_step(scheduled.step, loss_tokens, scheduled.num_steps),
        dropped_entries=np.concatenate([entry_ids[_segment_positions(part.offsets, gone)], dropped_ids]),
    )


def _sum_by_step(step: NDArray[np.int64], values: NDArray[np.int64], num_steps: int) -> NDArray[np.int64]:
    sums = np.zeros(num_steps, dtype=np.int64)
    np.add.at(sums, step, values)
    return sums


def _empty_epoch(epoch: int, config: PlanConfig, dropped: NDArray[np.int64]) -> EpochPlan:
    """An epoch with no rows: before the resumed one, or a resumed rest that drop_last dropped."""
    none64, none32 = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
    return EpochPlan(
        epoch=epoch, world_size=config.world_size, offsets=np.zeros(1, dtype=np.int64), members=none64,
        rank_step=none64, rank_micro=none32, rank_num_micro=none32, tokens=none64, loss_tokens=none64,
        padded_tokens=none64, cost=None if config.cost_coefficient is None else np.zeros(0), step_tokens=none64,
        step_loss_tokens=none64, dropped_entries=dropped,
    )  # fmt: skip


def _consumed(plan: PlanFile, rows: _Rows, from_step: int, epoch: int) -> dict[str, Any]:
    """``consumed``: what the parent trained of ``epoch`` before ``from_step`` (with what its
    own parent had, for a chain). ``samples``: bitmap of samples trained whole; ``spans``:
    the trained pieces of split samples that still have pieces left."""
    before = np.flatnonzero(rows.step < from_step)
    done = rows.take(before)
    whole, spans = _inherited_consumed(plan, epoch)
    if not plan.metadata.get("has_spans"):
        whole[done.sample] = True
        return {"epoch": epoch, "samples": encode_bitmap(whole), "spans": []}
    pieces = np.concatenate([np.stack([done.sample, done.start, done.length], axis=1), spans])
    rest = rows.take(np.flatnonzero(rows.step >= from_step)).sample
    open_samples = np.concatenate([rest, _parent_drops(plan, epoch)[:, 0]])
    complete = ~np.isin(pieces[:, 0], open_samples)
    whole[pieces[complete, 0]] = True
    partial = pieces[~complete]
    partial = partial[np.lexsort((partial[:, 1], partial[:, 0]))]
    return {"epoch": epoch, "samples": encode_bitmap(whole), "spans": partial.tolist()}


def _inherited_consumed(plan: PlanFile, epoch: int) -> tuple[NDArray[np.bool_], NDArray[np.int64]]:
    consumed = plan.metadata.get("consumed")
    if not consumed or consumed.get("epoch") != epoch:
        return np.zeros(plan.num_samples, dtype=bool), np.zeros((0, 3), dtype=np.int64)
    whole = decode_bitmap(consumed["samples"], plan.num_samples)
    return whole, np.asarray(consumed.get("spans", []), dtype=np.int64).reshape(-1, 3)

