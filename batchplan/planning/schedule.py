"""Steps 2-5 of an epoch (`batchplan.planning.epochs`): formed micro-batches in, an
`EpochPlan` out.

`schedule_epoch` reads as its stages: shuffle the micro-batches, complete or drop the
epoch's end (`epoch_end`), gather what each needs in schedule order while forming
rounds of similar cost (`batchplan.planning.scheduled.Scheduled.take`), cut steps (`steps`), then assign ranks and lay
out the rows (`_assemble`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig
from batchplan.errors import ConfigError
from batchplan.kernels.assemble import lay_out_rows
from batchplan.plan import Entries, EpochPlan, index_dtype
from batchplan.planning.buffers import new_buffer
from batchplan.planning.epoch_batches import EpochBatches
from batchplan.planning.epoch_end import complete_last_round, drop_last_ramp_step, drop_last_step
from batchplan.planning.forming import compute_costs
from batchplan.planning.randomness import STREAM_MICRO_BATCH_ORDER, epoch_rng, permute
from batchplan.planning.scheduled import Scheduled
from batchplan.planning.step_bounds import StepSizing, cut_steps
from batchplan.planning.threads import run_in_parts

__all__ = ["schedule_epoch"]

# Rows whose source `_row_sources` looks up at a time (its int64 lookups: 8 MiB).
_SOURCE_ROWS = 1 << 20


def schedule_epoch(
    entries: Entries,
    batches: EpochBatches,
    config: PlanConfig,
    epoch: int,
    *,
    tokens_before: int | None = None,
    ordered: int = 0,
    threads: int = 1,
    costs: NDArray[np.float64] | None = None,
    steps: NDArray[np.int64] | None = None,
    order: NDArray[np.integer] | None = None,
    sources: tuple[NDArray[np.int64], NDArray[np.int16]] | None = None,
) -> EpochPlan:
    """Steps 2-5 of the module docstring for formed micro-batches: shuffle them, complete
    or drop the last round, form balanced steps, assign ranks. ``batches`` may be
    extended (split halves, empty micro-batches).

    Args:
        tokens_before: tokens of the run before this epoch; needed with a ramp-up.
        ordered: the first ``ordered`` micro-batches keep their order and go first
            (a sequence-length warmup's stages), unbalanced; the rest are shuffled.
        threads: threads for the kernels that split (the plan is the same for any number).
        costs: the predicted compute of each of ``batches`` when it is known already
            (a resharded plan's micro-batches, whose entries stand for whole micro-batches);
            empty micro-batches added here cost 0. Default: from the entries' lengths.
        steps: the steps' bounds over ``batches`` in their order, made by the caller (a
            mixture's composed steps, with ``order``); the last step also takes
            what completes its last round; with ``drop_last``, the micro-batches past the
            last step are dropped (the caller decides the epoch's end). Default: cut here
            (`steps.cut_steps`).
        order: the order of every micro-batch (a mixture's composed steps; with ``steps``);
            default: the first ``ordered`` in their order, the rest shuffled.
        sources: a mixture's ``(bounds, source)``: member space ``bounds[k]:bounds[k + 1]``
            (as formed) holds source ``source[k]``; each row gets the source of its first
            member (-1 when empty) as the plan's ``source``.
    """
    if config.has_rampup and tokens_before is None:
        raise ConfigError(
            f"epoch {epoch}: with a ramp-up (`rampup_start`) the steps depend on the tokens trained before "
            "the epoch, which were not given (resharding a plan built with a ramp-up is not supported yet)"
        )
    sizing = StepSizing.of(config, tokens_before or 0, batches)
    if order is not None:
        ordered = int(order.shape[0])
    room, schedule, num_full, dropped = _shuffle(batches, config, epoch, ordered, threads, order, steps)
    coefficient = config.cost_coefficient
    compute = None if coefficient is None else _costs_of(batches, config, coefficient, costs)
    # What is needed of the entries' lengths is known now (tokens, longest): let them go.
    longest = batches.longest() if config.mode == "pad" else None
    batches.free_lengths()
    # With a loss-tokens column, each micro-batch's loss tokens are summed now, so that large
    # packed epochs can compress their bins until the members are laid out (`EpochBatches.compress`).
    loss = None if entries.loss_tokens is None else batches.entry_sums(entries.loss_tokens)  # None: length - 1 each
    batches.compress(threads)
    kept = min(num_full, -(-ordered // config.world_size) * config.world_size)  # whole rounds
    # Each scheduled micro-batch's values, gathered once and written where balancing puts them.
    at = Scheduled.take(schedule, batches, compute, config, kept, num_full, epoch, threads)
    del room, schedule, compute  # taken
    if config.drop_last and config.has_rampup and steps is None:
        # The ramp makes step boundaries depend on the order: decide on the final steps.
        step_offsets = cut_steps(at.tokens[:num_full], config, sizing)
        keep, step_offsets, dropped = drop_last_ramp_step(batches, at, step_offsets, config, epoch, sizing)
        at = at.head(keep)
    elif steps is not None:
        step_offsets = steps.astype(np.int64)
        step_offsets[-1] = at.tokens.shape[0]
    else:
        step_offsets = cut_steps(at.tokens, config, sizing)
    rows = EpochRows.lay_out(config, batches, at, step_offsets, longest, loss, threads)
    del at, longest, loss  # not needed once the rows are laid out
    return _assemble(config, epoch, batches, rows, dropped, threads, sources)


def _shuffle(batches: EpochBatches, config: PlanConfig, epoch: int, ordered: int, threads: int, order=None, steps=None):
    """The micro-batches after the first ``ordered`` shuffled (or all in ``order``), and the
    epoch's end completed or dropped (`epoch_end`): ``(room, schedule, whole rounds'
    micro-batches, dropped entries)``; the schedule is written in ``room``, which has room to
    complete the last round in place."""
    room = np.empty(batches.count + config.world_size, dtype=index_dtype(batches.count + config.world_size))
    schedule = room[: batches.count]
    schedule[:ordered] = np.arange(ordered) if order is None else order
    permute(epoch_rng(config.seed, epoch, STREAM_MICRO_BATCH_ORDER), schedule[ordered:], first=ordered, threads=threads)
    dropped = None  # under drop_last with a ramp-up: decided on the final steps
    if config.drop_last:
        if steps is not None:  # the caller's steps end the epoch: what lies past them is dropped
            schedule, dropped = schedule[: int(steps[-1])], batches.members_of(schedule[int(steps[-1]) :])
        elif not config.has_rampup:
            schedule, dropped = drop_last_step(batches, schedule, config, epoch)
        num_full = schedule.shape[0] - schedule.shape[0] % config.world_size
    else:
        num_full = schedule.shape[0] - schedule.shape[0] % config.world_size
        schedule, dropped = complete_last_round(batches, room, batches.count, config.world_size)
    return room, schedule, num_full, dropped


def _costs_of(
    batches: EpochBatches, config: PlanConfig, coefficient: float, known: NDArray[np.float64] | None
) -> NDArray[np.float64]:
    if known is None:
        return compute_costs(batches, config.mode, coefficient)
    if batches.count < known.shape[0] or batches.count - known.shape[0] > config.world_size:
        raise ConfigError(f"{known.shape[0]:,} known costs for {batches.count:,} micro-batches")
    return np.concatenate([known.astype(np.float64), np.zeros(batches.count - known.shape[0])])


@dataclasses.dataclass
class EpochRows:
    """The rows of an epoch, ordered by (rank, step, micro) (`batchplan.kernels.assemble.lay_out_rows`).
    ``order`` (each row's micro-batch id and entries) is dropped once the members' places are known."""

    order: NDArray[np.integer]  # shape (2, rows): micro-batch id, entries (int32 when they fit)
    values: NDArray[np.integer]  # shape (2, rows): tokens, loss tokens (int32 when they fit)
    padded: NDArray[np.int64] | None  # pad mode: entries x longest
    cost: NDArray[np.float64] | None
    rank_rows: NDArray[np.int64]  # shape (3, rows per rank): step, micro, micro-batches in the step
    step_sums: NDArray[np.int64]  # shape (2, steps): tokens, loss tokens

    @classmethod
    def lay_out(cls, config: PlanConfig, batches: EpochBatches, at: Scheduled, step_offsets, longest, loss, threads):
        """Assign ranks in each step and order the micro-batches by (rank, step, micro).
        ``longest``: pad mode, each micro-batch's longest entry (else None); ``loss``: each
        micro-batch's loss tokens (else None: tokens less entries)."""
        no_values = np.zeros(0, dtype=np.int64)
        loss = no_values if loss is None else loss[at.batch]
        compute = np.zeros(0, dtype=np.float64) if at.compute is None else at.compute
        count = step_offsets[-1]
        # Tokens and loss tokens are kept in the plan: int32 when they fit (half the memory).
        most = max(int(at.tokens.max(initial=0)), int(loss.max(initial=0)))
        ids = max(batches.count, int(at.sizes.max(initial=0)))
        order, values = new_buffer((2, count), index_dtype(ids + 1)), new_buffer((2, count), index_dtype(most + 1))
        cost = np.empty(count if at.compute is not None else 0, dtype=np.float64)
        rank_rows = np.empty((3, count // config.world_size), dtype=np.int64)
        step_sums = np.zeros((2, step_offsets.shape[0] - 1), dtype=np.int64)
        run_in_parts(
            lay_out_rows,
            threads,
            step_offsets,
            at.costs,
            at.batch,
            at.tokens,
            at.sizes,
            loss,
            compute,
            config.world_size,
            order,
            values,
            cost,
            rank_rows,
            step_sums,
        )
        padded = None if longest is None else order[1] * longest[order[0]]
        return cls(order, values, padded, None if at.compute is None else cost, rank_rows, step_sums)


def _assemble(
    config: PlanConfig, epoch: int, batches: EpochBatches, rows: EpochRows, dropped, threads: int, sources
) -> EpochPlan:
    """The epoch's plan: the rows, and the members laid out in row order. The micro-batches
    are emptied, and each array is freed as soon as it is used, before the members are made."""
    tokens, loss_tokens = rows.values
    batch_of_row, sizes = rows.order
    source = None if sources is None else _row_sources(batches.starts, batch_of_row, sizes, *sources)
    where = batches.destinations(batch_of_row, sizes, threads)
    del batch_of_row, sizes, rows.order
    where.offsets = where.offsets.astype(index_dtype(where.count + 1), copy=False)
    packing = batches.packing
    members = batches.lay_out(where, threads)  # packed bins: laid out a window at a time, when written
    step, micro, num_micro = rows.rank_rows[0], rows.rank_rows[1].astype(np.int32), rows.rank_rows[2].astype(np.int32)
    return EpochPlan(
        epoch=epoch,
        world_size=config.world_size,
        offsets=where.offsets,
        member_store=members,
        rank_step=step,
        rank_micro=micro,
        rank_num_micro=num_micro,
        tokens=tokens,
        loss_tokens=loss_tokens,
        padded_tokens=tokens if rows.padded is None else rows.padded,
        cost=rows.cost,
        step_tokens=rows.step_sums[0],
        step_loss_tokens=rows.step_sums[1],
        dropped_entries=dropped,
        packing=packing,
        source=source,
    )


def _row_sources(
    starts, batch_of_row, sizes, bounds: NDArray[np.int64], source: NDArray[np.int16]
) -> NDArray[np.int16]:
    """The source of the range of member space each row's first member lies in (``starts``: each
    micro-batch's first place; ``batch_of_row``: each row's micro-batch); -1 when empty. Rows are
    looked up `_SOURCE_ROWS` at a time: the lookups' int64 arrays stay small beside the rows'."""
    out = np.empty(batch_of_row.shape[0], dtype=np.int16)
    for first in range(0, out.shape[0], _SOURCE_ROWS):
        rows = slice(first, first + _SOURCE_ROWS)
        part = np.searchsorted(bounds, starts[batch_of_row[rows]], side="right") - 1
        np.clip(part, 0, source.shape[0] - 1, out=part)
        out[rows] = np.where(sizes[rows] > 0, source[part], -1)
    return out
