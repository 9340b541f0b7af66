"""Plan one batch inside the training loop: run-time lengths in, each rank's micro-batches out.

For reinforcement learning (GRPO, PPO) and dynamic batching, where a step's sequences and
their lengths exist only once the rollout is done. `plan_batch` splits one global batch
into micro-batches per data-parallel rank with the offline plan's guarantees
(`tests/test_plan_batch.py` checks each on hypothesis-generated batches):

- every micro-batch holds at most ``max_tokens`` tokens;
- every rank runs the same number of micro-batches (an empty one only where a rank has
  fewer samples, or groups, than micro-batches);
- every sample is in exactly one micro-batch (an oversize sample is an error naming it, or
  is split into pieces of ``max_tokens`` with ``oversize="split"``);
- a group (a prompt's generations, a preference pair) stays in one micro-batch when its
  tokens fit, and on one rank otherwise;
- the same input and seed give the same plan;
- predicted cost (tokens + attention term, `batchplan.planning.cost`) is balanced across
  ranks: the busiest rank carries at most the mean plus the costliest group or sample
  (longest processing time first, Graham's bound, then exchanges that only lower it), so
  max/mean <= 1.03 whenever no group costs over 3 % of a rank's mean; ``balance_bound`` is
  a lower bound for any plan.

This module checks the arguments and makes the entries (samples, or their pieces) ordered
by item (a group, or one sample); `batchplan.kernels.batch.split_batch` does the rest in
one compiled call (ranks, units, packing, equal counts, lay-out) and
`batchplan.planning.batch_result` holds the result. O(n log n); the time of 65,536
sequences on 512 ranks and of a first call in a fresh process are in docs/benchmarks.md
(`bench/online.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from batchplan.errors import ConfigError, DatasetError
from batchplan.kernels.batch import split_batch
from batchplan.planning.batch_result import BatchPlan, RankMicroBatches
from batchplan.planning.cost import attention_coefficient as coefficient_of
from batchplan.planning.randomness import batch_rng

__all__ = ["BatchPlan", "RankMicroBatches", "plan_batch"]

OVERSIZE_POLICIES = ("error", "split")
# The exchanges after longest processing time first (`batchplan.kernels.exchange`): at most
# EXCHANGE_ROUNDS x world_size splits, first of the EXCHANGE_POOL cheapest items of each of
# two ranks (more where that does not help), with up to EXCHANGE_TRIES least-loaded
# partners for the busiest rank ...
EXCHANGE_ROUNDS = 4
EXCHANGE_POOL = 16
EXCHANGE_TRIES = 4
# ... and stop once the busiest rank is within this fraction of the mean (or at the mean
# rounded up, where costs are whole tokens): 0.1 parts per billion, far below what a cost
# model predicts, where further rounds would cost time for nothing.
EXCHANGE_GOOD_ENOUGH = 1e-10


@dataclass(frozen=True)
class _Entries:
    """What micro-batches hold, ordered by item: a sample, or a piece of one (``start``)."""

    sample: NDArray[np.int64] | None  # None: entry k is sample k
    start: NDArray[np.int64] | None
    length: NDArray[np.int64]
    loss: NDArray[np.int64]
    item_offsets: NDArray[np.int64]  # item k's entries: item_offsets[k]:item_offsets[k + 1]


def plan_batch(
    lengths: NDArray[np.integer],
    world_size: int,
    max_tokens: int,
    *,
    loss_tokens: NDArray[np.integer] | None = None,
    groups: NDArray[np.integer] | None = None,
    hidden_size: int | None = None,
    attention_coefficient: float | None = None,
    micro_batches: int | None = None,
    oversize: str = "error",
    seed: int = 0,
) -> BatchPlan:
    """Split one batch of sequences into micro-batches on ``world_size`` ranks.

    Args:
        lengths: tokens of each sequence (>= 1).
        world_size: data-parallel ranks.
        max_tokens: most tokens in one micro-batch (packed: the sum of its lengths).
        loss_tokens: tokens that carry a label per sequence (default ``length - 1``: a
            causal shift inside each sequence; RL: the response tokens).
        groups: a label per sequence; sequences with the same label form a group that stays
            in one micro-batch when it fits, and on one rank otherwise.
        hidden_size: model width: the attention term of the cost, ``L^2 / (12 h)`` per
            sequence (`batchplan.planning.cost`).
        attention_coefficient: that term's coefficient given directly, instead of
            ``hidden_size``; with neither, cost is tokens.
        micro_batches: micro-batches per rank; None: the fewest the packing needs.
        oversize: ``"error"`` (a sequence above ``max_tokens`` is an error naming it) or
            ``"split"`` (it becomes pieces of ``max_tokens``, each trained as its own
            sequence, all on one rank).
        seed: decides among equal choices (which of equal-length sequences go together);
            pass the training step for a different, equally good plan each step.

    Raises:
        ConfigError: an argument out of range. DatasetError: a length or loss count breaks
            a rule, or ``micro_batches`` is too few for the tokens a rank holds.
    """
    coefficient = _check_arguments(world_size, max_tokens, hidden_size, attention_coefficient, micro_batches, oversize)
    world_size, max_tokens = int(world_size), int(max_tokens)
    lengths = _as_counts(lengths, "lengths")
    entries = _make_entries(lengths, max_tokens, oversize, _loss_of(lengths, loss_tokens), groups)
    shuffled = batch_rng(seed).permutation(entries.item_offsets.shape[0] - 1)
    wanted = 0 if micro_batches is None else int(micro_batches)
    exchange = (EXCHANGE_ROUNDS, EXCHANGE_POOL, EXCHANGE_TRIES, EXCHANGE_GOOD_ENOUGH)
    split = split_batch(
        entries.length,
        entries.loss,
        entries.item_offsets,
        shuffled,
        coefficient,
        groups is None,
        world_size,
        max_tokens,
        wanted,
        exchange,
    )
    return _result(entries, split, world_size, max_tokens, wanted)


def _result(entries: _Entries, split, world_size: int, max_tokens: int, wanted: int) -> BatchPlan:
    """The plan from `split_batch`'s arrays (an error where ``micro_batches`` is too few)."""
    order, offsets, tokens, loss, costs, needed, item_costs = split
    if wanted and needed > wanted:
        raise DatasetError(
            f"a rank needs {needed} micro-batches of max_tokens {max_tokens:,} for its share of the batch "
            f"({int(entries.length.sum()):,} tokens on {world_size} ranks) but micro_batches is {wanted}; "
            f"pass micro_batches >= {needed} or None, or raise max_tokens"
        )
    num_micro = wanted or int(needed)
    tokens, loss, costs = (x.reshape(world_size, num_micro) for x in (tokens, loss, costs))
    rank_costs = costs.sum(axis=1)
    balance, bound = _balance(rank_costs, item_costs, world_size)
    return BatchPlan(
        samples=order if entries.sample is None else entries.sample[order],
        offsets=offsets,
        spans=None if entries.start is None else np.stack((entries.start[order], entries.length[order]), axis=1),
        tokens=tokens,
        loss_tokens=loss,
        costs=costs,
        rank_costs=rank_costs,
        step_tokens=int(tokens.sum()),
        step_loss_tokens=int(loss.sum()),
        num_micro=num_micro,
        balance=balance,
        balance_bound=bound,
    )


