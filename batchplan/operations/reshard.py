"""Reshard: re-plan what a run has not trained yet for another number of ranks.

A run planned for ``W`` ranks that must continue on ``W2`` (a node lost or added)
from global step ``S`` gets a new plan:

1. The parent's micro-batches from step ``S`` on (the rest of ``S``'s epoch, then
   every later epoch) are read back from the file with their samples, spans and
   counts. A micro-batch does not depend on the world size (packs and padded batches
   are formed before ranks are assigned), so each is kept whole, as one entry; empty
   fillers are discarded. In pack mode the micro-batches of each epoch's last step,
   which the parent split so that every rank had one, are packed again (the
   planner's best fit decreasing within ``max_tokens``; counts and costs are sums of the pieces').
2. Each epoch's micro-batches are scheduled again for ``W2`` ranks by
   `batchplan.planning.schedule.schedule_epoch`: seeded shuffle, an incomplete last round
   completed with empty micro-batches (these entries are never split) or dropped under
   ``drop_last``, balanced steps, rank assignment. Each entry is balanced by its
   micro-batch's exact ``cost`` (the parent's column), so ``balance=compute`` keeps
   ranks as balanced as a fresh build for the new world size.
3. Steps are numbered on from ``S`` and ``tokens_before_step`` runs on from the
   parent's count at ``S``. Epochs before ``S``'s stay in the file with no rows, so
   a rank still reads record batch ``epoch * W2 + rank``.

Step size: explicit ``micro_batches`` or ``tokens_per_step``; by default as close to the
parent's global step as ``W2`` ranks allow (`batchplan.operations.reshard_steps`).

Guarantees (checked by `batchplan.operations.validate` through the metadata written with the
plan, ``resharded_from``/``consumed``): what the parent trained before ``S`` plus
what the new plan holds from ``S`` is every sample of every epoch exactly once
(split samples: the pieces tile it), except what a policy dropped, which is listed;
every DESIGN.md guarantee holds for the new plan; same parent and options give a
byte-identical file. With ``drop_last`` what the parent dropped stays dropped, and a
new plan drops at most one more incomplete step per epoch (all of the resumed
epoch's rest when it does not fill one step of ``W2`` ranks).

A mixture's plan (metadata key ``mixture``) keeps its steps: each parent step from ``S``
on becomes one step of the new plan with the same micro-batches (the epoch's last step's
pieces are not packed again), placed on the ``W2`` ranks largest cost first and completed
with empty micro-batches to a whole number per rank (``ceil(n / W2)`` each for a step of
``n``; `batchplan.operations.reshard_mixture`). So every step keeps its tokens, each source's tokens and the
samples' uses, and with them the mixture's guarantees (`batchplan.operations.mixture_checks`: shares, drift,
repetition); the rows keep their ``source`` and the file the ``mixture`` metadata. Step
sizes cannot be chosen (``micro_batches``/``tokens_per_step``); the config records
``ceil(W * M / W2)`` micro-batches per rank, or the parent's token target. ``consumed``
says what the parent trained before ``S`` of the resumed epoch (every sample used,
``spans`` empty: a mixture's epoch is a part of the run, not one pass) and, under
``mixture``, what a check of the rest needs: the epoch's ``steps`` and each source's
``source_tokens`` before ``S``, and each kept sample's uses in the whole run before ``S``,
which the repetition guarantee keeps at ``uses_base[source]`` or one more (``uses_more``, a
bitmap over samples; a dropped sample has none).

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

from batchplan.config import PlanConfig
from batchplan.errors import ConfigError
from batchplan.formats.bitmap import decode_bitmap, encode_bitmap
from batchplan.formats.opened_plan import OpenedPlan
from batchplan.formats.opening import open_plan
from batchplan.formats.plan_writer import write_plan
from batchplan.operations.parent_rows import (
    ParentRows,
    index_entries,
    merge_epoch_end,
    parent_drops,
    read_epoch,
    segment_positions,
)
from batchplan.operations.reshard_mixture import deal_steps, mixture_consumed
from batchplan.operations.reshard_steps import step_sizing
from batchplan.plan import Entries, EpochPlan, Members, Plan, index_dtype
from batchplan.planning.epoch_batches import EpochBatches
from batchplan.planning.schedule import schedule_epoch
from batchplan.reduce import sum_by_group

__all__ = ["ReshardedPlan", "reshard_plan", "reshard_plan_file"]


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
        mixture: a mixture's plan: the parent's ``mixture`` metadata, stored again (the
            rows then say their source); else None.
    """

    plan: Plan
    lineage: dict[str, Any]
    dataset: dict[str, Any] | None
    lengths_fingerprint: str | None
    mixture: dict[str, Any] | None = None

    @property
    def first_step(self) -> int:
        return int(self.lineage["first_step"])

    def write(self, path: str | os.PathLike) -> dict[str, Any]:
        """Write the plan atomically; return its metadata."""
        return write_plan(
            self.plan,
            path,
            dataset=self.dataset,
            lengths_fingerprint=self.lengths_fingerprint,
            lineage=self.lineage,
            mixture=self.mixture,
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
    parent = open_parent(plan_path, output, "resharded")
    resharded = reshard_plan(
        parent, world_size=world_size, from_step=from_step, micro_batches=micro_batches, tokens_per_step=tokens_per_step
    )
    return resharded.write(output)


def open_parent(plan_path: str | os.PathLike, output: str | os.PathLike, doing: str) -> OpenedPlan:
    """The parent plan, opened and verified, once ``output`` is known to be writable and not
    the parent itself (which the new plan resumes from)."""
    plan_path, output = Path(plan_path), Path(output)
    if output.resolve() == plan_path.resolve():
        raise ConfigError(
            f"output {output} is the plan being {doing}; write the new plan to another file "
            "(keep the parent: the new plan resumes from the parent's sampler states)"
        )
    if not output.parent.is_dir():
        raise ConfigError(f"output directory {output.parent} does not exist; create it or choose another -o")
    parent = open_plan(plan_path)
    parent.verify()
    return parent


def reshard_plan(
    plan: OpenedPlan,
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
        micro_batches: micro-batches per rank per step; default: `batchplan.operations.reshard_steps`.
            Not for a mixture's plan, which keeps its steps.
        tokens_per_step: global token target per step instead (not for a mixture's plan).

    Raises:
        ConfigError: ``from_step`` is not a step of the plan; an invalid size, or a size
            given for a mixture's plan; with ``drop_last``, a whole later epoch does not
            fill one step of ``world_size`` ranks.
        PlanFormatError: a mixture's plan without its ``source`` column, or whose uses
            before ``from_step`` break its repetition guarantee.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"`world_size` must be an integer >= 1, got {world_size!r}")
    epoch, position, tokens_before = locate_step(plan, from_step)
    mixture = plan.metadata.get("mixture")
    sizing = step_sizing(plan, world_size, micro_batches, tokens_per_step)
    config = PlanConfig.from_dict({**plan.metadata["config"], "world_size": world_size, **sizing})
    rows = [read_epoch(plan, k) for k in range(epoch, plan.num_epochs)]
    if mixture is None:
        consumed = _consumed(plan, rows[0], from_step, epoch)
    else:
        before = rows[0].take(np.flatnonzero(rows[0].step < from_step))
        consumed = mixture_consumed(plan, before, epoch, from_step, [read_epoch(plan, k) for k in range(epoch)])
    rows[0] = rows[0].take(np.flatnonzero(rows[0].step >= from_step))
    if config.mode == "pack" and mixture is None:  # a mixture's steps keep their micro-batches
        rows = [merge_epoch_end(part, config.max_tokens) for part in rows]
    drops = [parent_drops(plan, k) for k in range(epoch, plan.num_epochs)]
    entries, entry_ids, drop_ids = index_entries(plan, rows, drops)
    epochs = [empty_epoch(k, config, np.zeros(0, np.int64), mixture is not None) for k in range(epoch)]
    tokens_before_epoch = tokens_before
    for k, (part, ids, dropped) in enumerate(zip(rows, entry_ids, drop_ids), start=epoch):
        if mixture is None:
            epochs.append(_schedule(part, ids, dropped, config, k, resumed=k == epoch))
        else:  # every epoch holds a step from `from_step` on; a mixture drops nothing by drop_last
            epochs.append(_expand(deal_steps(part, config, k, tokens_before_epoch), part, ids, dropped))
        tokens_before_epoch += int(part.tokens.sum())
    lineage = {
        "first_step": from_step,
        "tokens_before_first_step": tokens_before,
        "num_entries": plan.metadata.get("num_entries", entries.num_entries),
        "resharded_from": parent_record(plan, from_step, epoch, position),
        "consumed": consumed,
    }
    new_plan = Plan(config=config, num_samples=plan.num_samples, entries=entries, epochs=tuple(epochs))
    meta = plan.metadata
    return ReshardedPlan(new_plan, lineage, meta.get("dataset"), meta.get("lengths_fingerprint"), mixture)


def locate_step(plan: OpenedPlan, from_step: int) -> tuple[int, int, int]:
    """``(epoch, position, tokens_before_step)`` of global step ``from_step`` in the parent:
    its epoch, the micro-batches each rank ran in that epoch before it, the tokens before it."""
    first = int(plan.metadata.get("first_step", 0))
    end = first + plan.num_steps
    if isinstance(from_step, bool) or not isinstance(from_step, int) or not first <= from_step < end:
        raise ConfigError(
            f"`from_step` {from_step!r} is not a step of {plan.path}, which holds steps {first:,}..{end - 1:,}; "
            "pass the optimizer steps done at the checkpoint you resume from"
        )
    ends = first + np.cumsum(plan.metadata["steps_per_epoch"])
    epoch = int(np.searchsorted(ends, from_step, side="right"))
    rows = plan.rank_rows(epoch, 0)
    position = int(np.count_nonzero(rows.numbers("step") < from_step))
    return epoch, position, int(rows.numbers("tokens_before_step")[position])


def parent_record(plan: OpenedPlan, from_step: int, epoch: int, position: int) -> dict[str, Any]:
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


def _schedule(part: ParentRows, entry_ids, dropped_ids, config: PlanConfig, epoch: int, *, resumed: bool) -> EpochPlan:
    """Schedule one epoch's micro-batches for the new world size, each as one entry."""
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
        return empty_epoch(epoch, config, np.concatenate([entry_ids, dropped_ids]).astype(np.int64))
    # One entry per parent micro-batch: its length is the micro-batch's tokens.
    starts = np.arange(count, dtype=np.int64)
    length = part.tokens.astype(np.int32)
    parents = Entries(
        sample=starts, start=None, length=length, loss_tokens=part.loss_tokens.astype(np.int32), dropped={}
    )
    batches = EpochBatches.of_ranges(starts.astype(index_dtype(count)), length, starts, starts + 1)
    scheduled = schedule_epoch(parents, batches, config, epoch, costs=part.cost)
    return _expand(scheduled, part, entry_ids, dropped_ids)


def _expand(scheduled: EpochPlan, part: ParentRows, entry_ids, dropped_ids) -> EpochPlan:
    """Replace each scheduled entry by the parent micro-batch it stands for: its entries and counts."""
    has_parent = np.diff(scheduled.offsets) > 0  # False for an empty micro-batch added as filler
    parent = scheduled.members[scheduled.offsets[:-1][has_parent]].astype(np.int64)
    counts = np.zeros(scheduled.num_rows, dtype=np.int64)
    counts[has_parent] = np.diff(part.offsets)[parent]

    def per_row(values):
        out = np.zeros(scheduled.num_rows, dtype=values.dtype)
        out[has_parent] = values[parent]
        return out

    tokens, loss_tokens = per_row(part.tokens), per_row(part.loss_tokens)
    source = None
    if part.source is not None:  # a mixture's: an empty micro-batch has none (-1)
        source = np.full(scheduled.num_rows, -1, dtype=np.int16)
        source[has_parent] = part.source[parent]
    gone = scheduled.dropped_entries.astype(np.int64)  # parent micro-batches dropped by drop_last
    return dataclasses.replace(
        scheduled,
        offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        member_store=Members(entry_ids[segment_positions(part.offsets, parent)]),
        tokens=tokens,
        loss_tokens=loss_tokens,
        padded_tokens=per_row(part.padded_tokens),
        cost=None if part.cost is None else per_row(part.cost),
        step_tokens=sum_by_group(scheduled.step, tokens, scheduled.num_steps),
        step_loss_tokens=sum_by_group(scheduled.step, loss_tokens, scheduled.num_steps),
        dropped_entries=np.concatenate([entry_ids[segment_positions(part.offsets, gone)], dropped_ids]),
        source=source,
    )


def empty_epoch(epoch: int, config: PlanConfig, dropped: NDArray[np.int64], mixture: bool = False) -> EpochPlan:
    """An epoch with no rows: before the resumed one, or a resumed rest that drop_last dropped
    (``mixture``: of a mixture's plan, whose rows say their source)."""
    none64, none32 = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
    return EpochPlan(
        epoch=epoch,
        world_size=config.world_size,
        offsets=np.zeros(1, dtype=np.int64),
        member_store=Members(none64),
        rank_step=none64,
        rank_micro=none32,
        rank_num_micro=none32,
        tokens=none64,
        loss_tokens=none64,
        padded_tokens=none64,
        cost=None if config.cost_coefficient is None else np.zeros(0),
        step_tokens=none64,
        step_loss_tokens=none64,
        dropped_entries=dropped,
        source=np.zeros(0, dtype=np.int16) if mixture else None,
    )


def _consumed(plan: OpenedPlan, rows: ParentRows, from_step: int, epoch: int) -> dict[str, Any]:
    """``consumed``: what the parent trained of ``epoch`` before ``from_step`` (with what its
    own parent had, for a chain). ``samples``: bitmap of samples trained whole; ``spans``:
    the trained pieces of split samples that still have pieces left."""
    before = np.flatnonzero(rows.step < from_step)
    done = rows.take(before)
    whole, spans = _inherited_consumed(plan, epoch)
    if not plan.metadata.get("has_spans"):
        whole[done.sample] = True
        return {"epoch": epoch, "samples": encode_bitmap(whole), "spans": []}
    pieces = np.concatenate([done.spans(), spans])
    rest = rows.take(np.flatnonzero(rows.step >= from_step)).sample
    open_samples = np.concatenate([rest, parent_drops(plan, epoch)[:, 0]])
    complete = ~np.isin(pieces[:, 0], open_samples)
    whole[pieces[complete, 0]] = True
    partial = pieces[~complete]
    partial = partial[np.lexsort((partial[:, 1], partial[:, 0]))]
    return {"epoch": epoch, "samples": encode_bitmap(whole), "spans": partial.tolist()}


def _inherited_consumed(plan: OpenedPlan, epoch: int) -> tuple[NDArray[np.bool_], NDArray[np.int64]]:
    consumed = plan.metadata.get("consumed")
    if not consumed or consumed.get("epoch") != epoch:
        return np.zeros(plan.num_samples, dtype=bool), np.zeros((0, 3), dtype=np.int64)
    whole = decode_bitmap(consumed["samples"], plan.num_samples)
    return whole, np.asarray(consumed.get("spans", []), dtype=np.int64).reshape(-1, 3)
