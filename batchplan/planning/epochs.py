"""Plan every epoch: shuffle, form micro-batches, group them into steps, assign ranks.

Per epoch, with randomness only from ``SeedSequence([seed, epoch, stream])``:

1. micro-batches: ``pack`` = best-fit decreasing with seeded tie-breaking (items of
   equal length taken in a seeded random order);
   ``pad`` = seeded shuffle, sort inside windows, greedy cut (count x longest <= cap);
2. their order is shuffled. An incomplete final chunk (fewer than ``world_size``) is
   completed by splitting micro-batches, then with empty micro-batches (zero-weight
   dummies at run time), and kept for the last step; or dropped (``drop_last``);
3. "chunks" of ``world_size`` micro-batches of similar cost are formed within windows
   of ``balance_window`` chunks (cost = tokens, or tokens + attention), and shuffled;
4. consecutive chunks form steps: a fixed number per step, or as many as bring the
   step closest to a token target; with a ramp-up (``rampup_start``/``rampup_tokens``)
   the target grows with the tokens of the run done before the step
   (`batchplan.kernels.steps.ramp_steps`), so epoch ``e`` needs the tokens of epochs
   before it (exact up front: each epoch holds every token once, unless ``drop_last``);
5. inside each step, micro-batches go to ranks (equal counts, balanced cost).

A sequence-length warmup (`batchplan.planning.warmup`) changes epoch 0 only: its first tokens
are pieces cut to a growing cap, formed into micro-batches stage by stage and
scheduled first, in stage order, ahead of the rest of the epoch (steps 1-3 as usual).

Rows come out ordered by (rank, step, micro), so one rank's rows of an epoch are
contiguous. Cost: O(n log C) to pack, O(n) for the rest, per epoch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig, num_threads
from batchplan.errors import ConfigError, DatasetError
from batchplan.kernels.assemble import lay_out_rows, take_scheduled
from batchplan.kernels.steps import ramp_steps, ramp_target, steps_by_tokens
from batchplan.plan import Entries, EpochPlan, Plan
from batchplan.planning.entries import make_entries
from batchplan.planning.micro_batches import (
    MicroBatches,
    compute_costs,
    form_micro_batches,
    form_warmup_micro_batches,
    permute,
)
from batchplan.planning.threads import run_in_parts
from batchplan.planning.warmup import SeqlenWarmup, add_warmup_pieces

__all__ = ["build_plan", "epoch_rng", "plan_epoch", "schedule_epoch"]

# Independent random streams of one epoch.
STREAM_ENTRY_ORDER = 0
STREAM_MICRO_BATCH_ORDER = 1
STREAM_CHUNK_ORDER = 2
STREAM_SEQLEN_WARMUP = 3


def epoch_rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    """The only source of randomness in batchplan."""
    return np.random.default_rng(np.random.SeedSequence([seed, epoch, stream]))


def build_plan(
    lengths: NDArray[np.integer],
    config: PlanConfig,
    *,
    loss_tokens: NDArray[np.integer] | None = None,
    on_epoch: Callable[[int], None] | None = None,
) -> Plan:
    """Plan all epochs of ``config`` for samples of the given lengths.

    Args:
        lengths: tokens of each sample, in dataset row order.
        config: the build configuration.
        loss_tokens: tokens carrying a label per sample (default: length - 1).
        on_epoch: called with each epoch index once it is planned (progress bars).

    Raises:
        DatasetError: the lengths break a policy of ``config``, or nothing is left.
    """
    lengths = np.asarray(lengths)
    entries = make_entries(lengths, config, loss_tokens)
    if entries.num_entries == 0:
        dropped = ", ".join(f"{v.size:,} {k}" for k, v in entries.dropped.items())
        raise DatasetError(f"no samples left to plan after dropping {dropped or 'none'}")
    warmup = None
    if config.has_seqlen_warmup:
        entries, warmup = add_warmup_pieces(entries, config, epoch_rng(config.seed, 0, STREAM_SEQLEN_WARMUP))
    epochs = _plan_epochs(entries, config, warmup, on_epoch)
    return Plan(config=config, num_samples=int(lengths.shape[0]), entries=entries, epochs=tuple(epochs))


def _plan_epochs(entries: Entries, config: PlanConfig, warmup: SeqlenWarmup | None, on_epoch) -> list[EpochPlan]:
    """Plan every epoch. Epochs are independent (own seeds) and the kernels release the
    GIL: they are planned on all cores, and the result does not depend on the number of
    threads. A ramp-up needs the tokens before each epoch: known up front (an epoch
    holds every entry once), except under drop_last, where the epochs that begin inside
    the ramp are planned in order first."""
    num_base = entries.num_entries if warmup is None else warmup.num_base
    epoch_tokens = int(entries.length[:num_base].sum(dtype=np.int64))
    epochs: list[EpochPlan] = []
    tokens_before = 0
    if config.has_rampup and config.drop_last:
        while len(epochs) < config.epochs and tokens_before < config.rampup_tokens:
            epochs.append(
                plan_epoch(entries, config, len(epochs), tokens_before=tokens_before, warmup=warmup, threads=num_threads())
            )
            tokens_before += int(epochs[-1].step_tokens.sum())
            if on_epoch is not None:
                on_epoch(len(epochs) - 1)
    first = len(epochs)
    # Past the ramp (or without drop_last, exactly) each later epoch starts at
    # tokens_before + k * epoch_tokens; past the ramp the value no longer matters.
    count = config.epochs - first
    befores = [tokens_before + k * epoch_tokens for k in range(count)]
    cores = num_threads()
    at_once = max(1, min(count, cores))
    # Cores left over split the work of each epoch: epochs run at_once at a time, and the
    # epochs of a last, partial round share all the cores (3 epochs on 2: 1, 1, then 2).
    last_round = count % at_once or at_once
    threads = [max(1, cores // at_once)] * (count - last_round) + [max(1, cores // last_round)] * last_round
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        futures = [
            pool.submit(plan_epoch, entries, config, epoch, tokens_before=before, warmup=warmup, threads=share)
            for epoch, before, share in zip(range(first, config.epochs), befores, threads)
        ]
        for epoch, future in enumerate(futures, start=first):
            epochs.append(future.result())
            if on_epoch is not None:
                on_epoch(epoch)
    return epochs


def plan_epoch(
    entries: Entries,
    config: PlanConfig,
    epoch: int,
    *,
    tokens_before: int = 0,
    warmup: SeqlenWarmup | None = None,
    threads: int = 1,
) -> EpochPlan:
    """Plan one epoch (see the module docstring).

    Args:
        entries: the plan's entries (with ``warmup``: also epoch 0's warmup pieces).
        config: the build configuration.
        epoch: the epoch to plan.
        tokens_before: tokens of the run planned before this epoch (for a ramp-up).
        warmup: epoch 0's sequence-length warmup (`batchplan.planning.warmup`), if any.
        threads: threads for the steps that split (the plan is the same for any number).
    """
    rng = epoch_rng(config.seed, epoch, STREAM_ENTRY_ORDER)
    if warmup is None:
        batches = form_micro_batches(entries.length, config, rng, threads)
        return schedule_epoch(entries, batches, config, epoch, tokens_before=tokens_before, threads=threads)
    if epoch > 0:
        batches = form_micro_batches(entries.length[: warmup.num_base], config, rng, threads)
        return schedule_epoch(entries, batches, config, epoch, tokens_before=tokens_before, threads=threads)
    batches, ordered = form_warmup_micro_batches(
        entries, config, warmup, rng, epoch_rng(config.seed, 0, STREAM_SEQLEN_WARMUP), threads
    )
    return schedule_epoch(entries, batches, config, epoch, tokens_before=tokens_before, ordered=ordered, threads=threads)


def schedule_epoch(
    entries: Entries,
    batches: MicroBatches,
    config: PlanConfig,
    epoch: int,
    *,
    tokens_before: int | None = None,
    ordered: int = 0,
    threads: int = 1,
    costs: NDArray[np.float64] | None = None,
) -> EpochPlan:
    """Steps 2-5 of the module docstring for formed micro-batches: shuffle them, complete
    or drop the last chunk, form balanced steps, assign ranks. ``batches`` may be
    extended (split halves, empty micro-batches).

    Args:
        tokens_before: tokens of the run before this epoch; needed with a ramp-up.
        ordered: the first ``ordered`` micro-batches keep their order and go first
            (a sequence-length warmup's stages), unbalanced; the rest are shuffled.
        threads: threads for the kernels that split (the plan is the same for any number).
        costs: the predicted compute of each of ``batches`` when it is known already
            (a resharded plan's micro-batches, whose entries stand for whole micro-batches);
            empty micro-batches added here cost 0. Default: from the entries' lengths.
    """
    if config.has_rampup and tokens_before is None:
        raise ConfigError(
            f"epoch {epoch}: with --rampup the steps depend on the tokens trained before the epoch, "
            "which were not given (resharding a plan built with --rampup is not supported yet)"
        )
    sizing = _StepSizing.of(config, tokens_before or 0, batches)
    # A permutation of the micro-batches after the first `ordered`, with room for the
    # last chunk to be completed in place.
    room = np.empty(batches.count + config.world_size, dtype=np.int64)
    schedule = room[: batches.count]
    schedule[:ordered] = np.arange(ordered)
    permute(epoch_rng(config.seed, epoch, STREAM_MICRO_BATCH_ORDER), schedule[ordered:], first=ordered, threads=threads)
    if config.drop_last:
        if not config.has_rampup:
            schedule, dropped = _drop_last_step(batches, schedule, config, epoch)
        num_full = schedule.shape[0] - schedule.shape[0] % config.world_size
    else:
        num_full = schedule.shape[0] - schedule.shape[0] % config.world_size
        schedule, dropped = _complete_last_chunk(batches, room, batches.count, config.world_size)
    compute = None if config.cost_coefficient is None else _costs_of(batches, config, costs)
    kept = min(num_full, -(-ordered // config.world_size) * config.world_size)  # whole chunks
    # Each scheduled micro-batch's values, gathered once and written where balancing puts them.
    at = _Scheduled.take(schedule, batches, compute, config, kept, num_full, epoch, threads)
    del room, schedule, compute  # taken: their memory serves the rows laid out next
    if config.drop_last and config.has_rampup:
        # The ramp makes step boundaries depend on the order: decide on the final steps.
        step_offsets = _step_offsets(at.tokens[:num_full], config, sizing)
        keep, step_offsets, dropped = _drop_last_ramp_step(batches, at, step_offsets, config, epoch, sizing)
        at = at.head(keep)
    else:
        step_offsets = _step_offsets(at.tokens, config, sizing)
    return _assemble(entries, config, epoch, batches, at, step_offsets, dropped, threads)


def _costs_of(batches: MicroBatches, config: PlanConfig, known: NDArray[np.float64] | None) -> NDArray[np.float64]:
    if known is None:
        return compute_costs(batches, config)
    if batches.count < known.shape[0] or batches.count - known.shape[0] > config.world_size:
        raise ConfigError(f"{known.shape[0]:,} known costs for {batches.count:,} micro-batches")
    return np.concatenate([known.astype(np.float64), np.zeros(batches.count - known.shape[0])])


@dataclasses.dataclass(frozen=True)
class _Scheduled:
    """Micro-batches in schedule order, each with what the later stages need of it."""

    batch: NDArray[np.int64]  # micro-batch id
    tokens: NDArray[np.int64]
    sizes: NDArray[np.int64]  # entries
    compute: NDArray[np.float64] | None  # predicted compute, with a cost coefficient
    by_compute: bool  # balance ranks by compute, else by tokens
    buffer: NDArray[np.int64]  # where batch, tokens and sizes live: scratch once rows are laid out

    @classmethod
    def take(
        cls, schedule, batches: MicroBatches, compute, config: PlanConfig, begin: int, end: int, epoch: int, threads: int
    ) -> _Scheduled:
        """What each micro-batch of ``schedule`` needs, gathered once, with step 3 of the
        module docstring applied to positions ``begin:end`` (whole chunks): chunks of
        ``world_size`` micro-batches of similar cost within windows of ``balance_window``
        chunks, the chunks shuffled; ``balance_window`` 1 keeps the (already random) order,
        and LPT balances inside each step."""
        by_compute = config.balance == "compute"
        values = np.zeros(0, dtype=np.float64) if compute is None else compute
        window = 0 if config.balance_window == 1 else config.balance_window * config.world_size
        num_chunks = (end - begin) // config.world_size if window else 0
        chunk_order = epoch_rng(config.seed, epoch, STREAM_CHUNK_ORDER).permutation(num_chunks)
        out = np.empty((3, schedule.shape[0]), dtype=np.int64)  # numpy: huge pages for the scattered writes
        out_values = np.empty(schedule.shape[0] if compute is not None else 0, dtype=np.float64)
        table = batches.token_table()
        run_in_parts(
            take_scheduled, threads,
            schedule, begin, end, window, chunk_order, config.world_size, table, values, by_compute, config.max_tokens,
            out, out_values,
        )  # fmt: skip
        return cls(out[0], out[1], out[2], None if compute is None else out_values, by_compute, out.reshape(-1))

    @property
    def costs(self) -> NDArray:
        """What ranks are balanced by (integer tokens sort and add up as their float values)."""
        return self.compute if self.by_compute else self.tokens

    def head(self, count: int) -> _Scheduled:
        """The first ``count`` positions."""
        compute = None if self.compute is None else self.compute[:count]
        return _Scheduled(
            self.batch[:count], self.tokens[:count], self.sizes[:count], compute, self.by_compute, self.buffer
        )


@dataclasses.dataclass(frozen=True)
class _StepSizing:
    """What a ramp-up needs to size an epoch's steps."""

    tokens_before: int  # tokens of the run before the epoch
    full_step: float  # tokens per step once the ramp is over (0.0 without a ramp)

    @classmethod
    def of(cls, config: PlanConfig, tokens_before: int, batches: MicroBatches) -> _StepSizing:
        """The target is ``tokens_per_step``; with ``micro_batches`` M, the mean tokens of a
        step of M micro-batches per rank, from the micro-batches as formed (before the last
        chunk is completed or dropped, so the drop decision sees the same steps)."""
        full = 0.0
        if config.has_rampup:
            if config.tokens_per_step is not None:
                full = float(config.tokens_per_step)
            else:
                mean = float(batches.tokens().sum()) / max(batches.count, 1)
                full = mean * config.world_size * config.micro_batches_per_step
        return cls(int(tokens_before), full)

    def target(self, config: PlanConfig, done: int) -> float:
        """Tokens wanted for a step that begins after ``done`` tokens of the run."""
        return float(ramp_target(done, float(config.rampup_start), self.full_step, config.rampup_tokens))


def _complete_last_chunk(batches: MicroBatches, room, count: int, world_size: int):
    """Make the scheduled count a multiple of world_size: split micro-batches, then add empties.

    The schedule is ``room[:count]``; ``room`` holds ``world_size`` more, so the completed
    schedule is written in place. Returns the new schedule and the (no) entries dropped.
    """
    schedule = room[:count]
    full = count - count % world_size
    no_drop = np.zeros(0, dtype=np.int64)
    if full == count:
        return schedule, no_drop
    # The last chunk as (start, end, lengths): split the largest in two until every rank
    # has one, then add empties; appended to the micro-batches at once.
    last = schedule[full:]
    pairs = [
        (int(start), int(end), lengths)
        for start, end, (_, lengths) in zip(*batches.bounds(last), batches.ranges(last))
    ]
    while len(pairs) < world_size:
        splittable = [i for i, (start, end, _) in enumerate(pairs) if end - start > 1]
        if not splittable:
            break
        largest = max(splittable, key=lambda i: int(pairs[i][2].sum()))
        start, end, lengths = pairs.pop(largest)
        cut = _halving_point(lengths)
        pairs += [(start, start + cut, lengths[:cut]), (start + cut, end, lengths[cut:])]
    tokens = [int(lengths.sum()) for _, _, lengths in pairs] + [0] * (world_size - len(pairs))
    pairs = [(start, end) for start, end, _ in pairs] + [(0, 0)] * (world_size - len(pairs))
    last = batches.extend(np.array(pairs, dtype=np.int64).reshape(-1, 2), np.array(tokens, dtype=np.int64))
    completed = room[: full + world_size]
    completed[full:] = last
    return completed, no_drop


def _drop_last_step(batches: MicroBatches, schedule, config: PlanConfig, epoch: int):
    """Drop the micro-batches of an incomplete final step (``drop_last``).

    Incomplete: fewer than ``micro_batches`` per rank, or, with a token target, a last
    step that would still have taken another (average) chunk. Returns the kept schedule
    and the dropped entries.
    """
    world_size = config.world_size
    full = schedule.shape[0] - schedule.shape[0] % world_size
    per_step = config.micro_batches_per_step
    if per_step is not None:
        keep = full - full % (world_size * per_step)
    else:
        tokens = batches.tokens()[schedule[:full]]
        step_offsets = _step_offsets(tokens, config, _StepSizing(0, 0.0))
        keep = full
        if step_offsets.shape[0] > 1:
            last_step = int(tokens[step_offsets[-2] :].sum())
            next_chunk = tokens.sum() / max(1, full // world_size)
            if abs(last_step + next_chunk - config.tokens_per_step) < abs(last_step - config.tokens_per_step):
                keep = int(step_offsets[-2])
    _check_keeps_some(keep, schedule.shape[0], config, epoch)
    return schedule[:keep], batches.members_of(schedule[keep:])


def _drop_last_ramp_step(batches: MicroBatches, at: _Scheduled, step_offsets, config: PlanConfig, epoch: int, sizing):
    """``drop_last`` under a ramp-up, on the final steps over the whole chunks of the
    schedule: drop the partial chunk, and the last step if it is incomplete (see
    `_last_step_incomplete`). Returns how many to keep, their step offsets, the dropped entries."""
    tokens = at.tokens[: step_offsets[-1]]
    keep = int(step_offsets[-1])
    if step_offsets.shape[0] > 1 and _last_step_incomplete(tokens, step_offsets, config, sizing):
        keep, step_offsets = int(step_offsets[-2]), step_offsets[:-1]
    _check_keeps_some(keep, at.batch.shape[0], config, epoch)
    return keep, step_offsets, batches.members_of(at.batch[keep:])


def _check_keeps_some(keep: int, count: int, config: PlanConfig, epoch: int) -> None:
    if keep == 0:
        raise DatasetError(
            f"--drop-last would drop all {count:,} micro-batches of epoch {epoch}: they do "
            f"not fill one step of {config.world_size} ranks; use fewer ranks or micro-batches per step, "
            "or leave out --drop-last"
        )


def _last_step_incomplete(tokens, step_offsets, config: PlanConfig, sizing: _StepSizing) -> bool:
    """Under a ramp-up, would the last step have taken another (average) chunk: fewer than
    ``micro_batches`` per rank once the ramp is over, or (during the ramp, or with a
    token target) further from its target than with one more chunk."""
    world_size = config.world_size
    begin = int(step_offsets[-2])
    chunks = (tokens.shape[0] - begin) // world_size
    per_step = config.micro_batches_per_step
    done = sizing.tokens_before + int(tokens[:begin].sum())
    if per_step is not None and (done >= config.rampup_tokens or chunks >= per_step):
        return chunks < per_step
    last_step = int(tokens[begin:].sum())
    next_chunk = tokens.sum() / max(1, tokens.shape[0] // world_size)
    target = sizing.target(config, done)
    return abs(last_step + next_chunk - target) < abs(last_step - target)


def _halving_point(lengths: NDArray[np.int32]) -> int:
    """Where to cut a micro-batch into a prefix and a suffix of about equal tokens (both non-empty)."""
    cumulative = np.cumsum(lengths)
    cut = int(np.searchsorted(cumulative, cumulative[-1] / 2))
    return min(max(cut, 1), lengths.shape[0] - 1)


def _step_offsets(tokens: NDArray[np.int64], config: PlanConfig, sizing: _StepSizing) -> NDArray[np.int64]:
    """Step boundaries over the (shuffled) micro-batches; each step a whole number of chunks."""
    world_size = config.world_size
    num_chunks = tokens.shape[0] // world_size
    per_step = config.micro_batches_per_step
    if per_step is not None and not config.has_rampup:
        chunk_offsets = np.append(np.arange(0, num_chunks, per_step), num_chunks)
        if num_chunks == 0:
            chunk_offsets = np.zeros(1, dtype=np.int64)
    else:
        # shape (num_chunks, world_size): one micro-batch per rank in each chunk
        chunk_tokens = tokens.reshape(num_chunks, world_size).sum(axis=1)
        if config.has_rampup:
            chunk_offsets = ramp_steps(
                chunk_tokens, sizing.tokens_before, float(config.rampup_start), sizing.full_step,
                config.rampup_tokens, per_step or 0,
            )  # fmt: skip
        else:
            chunk_offsets = steps_by_tokens(chunk_tokens, config.tokens_per_step)
    return chunk_offsets.astype(np.int64) * world_size


def _assemble(
    entries, config, epoch, batches: MicroBatches, at: _Scheduled, step_offsets, dropped, threads: int
) -> EpochPlan:
    """Assign ranks in each step, order micro-batches by (rank, step, micro), and compute
    the per-row columns (`batchplan.kernels.assemble.lay_out_rows`)."""
    world_size = config.world_size
    no_values = np.zeros(0, dtype=np.int64)
    loss = no_values if entries.loss_is_length_minus_one else batches.entry_sums(entries.loss_tokens)[at.batch]
    compute = np.zeros(0, dtype=np.float64) if at.compute is None else at.compute
    rows = np.empty((4, step_offsets[-1]), dtype=np.int64)  # numpy: huge pages for the scattered writes
    cost = np.empty(step_offsets[-1] if at.compute is not None else 0, dtype=np.float64)
    rank_rows = np.empty((3, step_offsets[-1] // world_size), dtype=np.int64)
    step_sums = np.zeros((2, step_offsets.shape[0] - 1), dtype=np.int64)
    run_in_parts(
        lay_out_rows, threads,
        step_offsets, at.costs, at.batch, at.tokens, at.sizes, loss, compute, world_size, rows, cost, rank_rows, step_sums,
    )  # fmt: skip
    step, micro, num_micro = rank_rows[0], rank_rows[1].astype(np.int32), rank_rows[2].astype(np.int32)
    step_tokens, step_loss_tokens = step_sums
    batch_of_row, tokens, loss_tokens, sizes = rows
    # The schedule's arrays are dead once the rows are laid out: their memory (already
    # faulted in, unlike a new array's) serves the layout as scratch.
    offsets, members = batches.gather(batch_of_row, sizes, threads, scratch=at.buffer)
    padded = sizes * batches.longest()[batch_of_row] if config.mode == "pad" else tokens
    return EpochPlan(
        epoch=epoch,
        world_size=world_size,
        offsets=offsets,
        members=members,
        rank_step=step,
        rank_micro=micro,
        rank_num_micro=num_micro,
        tokens=tokens,
        loss_tokens=loss_tokens,
        padded_tokens=padded,
        cost=None if at.compute is None else cost,
        step_tokens=step_tokens,
        step_loss_tokens=step_loss_tokens,
        dropped_entries=dropped,
    )