def _check_arguments(world_size, max_tokens, hidden_size, attention_coefficient, micro_batches, oversize) -> float:
    """The attention coefficient the arguments ask for (0.0: cost is tokens)."""
    for name, value in (("world_size", world_size), ("max_tokens", max_tokens)):
        if int(value) != value or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    if micro_batches is not None and (int(micro_batches) != micro_batches or micro_batches < 1):
        raise ConfigError(f"micro_batches must be an integer >= 1 or None, got {micro_batches!r}")
    if oversize not in OVERSIZE_POLICIES:
        raise ConfigError(f"oversize must be one of {', '.join(OVERSIZE_POLICIES)}, got {oversize!r}")
    if hidden_size is not None and attention_coefficient is not None:
        raise ConfigError("pass hidden_size or attention_coefficient, not both (the coefficient is 1 / (12 h))")
    if hidden_size is not None:
        if int(hidden_size) != hidden_size or hidden_size < 1:
            raise ConfigError(f"hidden_size must be an integer >= 1, got {hidden_size!r}")
        return coefficient_of(int(hidden_size))
    if attention_coefficient is not None:
        if not np.isfinite(attention_coefficient) or attention_coefficient < 0:
            raise ConfigError(f"attention_coefficient must be a finite number >= 0, got {attention_coefficient!r}")
        return float(attention_coefficient)
    return 0.0


def _as_counts(values, name: str) -> NDArray[np.int64]:
    """int64, contiguous and writeable (a copy only where needed): the one array type the
    kernel is compiled for, so a read-only or strided input loads no other specialisation."""
    array = np.asarray(values)
    if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise DatasetError(f"{name} must be a 1-D array of integers, got shape {array.shape} of {array.dtype}")
    return np.require(array, dtype=np.int64, requirements=["C", "W"])


