"""The only randomness of a plan: streams of ``SeedSequence([seed, epoch, stream])``,
and the shuffles that draw from them (all on threads with the same result for any number).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from batchplan.kernels.shuffle import count_groups, scatter_groups, shuffle_groups
from batchplan.planning.threads import run_in_parts

__all__ = [
    "STREAM_ENTRY_ORDER", "STREAM_MICRO_BATCH_ORDER", "STREAM_ROUND_ORDER", "STREAM_SEQLEN_WARMUP", "epoch_rng",
    "permute", "shuffle_by_group",
]  # fmt: skip

# Independent random streams of one epoch.


# Independent random streams of one epoch.
STREAM_ENTRY_ORDER = 0


STREAM_MICRO_BATCH_ORDER = 1


STREAM_ROUND_ORDER = 2


STREAM_SEQLEN_WARMUP = 3


def epoch_rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    """The only source of randomness in batchplan."""
    return np.random.default_rng(np.random.SeedSequence([seed, epoch, stream]))


def permute(
    rng: np.random.Generator, out: NDArray[np.integer], first: int = 0, *, values=None, carried=None, threads: int = 1
) -> None:
    """Fill ``out`` with ``first +`` a uniformly random permutation of ``0..len(out) - 1``;
    with ``values``, fill ``carried`` with ``values[out - first]`` along the way.

    Items go to random groups of ~16,000, then are shuffled inside each group
    (`shuffle_by_group`): every swap stays in cache, ~4x faster than ``rng.permutation``
    at 10^7 items, and 6 bytes of random draws per item. The same result on any number
    of ``threads``.
    """
    count = out.shape[0]
    num_groups = 1 << min(max(count >> 14, 1).bit_length() - 1, 16)  # a power of two, <= 2^16
    groups = rng.integers(0, num_groups, size=count, dtype=np.uint16)
    keys = rng.integers(0, 2**32, size=count, dtype=np.uint32)
    shuffle_by_group(groups, num_groups, keys, out, first, values, carried, threads=threads)


def shuffle_by_group(
    groups: NDArray[np.integer],
    num_groups: int,
    keys: NDArray[np.uint32],
    items: NDArray[np.integer],
    first: int = 0,
    values: NDArray | None = None,
    carried: NDArray | None = None,
    *,
    threads: int = 1,
) -> NDArray[np.int64]:
    """Items ordered by group (group 0 first), randomly ordered within each group
    (`batchplan.kernels.shuffle`), on ``threads`` threads with the same result.

    Args:
        groups: group of each item, each in ``0..num_groups - 1`` (any integer dtype).
        num_groups: the number of groups.
        keys: uint32 random bits, one per position.
        items: int32 or int64, one per item, filled with ``first +`` the item indices.
        first: added to every item index written.
        values, carried: optional; ``carried[i]`` is filled with ``values[item]`` of the
            item at position ``i``.

    Returns:
        ``start``: the items of group ``g`` are at ``items[start[g]:start[g + 1]]``.
    """
    count = groups.shape[0]
    # The kernels do not check bounds: a wrong size or dtype here writes outside the arrays.
    if keys.shape[0] != count or items.shape[0] != count or (carried is not None and carried.shape[0] != count):
        raise ValueError(f"groups, keys, items (and carried) must have one entry per item: {count:,} groups, "
                         f"{keys.shape[0]:,} keys, {items.shape[0]:,} items")  # fmt: skip
    if (values is None) != (carried is None) or (values is not None and values.shape[0] != count):
        raise ValueError("give values and carried together, one value per item")
    # Per-part counts cost parts x num_groups: split only when the items far outnumber the
    # groups (so those arrays stay small), and run any threads < 1 as one part, as
    # run_in_parts does. One part (groups up to the capacity in pack mode, which may be
    # large) needs only the counts, turned into cursors in place, and the offsets.
    threads = max(1, threads)
    parts = threads if count >= 16 * num_groups * threads else 1
    counts = np.zeros((parts, num_groups), dtype=np.int64)
    run_in_parts(count_groups, parts, groups, counts)
    start = np.zeros(num_groups + 1, dtype=np.int64)
    np.cumsum(counts[0] if parts == 1 else counts.sum(axis=0), out=start[1:])
    if parts == 1:
        cursors = counts
        cursors[0] = start[:-1]
    else:  # each part writes a group's items after those of the parts before it: the one-part order
        cursors = start[:-1] + np.cumsum(counts, axis=0) - counts
    run_in_parts(scatter_groups, parts, groups, cursors, items, first, values, carried)
    run_in_parts(shuffle_groups, parts, start, keys, items, carried)
    return start
