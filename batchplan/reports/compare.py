"""How much a plan saves: batchplan against the batching people use today, same lengths.

Five strategies plan one epoch of the same samples, in memory, under the same memory
budget per micro-batch (``max_tokens``):

1. ``pytorch``: random order, ``n`` samples per micro-batch, padded to the longest
   (``DataLoader(batch_size=n, shuffle=True)``, the PyTorch default);
2. ``hf_grouped``: Hugging Face ``group_by_length`` megabatches of ``50 n`` samples,
   sorted by length inside each (``transformers.trainer_pt_utils.get_length_grouped_indices``);
3. ``fairseq``: all samples sorted by length, cut greedily so that count x longest
   <= max_tokens, batches shuffled (``fairseq.data.data_utils.batch_by_size``);
4. ``batchplan_pad`` and 5. ``batchplan_pack``: `build_plan` in each mode, balancing
   ranks by compute for the given model width.

Baselines 1-2 use ``n = max_tokens // longest`` so that their largest micro-batch fits
``max_tokens``; 3-5 cap every micro-batch at ``max_tokens`` (pad: count x longest; pack:
sum). Samples longer than ``max_tokens`` go through the same oversize policy for all.

Steps: baselines deal micro-batch ``k`` to rank ``k mod W`` and consecutive groups of
``W x M`` micro-batches form a step (DistributedSampler / accelerate / fairseq shard
round-robin); a rank with nothing left in the last step idles. batchplan plans use
their own steps and ranks. Metrics, per strategy:

- ``padding_fraction``: padding / (count x longest) summed over micro-batches (0 in pack);
- ``fill``: real tokens / (micro-batches x max_tokens), over all steps but the epoch's last;
- ``token_imbalance``, ``cost_imbalance``: mean over the same steps of max/mean rank - 1
  (the definitions of `batchplan.reports.statistics`, which ``inspect`` uses too);
- ``epoch_cost``: sum over steps of the slowest rank's cost (`batchplan.planning.cost`), and
  ``relative_time``: that over baseline 1's.

Cost: O(n log n) for the sorts; the 16 M-sample Wikipedia file compares in ~18 s on
two busy cores, 10 s of it the two batchplan builds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from numpy.typing import NDArray

from batchplan.config import Mode, Oversize, PlanConfig
from batchplan.errors import ConfigError, DatasetError
from batchplan.planning.cost import attention_coefficient, micro_batch_costs
from batchplan.planning.entries import make_entries
from batchplan.reduce import segment_max
from batchplan.reports.statistics import last_steps_of, rank_imbalance, regular_steps

__all__ = [
    "DEFAULT_HIDDEN_SIZE",
    "STRATEGIES",
    "Comparison",
    "StrategyResult",
    "batch_fixed_count",
    "batch_length_grouped",
    "batch_sorted_greedy",
    "compare_strategies",
    "measure_strategy",
]

DEFAULT_HIDDEN_SIZE = 4096
# Hugging Face's cap on megabatch size, in batches (get_length_grouped_indices).
HF_MEGABATCH_MULTIPLE = 50
# Random streams of the baselines (batchplan's own streams are 0 and 1).
STREAM_PYTORCH = 100
STREAM_HF = 101
STREAM_FAIRSEQ = 102

STRATEGIES = {
    "pytorch": "PyTorch default: random, fixed n, padded",
    "hf_grouped": "HF group_by_length megabatches",
    "fairseq": "fairseq sorted max-tokens batches",
    "batchplan_pad": "batchplan pad",
    "batchplan_pack": "batchplan pack",
}

Batches = tuple[NDArray[np.int64], NDArray[np.int64]]  # CSR (offsets, members)


@dataclasses.dataclass(frozen=True)
class StrategyResult:
    """One row of the comparison; see the module docstring for each metric."""

    name: str
    label: str
    mode: str  # how a micro-batch is computed: "pad" or "pack"
    micro_batches: int
    steps: int
    samples_per_micro_batch: float
    padding_fraction: float
    fill: float | None  # None: no step but the epoch's last (nothing to average)
    token_imbalance: float | None
    cost_imbalance: float | None
    epoch_cost: float
    relative_time: float = 1.0


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Every strategy on the same entries, with the settings that produced them."""

    num_samples: int
    num_entries: int
    max_tokens: int
    world_size: int
    micro_batches: int
    hidden_size: int
    oversize: str
    oversize_samples: int
    dropped_samples: int
    seed: int
    longest: int
    baseline_batch_size: int
    strategies: tuple[StrategyResult, ...]
    packing_bound: dict[str, Any] | None = None  # the fewest micro-batches any packing of the entries needs

    def to_dict(self) -> dict[str, Any]:
        """All fields as plain JSON-able values."""
        return dataclasses.asdict(self)