def _loss_of(lengths: NDArray[np.int64], loss_tokens) -> NDArray[np.int64] | None:
    """Each sequence's loss tokens as given, checked against its length (None: ``length - 1``)."""
    bad = np.flatnonzero(lengths < 1)
    if bad.size:
        first = int(bad[0])
        raise DatasetError(
            f"{bad.size:,} sequences have fewer than 1 token (sequence {first:,}: {int(lengths[first]):,}); "
            "leave empty sequences out of the batch"
        )
    if loss_tokens is None:
        return None
    loss = _as_counts(loss_tokens, "loss_tokens")
    if loss.shape != lengths.shape:
        raise DatasetError(
            f"loss_tokens has {loss.shape[0]:,} values for {lengths.shape[0]:,} lengths; give one per sequence"
        )
    bad = np.flatnonzero((loss < 0) | (loss > lengths))
    if bad.size:
        first = int(bad[0])
        raise DatasetError(
            f"sequence {first:,} has {int(loss[first]):,} loss tokens but {int(lengths[first]):,} tokens; "
            "loss tokens must be in 0..length"
        )
    return loss


def _make_entries(lengths, max_tokens: int, oversize: str, loss, groups) -> _Entries:
    """Entries ordered by item (group, or sequence without groups), within it by sequence."""
    count = lengths.shape[0]
    oversized = np.flatnonzero(lengths > max_tokens)
    if oversized.size and oversize == "error":
        first = int(oversized[0])
        raise DatasetError(
            f"{oversized.size:,} sequences are longer than max_tokens {max_tokens:,} (sequence {first:,} has "
            f"{int(lengths[first]):,} tokens); raise max_tokens or pass oversize='split'"
        )
    if oversized.size and loss is not None:
        raise DatasetError(
            f"oversize='split' cannot keep an exact loss-token count with loss_tokens: {oversized.size:,} "
            f"sequences exceed max_tokens {max_tokens:,} and where their labelled tokens lie is unknown; "
            "raise max_tokens"
        )
    item = _item_of_sequence(groups, count)
    if item is None and not oversized.size:  # one entry per item, each its sample: no copies
        entry_loss = lengths - 1 if loss is None else loss
        start = np.zeros(count, dtype=np.int64) if oversize == "split" else None
        return _Entries(None, start, lengths, entry_loss, np.arange(count + 1, dtype=np.int64))
    sample = np.arange(count, dtype=np.int64) if item is None else np.argsort(item, kind="stable")
    length = lengths[sample]
    start = np.zeros(count, dtype=np.int64) if oversize == "split" else None
    if oversized.size:
        pieces = (length + max_tokens - 1) // max_tokens
        # shape (entries,): index of each piece within its sequence
        piece = np.arange(int(pieces.sum()), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        start = piece * max_tokens
        sample = np.repeat(sample, pieces)
        length = np.minimum(max_tokens, np.repeat(length, pieces) - start)
    entry_loss = length - 1 if loss is None else loss[sample]
    labels = sample if item is None else item[sample]
    item_offsets = np.zeros(1, dtype=np.int64)  # no entries: no items
    if sample.shape[0]:
        item_offsets = np.concatenate(([0], np.flatnonzero(np.diff(labels)) + 1, [sample.shape[0]])).astype(np.int64)
    return _Entries(sample, start, length, entry_loss, item_offsets)


def _item_of_sequence(groups, count: int) -> NDArray[np.int64] | None:
    """Each sequence's group as 0..groups-1 (None: every sequence on its own)."""
    if groups is None:
        return None
    labels = np.asarray(groups)
    if labels.shape != (count,):
        raise DatasetError(f"groups has shape {labels.shape} for {count:,} lengths; give one label per sequence")
    return np.unique(labels, return_inverse=True)[1].astype(np.int64).reshape(count)


def _balance(rank_costs, item_costs, world_size: int) -> tuple[float, float]:
    """max/mean of the ranks' costs, and a lower bound on it for any plan: the mean, the
    costliest item, and the two items that share a rank among the ``world_size + 1``
    costliest (items are indivisible: a group that does not fit still stays on one rank)."""
    mean = float(item_costs.sum()) / world_size
    if mean <= 0:
        return 1.0, 1.0
    count = item_costs.shape[0]
    top = min(world_size + 1, count)
    largest = -np.sort(-np.partition(item_costs, count - top)[count - top :])
    bound = max(mean, float(largest[0]))
    if largest.shape[0] > world_size:
        bound = max(bound, float(largest[world_size - 1] + largest[world_size]))
    return float(rank_costs.max()) / mean, bound / mean
