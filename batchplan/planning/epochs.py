"""Plan every epoch: the pipeline of a build, stage by stage.

Per epoch, with randomness only from `batchplan.planning.randomness`:

1. form micro-batches (`forming`): ``pack`` = best-fit decreasing with seeded
   tie-breaking (entries of equal length taken in a seeded random order);
   ``pad`` = seeded shuffle, sort inside windows, greedy cut (count x longest <= cap);
2. shuffle them, and complete the epoch's last round (one micro-batch per rank) by
   splitting micro-batches and adding empty ones, or drop the incomplete final step
   under ``drop_last`` (`epoch_end`);
3. form rounds of similar cost within windows of ``balance_window`` rounds (cost =
   tokens, or tokens + attention), and shuffle them (`schedule`);
4. cut steps from consecutive rounds (`steps`): a fixed number per step, or as many as
   bring the step closest to a token target; with a ramp-up the target grows with the
   tokens of the run before the step, so epoch ``e`` needs the tokens of the epochs
   before it (exact up front: each epoch holds every token once, unless ``drop_last``);
5. inside each step, give micro-batches to ranks (equal counts, balanced cost), and lay
   out the rows ordered by (rank, step, micro) (`schedule`).

A sequence-length warmup (`warmup`) changes epoch 0 only: its first tokens are pieces
cut to a growing cap, formed into micro-batches stage by stage and scheduled first, in
stage order, ahead of the rest of the epoch. Cost: O(n log C) to pack, O(n) for the
rest, per epoch; epochs run side by side on the cores (`threads`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig, num_threads
from batchplan.errors import DatasetError
from batchplan.plan import Entries, EpochPlan, Plan
from batchplan.planning.entries import make_entries
from batchplan.planning.forming import form_micro_batches, form_warmup_micro_batches
from batchplan.planning.mixture_epochs import MixtureEntries, plan_mixture_epoch
from batchplan.planning.randomness import STREAM_ENTRY_ORDER, STREAM_SEQLEN_WARMUP, epoch_rng
from batchplan.planning.schedule import schedule_epoch
from batchplan.planning.threads import epoch_threads
from batchplan.planning.warmup import SeqlenWarmup, add_warmup_pieces

__all__ = ["PreparedEntries", "build_plan", "plan_epoch", "plan_epochs", "prepare_entries"]


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
    prepared = prepare_entries(lengths, config, loss_tokens=loss_tokens)
    epochs = []
    for epoch in plan_epochs(prepared, config):
        epochs.append(epoch)
        if on_epoch is not None:
            on_epoch(epoch.epoch)
    return Plan(config=config, num_samples=prepared.num_samples, entries=prepared.entries, epochs=tuple(epochs))


@dataclasses.dataclass(frozen=True)
class PreparedEntries:
    """What every epoch is planned from: the entries (with epoch 0's warmup pieces, if any),
    or a mixture's entries with each epoch's part of every source."""

    num_samples: int
    entries: Entries
    warmup: SeqlenWarmup | None
    mixture: MixtureEntries | None = None

    @classmethod
    def of_mixture(cls, num_samples: int, mixture: MixtureEntries) -> PreparedEntries:
        return cls(num_samples, mixture.entries, None, mixture)

    def tokens_before_epochs(self, epochs: int) -> NDArray[np.int64]:
        """Shape (epochs + 1,): tokens of the run before each epoch (and in all), when every
        epoch holds its entries once (without drop_last)."""
        if self.mixture is not None:
            per_epoch = [self.mixture.epoch_tokens(epoch) for epoch in range(epochs)]
        else:
            num_base = self.entries.num_entries if self.warmup is None else self.warmup.num_base
            per_epoch = [int(self.entries.length[:num_base].sum(dtype=np.int64))] * epochs
        before = np.zeros(epochs + 1, dtype=np.int64)
        np.cumsum(per_epoch, out=before[1:])
        return before


def prepare_entries(
    lengths: NDArray[np.integer], config: PlanConfig, *, loss_tokens: NDArray[np.integer] | None = None
) -> PreparedEntries:
    """The entries of ``lengths`` under ``config``'s policies, and the warmup's pieces.

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
    return PreparedEntries(int(lengths.shape[0]), entries, warmup)


def plan_epochs(prepared: PreparedEntries, config: PlanConfig, epochs: range | None = None) -> Iterator[EpochPlan]:
    """Plan ``epochs`` (default: all), yielding each in order as soon as it is planned.

    Epochs are independent (own seeds) and the kernels release the GIL: they are planned
    on all cores, at most as many at once as planned side by side (so memory holds those,
    plus the one the caller holds), and the result does not depend on the number of
    threads or on which epochs are asked for. A ramp-up needs the tokens before each
    epoch: known up front (an epoch holds every entry once), except under drop_last,
    where the epochs that begin inside the ramp are planned in order first (also those
    before ``epochs``, which are not yielded).
    """
    wanted = range(config.epochs) if epochs is None else epochs
    before = prepared.tokens_before_epochs(config.epochs)
    epoch, tokens_before = 0, 0
    if config.has_rampup and config.drop_last:
        assert config.rampup_tokens is not None  # has_rampup: the pair is set
        while epoch < wanted.stop and tokens_before < config.rampup_tokens:
            planned = _plan_prepared(prepared, config, epoch, tokens_before, num_threads())
            tokens_before += int(planned.step_tokens.sum())
            epoch += 1
            if planned.epoch in wanted:
                yield planned
    # Past the ramp (or without drop_last, exactly) epoch e starts at
    # tokens_before + (tokens of epochs epoch..e-1); past the ramp the value does not matter.
    todo = [e for e in wanted if e >= epoch]
    at_once, threads = epoch_threads(len(todo), num_threads())
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        running: collections.deque = collections.deque()
        for e, share in zip(todo, threads):
            if len(running) == at_once:
                yield running.popleft().result()
            start = tokens_before + int(before[e] - before[epoch])
            running.append(pool.submit(_plan_prepared, prepared, config, e, start, share))
        while running:
            yield running.popleft().result()


def _plan_prepared(prepared: PreparedEntries, config: PlanConfig, epoch: int, tokens_before: int, threads: int):
    if prepared.mixture is not None:
        return plan_mixture_epoch(prepared.mixture, config, epoch, tokens_before=tokens_before, threads=threads)
    return plan_epoch(
        prepared.entries, config, epoch, tokens_before=tokens_before, warmup=prepared.warmup, threads=threads
    )


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
    return schedule_epoch(
        entries, batches, config, epoch, tokens_before=tokens_before, ordered=ordered, threads=threads
    )