def compare_strategies(
    lengths: NDArray[np.integer],
    *,
    max_tokens: int,
    world_size: int,
    micro_batches: int = 1,
    hidden_size: int = DEFAULT_HIDDEN_SIZE,
    oversize: Oversize = "truncate",
    drop_empty: bool = False,
    seed: int = 0,
) -> Comparison:
    """Plan one epoch of ``lengths`` with every strategy and measure each.

    Raises:
        ConfigError: an option is out of range.
        DatasetError: the lengths break the oversize or empty policy.
    """
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
        raise ConfigError(f"`hidden_size` must be a positive integer, got {hidden_size!r}")
    # batchplan's rows balance ranks by compute for this model width (what `hidden_size` does).
    config = PlanConfig(
        max_tokens=max_tokens,
        world_size=world_size,
        micro_batches=micro_batches,
        oversize=oversize,
        drop_empty=drop_empty,
        seed=seed,
        hidden_size=hidden_size,
    )
    lengths = np.asarray(lengths)
    entries = make_entries(lengths, config)
    if entries.num_entries == 0:
        reasons = ", ".join(f"{v.size:,} {k}" for k, v in entries.dropped.items())
        raise DatasetError(f"no samples left to compare: all {lengths.shape[0]:,} were dropped ({reasons})")
    entry_lengths = entries.length.astype(np.int64)
    longest = int(entry_lengths.max())
    batch_size = max(1, max_tokens // longest)
    coefficient = attention_coefficient(hidden_size)
    results = _measure_baselines(entry_lengths, batch_size, config, coefficient)
    bound = None
    modes: tuple[Mode, ...] = ("pad", "pack")
    for mode in modes:
        result, packing = _measure_batchplan(lengths, config, mode, coefficient)
        results.append(result)
        bound = packing or bound
    reference = results[0].epoch_cost
    results = [dataclasses.replace(r, relative_time=r.epoch_cost / reference if reference else 0.0) for r in results]
    return Comparison(
        num_samples=int(lengths.shape[0]),
        num_entries=entries.num_entries,
        max_tokens=max_tokens,
        world_size=world_size,
        micro_batches=config.micro_batches_per_step or 1,
        hidden_size=hidden_size,
        oversize=oversize,
        oversize_samples=int((lengths > max_tokens).sum()),
        dropped_samples=int(sum(v.size for v in entries.dropped.values())),
        seed=seed,
        longest=longest,
        baseline_batch_size=batch_size,
        strategies=tuple(results),
        packing_bound=None
        if bound is None
        else {"micro_batches": bound.bound, "kind": bound.kind, "fill": bound.bound_fill(max_tokens)},
    )


def _measure_baselines(entry_lengths, batch_size: int, config: PlanConfig, coefficient: float) -> list[StrategyResult]:
    from batchplan.planning.randomness import epoch_rng

    seed, world_size = config.seed, config.world_size
    baselines = {
        "pytorch": batch_fixed_count(entry_lengths.size, batch_size, epoch_rng(seed, 0, STREAM_PYTORCH)),
        "hf_grouped": batch_length_grouped(entry_lengths, batch_size, epoch_rng(seed, 0, STREAM_HF)),
        "fairseq": batch_sorted_greedy(entry_lengths, config.max_tokens, epoch_rng(seed, 0, STREAM_FAIRSEQ)),
    }
    results = []
    for name, (offsets, members) in baselines.items():
        step, rank = deal_round_robin(offsets.shape[0] - 1, world_size, world_size * (config.micro_batches or 1))
        results.append(
            measure_strategy(
                name,
                entry_lengths[members],
                offsets,
                step,
                rank,
                mode="pad",
                max_tokens=config.max_tokens,
                world_size=world_size,
                coefficient=coefficient,
            )
        )
    return results


def batch_fixed_count(num_items: int, batch_size: int, rng: np.random.Generator) -> Batches:
    """PyTorch default: a random permutation cut into batches of ``batch_size``.

    ``DataLoader(dataset, batch_size, shuffle=True)`` (``RandomSampler`` + ``BatchSampler``,
    ``drop_last=False``: the last batch may be smaller).
    """
    members = rng.permutation(num_items).astype(np.int64, copy=False)
    offsets = np.append(np.arange(0, num_items, batch_size, dtype=np.int64), num_items)
    return offsets, members


def batch_length_grouped(lengths: NDArray[np.integer], batch_size: int, rng: np.random.Generator) -> Batches:
    """Hugging Face ``group_by_length``: random megabatches, each sorted longest first.

    As ``transformers.trainer_pt_utils.get_length_grouped_indices``: a random permutation
    is cut into megabatches of ``min(n // (4 batch_size), 50) x batch_size`` items (at
    least one batch); each is sorted by length, descending (stable); the longest item
    of all is swapped to the front of the first megabatch (so an out-of-memory error
    shows on step 0); the result is cut into batches of ``batch_size``.
    """
    num_items = int(lengths.shape[0])
    multiple = max(1, min(num_items // (batch_size * 4), HF_MEGABATCH_MULTIPLE))
    megabatch = multiple * batch_size
    order = rng.permutation(num_items).astype(np.int64, copy=False)
    key = _sort_key(lengths, descending=True)[order]
    full = num_items - num_items % megabatch
    # shape (num_megabatches, megabatch): sort each row by length, descending, stable
    rows = np.argsort(key[:full].reshape(-1, megabatch), axis=1, kind="stable")
    rows += np.arange(0, full, megabatch, dtype=np.int64)[:, None]
    tail = full + np.argsort(key[full:], kind="stable")
    members = order[np.concatenate([rows.reshape(-1), tail])]
    heads = np.arange(0, num_items, megabatch)
    if heads.size:
        top = heads[int(np.argmax(lengths[members[heads]]))]
        members[0], members[top] = members[top], members[0]
    offsets = np.append(np.arange(0, num_items, batch_size, dtype=np.int64), num_items)
    return offsets, members


def batch_sorted_greedy(lengths: NDArray[np.integer], max_tokens: int, rng: np.random.Generator) -> Batches:
    """fairseq's ``max_tokens``: sort by length, cut greedily, shuffle the batches.

    As ``fairseq.data.data_utils.batch_by_size`` after ``ordered_indices`` (a random
    permutation stably sorted by length, ascending): an item joins the open batch while
    (count + 1) x longest <= max_tokens, else the batch closes. Then the batch order is
    shuffled (``EpochBatchIterator``). fairseq's ``required_batch_size_multiple`` is 1 here,
    like batchplan's default ``batch_multiple``. Every length must be in 1..max_tokens.

    Runs per distinct length rather than per item: O(n log n) for the sort.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    permutation = rng.permutation(lengths.shape[0]).astype(np.int64, copy=False)
    order = permutation[np.argsort(_sort_key(lengths, descending=False)[permutation], kind="stable")]
    histogram = np.bincount(lengths)
    values = np.flatnonzero(histogram)  # the distinct lengths, ascending
    counts = histogram[values]
    sizes = _greedy_batch_sizes(values, counts, max_tokens)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    shuffled = rng.permutation(sizes.shape[0])
    return reorder_batches(offsets, order, shuffled)


def _greedy_batch_sizes(values: NDArray[np.int64], counts: NDArray[np.int64], max_tokens: int) -> NDArray[np.int64]:
    """Sizes of the greedy batches over items sorted ascending, ``counts[i]`` of length ``values[i]``."""
    sizes: list[NDArray[np.int64]] = []
    open_count = 0  # items in the open batch, all no longer than the current length
    for length, count in zip(values.tolist(), counts.tolist()):
        capacity = max_tokens // length  # the most items of this length one batch holds
        taken = min(count, max(capacity - open_count, 0))
        open_count += taken
        count -= taken
        if count == 0:
            continue
        sizes.append(np.array([open_count], dtype=np.int64))
        full, open_count = divmod(count, capacity)
        sizes.append(np.full(full, capacity, dtype=np.int64))
    if open_count:
        sizes.append(np.array([open_count], dtype=np.int64))
    return np.concatenate([np.zeros(0, dtype=np.int64), *sizes])


def _sort_key(lengths: NDArray[np.integer], *, descending: bool) -> NDArray[np.unsignedinteger]:
    """Lengths as the narrowest unsigned key (numpy radix-sorts 16-bit keys in O(n))."""
    lengths = np.asarray(lengths, dtype=np.int64)
    top = int(lengths.max()) if lengths.size else 0
    key = top - lengths if descending else lengths
    return key.astype(np.uint16 if top < 2**16 else np.uint32)


def reorder_batches(offsets: NDArray[np.int64], members: NDArray[np.int64], order: NDArray[np.int64]) -> Batches:
    """The CSR batches in a new order: batch ``i`` of the result is batch ``order[i]``."""
    counts = np.diff(offsets)[order]
    new_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    # shape (total,): source position of each new position
    source = np.repeat(offsets[:-1][order] - new_offsets[:-1], counts) + np.arange(new_offsets[-1])
    return new_offsets, members[source]


def deal_round_robin(num_micro_batches: int, world_size: int, per_step: int) -> tuple[NDArray, NDArray]:
    """Step and rank of each micro-batch when batches are dealt to ranks in turn."""
    index = np.arange(num_micro_batches, dtype=np.int64)
    return index // per_step, index % world_size


def measure_strategy(
    name: str,
    entry_lengths: NDArray[np.integer],
    offsets: NDArray[np.integer],
    step: NDArray[np.int64],
    rank: NDArray[np.integer],
    *,
    mode: str,
    max_tokens: int,
    world_size: int,
    coefficient: float,
) -> StrategyResult:
    """The metrics of micro-batches ``entry_lengths[offsets[k]:offsets[k + 1]]`` run at (step, rank).

    ``mode`` says what a micro-batch computes: ``pad`` count x longest, ``pack`` the sum.
    """
    entry_lengths = np.asarray(entry_lengths, dtype=np.int64)
    counts = np.diff(offsets)
    total = np.concatenate([[0], np.cumsum(entry_lengths)])
    tokens = total[offsets[1:]] - total[offsets[:-1]]
    cost = micro_batch_costs(entry_lengths, offsets, mode, coefficient)
    computed = tokens if mode == "pack" else counts * segment_max(entry_lengths, offsets)
    num_steps = int(step.max()) + 1 if step.size else 0
    slot = step * world_size + rank
    # shape (num_steps, world_size): per rank and step
    rank_tokens = np.bincount(slot, weights=tokens, minlength=num_steps * world_size).reshape(num_steps, world_size)
    rank_cost = np.bincount(slot, weights=cost, minlength=num_steps * world_size).reshape(num_steps, world_size)
    num_micro = int(counts.shape[0])
    last = last_steps_of([num_steps])
    regular = regular_steps(num_steps, last)[step]  # per micro-batch
    capacity = int(regular.sum()) * max_tokens
    return StrategyResult(
        name=name,
        label=STRATEGIES.get(name, name),
        mode=mode,
        micro_batches=num_micro,
        steps=num_steps,
        samples_per_micro_batch=float(counts.sum() / max(1, int((counts > 0).sum()))),
        padding_fraction=float(1.0 - tokens.sum() / computed.sum()) if computed.sum() else 0.0,
        fill=float(tokens[regular].sum() / capacity) if capacity else None,
        token_imbalance=rank_imbalance(rank_tokens, last).mean,
        cost_imbalance=rank_imbalance(rank_cost, last).mean,
        epoch_cost=float(rank_cost.max(axis=1).sum()) if num_steps else 0.0,
    )


def _measure_batchplan(lengths, config: PlanConfig, mode: Mode, coefficient: float):
    """batchplan's result in ``mode``, and the epoch's packing bound (pack; None for pad)."""
    from batchplan.planning.epochs import build_plan

    plan = build_plan(lengths, dataclasses.replace(config, mode=mode))
    epoch = plan.epochs[0]
    result = measure_strategy(
        f"batchplan_{mode}",
        plan.entries.length[epoch.members],
        epoch.offsets,
        epoch.step,
        epoch.rank,
        mode=mode,
        max_tokens=config.max_tokens,
        world_size=config.world_size,
        coefficient=coefficient,
    )
    return result, epoch.packing
