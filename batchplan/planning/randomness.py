"""The only randomness of a plan: streams of ``SeedSequence([seed, epoch, stream])``,
and the shuffles that draw from them (all on threads with the same result for any number).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Iterator

import numpy as np
from numpy.typing import NDArray

from batchplan.kernels.bin_layout import unshuffle_groups
from batchplan.kernels.shuffle import count_groups, scatter_groups, shuffle_group_range, shuffle_groups
from batchplan.planning.threads import THREADED_FROM, run_in_parts

__all__ = [
    "STREAM_ENTRY_ORDER",
    "STREAM_MICRO_BATCH_ORDER",
    "STREAM_ROUND_ORDER",
    "STREAM_SEQLEN_WARMUP",
    "KeyStream",
    "PermutedPrefix",
    "epoch_rng",
    "permute",
    "shuffle_by_group",
    "unshuffle_by_group",
    "STREAM_SOURCE_PASS",
    "source_pass_rng",
    "STREAM_BATCH_ORDER",
    "batch_rng",
]

# Keys drawn at a time when a `KeyStream` is read: 1 MiB (small beside any array of one
# value per entry, and few calls: 4,000 for 10^9 keys).
KEY_CHUNK = 1 << 18


# Independent random streams of one epoch.
STREAM_ENTRY_ORDER = 0


STREAM_MICRO_BATCH_ORDER = 1


STREAM_ROUND_ORDER = 2


STREAM_SEQLEN_WARMUP = 3


def epoch_rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    """The only source of randomness in batchplan."""
    return np.random.default_rng(np.random.SeedSequence([seed, epoch, stream]))


# A mixture source's passes (`source_pass_rng`): keyed by the source's name, not its position.
STREAM_SOURCE_PASS = 4


def source_pass_rng(seed: int, source_name: str, pass_index: int) -> np.random.Generator:
    """The stream of one pass over a mixture source: ``SeedSequence([seed, STREAM_SOURCE_PASS,
    name digest, pass_index])``. The digest is the first 8 bytes of the SHA-256 of the name
    (stable across processes, unlike ``hash``), so a source's passes do not change when
    other sources are added, removed or reordered."""
    digest = int.from_bytes(hashlib.sha256(source_name.encode("utf-8")).digest()[:8], "little")
    return np.random.default_rng(np.random.SeedSequence([seed, STREAM_SOURCE_PASS, digest, pass_index]))


# `batchplan.planning.batch.plan_batch`'s draws: one batch planned in the training loop.
STREAM_BATCH_ORDER = 5


def batch_rng(seed: int) -> np.random.Generator:
    """The stream of one `plan_batch` call: ``SeedSequence([seed, 0, STREAM_BATCH_ORDER])``."""
    return epoch_rng(seed, 0, STREAM_BATCH_ORDER)


def permute(
    rng: np.random.Generator, out: NDArray[np.integer], first: int = 0, *, values=None, carried=None, threads: int = 1
) -> None:
    """Fill ``out`` with ``first +`` a uniformly random permutation of ``0..len(out) - 1``;
    with ``values``, fill ``carried`` with ``values[out - first]`` along the way.

    Items go to random groups of ~16,000, then are shuffled inside each group
    (`shuffle_by_group`): every swap stays in cache, ~4x faster than ``rng.permutation``
    at 10^7 items. The groups (2 bytes per item) are freed once the items are grouped,
    and the swaps' keys are drawn a few groups at a time (`KeyStream`): at most the
    output, ``carried`` and the groups are held. The same result on any number of
    ``threads``.
    """
    count = out.shape[0]
    if count < THREADED_FROM:  # starting threads would cost more than the work they share
        threads = 1
    keys, start = _grouped(rng, out, first, values, carried, threads)
    bounds = _group_bounds(start, max(1, threads))
    run_in_parts(_shuffle_part, len(bounds) - 1, keys, start, out, carried, bounds)


def _grouped(rng: np.random.Generator, out, first: int, values, carried, threads: int):
    """`permute`'s first draws: each item's group, and the keys of the shuffles (drawn later);
    ``out`` (and ``carried``) written group by group. Returns ``(keys, start)``: group ``g``
    is positions ``start[g]:start[g + 1]``."""
    groups, num_groups, keys = _draw_groups(rng, out.shape[0])
    start, cursors, parts = _group_cursors(groups, num_groups, threads)
    run_in_parts(scatter_groups, parts, groups, cursors, out, first, values, carried, 0, num_groups)
    return keys, start


def _draw_groups(rng: np.random.Generator, count: int):
    """`permute`'s draws: ``(groups, num_groups, keys)``, each of ``count`` items' random
    group (uint16), and the shuffles' keys (a `KeyStream`, drawn later)."""
    num_groups = 1 << min(max(count >> 14, 1).bit_length() - 1, 16)  # a power of two, <= 2^16
    groups = rng.integers(0, num_groups, size=count, dtype=np.uint16)
    return groups, num_groups, KeyStream.draw_later(rng, count)


class PermutedPrefix:
    """`permute`'s result, made final a prefix at a time: what draws a prefix of a
    permutation whose length is known only from its values (a source's partial pass).

    Made, each item's group is drawn (2 bytes an item, held until every group is written).
    `extend` writes the groups a position needs (their items where `permute` places them:
    one read of every item's group per call that writes, each such call writing at least
    as many groups as were written before it) and shuffles them, in order: positions before
    `ready` hold what `permute` writes there. Groups past the prefix asked for are never
    written nor shuffled.
    """

    def __init__(self, rng: np.random.Generator, out, first: int = 0, *, values=None, carried=None, threads: int = 1):
        threads = 1 if out.shape[0] < THREADED_FROM else threads
        self.out, self.carried = out, carried
        self._into = (out, first, values, carried)  # `scatter_groups`' items, first, values, carried
        self._groups, num_groups, self._keys = _draw_groups(rng, out.shape[0])
        self._start, self._cursors, self._parts = _group_cursors(self._groups, num_groups, threads)
        self._written = 0  # groups written
        self._shuffled = 0  # groups shuffled
        self.ready = 0  # positions final

    def extend(self, position: int) -> int:
        """Make the positions before ``position`` final (and the rest of the group it ends
        in); returns `ready`, the positions now final."""
        last_group = int(np.searchsorted(self._start, min(position, self.out.shape[0]), side="left"))
        if last_group > self._written:
            self._write(max(last_group, min(2 * self._written, self._start.shape[0] - 1)))
        if last_group > self._shuffled:
            begin, end = int(self._start[self._shuffled]), int(self._start[last_group])
            (keys,) = self._keys.spans([begin, end])
            shuffle_group_range(self._start, self._shuffled, last_group, keys, begin, self.out, self.carried)
            self._shuffled, self.ready = last_group, end
        return self.ready

    def _write(self, last_group: int) -> None:
        """Write the items of groups `_written`:``last_group`` where `permute` writes them."""
        groups, written = self._groups, self._written
        run_in_parts(scatter_groups, self._parts, groups, self._cursors, *self._into, written, last_group)
        self._written = last_group
        if last_group == self._start.shape[0] - 1:
            self._groups = groups[:0]  # every item written: free the groups


def _shuffle_part(keys: KeyStream, start, items, carried, bounds: list[int], part: int, parts: int) -> None:
    """`shuffle_groups` on the groups of positions ``bounds[part]:bounds[part + 1]``, with their keys
    read a few whole groups at a time (a group is shuffled from its last position down)."""
    spans = _group_bounds(start, max(1, (bounds[part + 1] - bounds[part]) // KEY_CHUNK), bounds[part], bounds[part + 1])
    for (begin, end), chunk in zip(zip(spans[:-1], spans[1:]), keys.spans(spans)):
        first_group, last_group = np.searchsorted(start, [begin, end], side="left")
        shuffle_group_range(start, first_group, last_group, chunk, begin, items, carried)


def _group_bounds(start: NDArray[np.int64], parts: int, low: int = 0, high: int | None = None) -> list[int]:
    """Positions ``low:high`` (group starts; default: all) cut into about ``parts`` equal spans at
    group starts: ``parts + 1`` non-decreasing bounds."""
    high = int(start[-1]) if high is None else high
    shares = [low + (high - low) * part // parts for part in range(parts)]
    return [int(start[np.searchsorted(start, position, side="left")]) for position in shares] + [high]


def _group_cursors(groups: NDArray[np.integer], num_groups: int, threads: int):
    """``(start, cursors, parts)`` for writing items grouped (`scatter_groups`): the groups'
    offsets, and where each part writes its first item of each group."""
    # Per-part counts cost parts x num_groups: split only when the items far outnumber the
    # groups (so those arrays stay small), and run any threads < 1 as one part, as
    # run_in_parts does. One part (groups up to the capacity in pack mode, which may be
    # large) needs only the counts, turned into cursors in place, and the offsets.
    count = groups.shape[0]
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
    return start, cursors, parts


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
        raise ValueError(
            f"groups, keys, items (and carried) must have one entry per item: {count:,} groups, "
            f"{keys.shape[0]:,} keys, {items.shape[0]:,} items"
        )
    if (values is None) != (carried is None) or (values is not None and values.shape[0] != count):
        raise ValueError("give values and carried together, one value per item")
    start, cursors, parts = _group_cursors(groups, num_groups, threads)
    run_in_parts(scatter_groups, parts, groups, cursors, items, first, values, carried, 0, num_groups)
    run_in_parts(shuffle_groups, parts, start, keys, items, carried)
    return start


@dataclasses.dataclass(frozen=True)
class KeyStream:
    """``count`` random uint32 keys: what ``rng.integers(0, 2**32, count, dtype=np.uint32)`` draws
    from ``rng``'s state when the stream is made, read back in chunks wherever they are needed
    (never all held at once: 4 bytes per key)."""

    bit_generator: np.random.BitGenerator  # a copy, at the first key
    count: int

    @classmethod
    def draw_later(cls, rng: np.random.Generator, count: int) -> KeyStream:
        """The next ``count`` keys of ``rng``; ``rng`` moves past them as if it had drawn them."""
        stream = cls(copy.deepcopy(rng.bit_generator), count)
        _skip_keys(rng, count)
        return stream

    def chunks(self, first: int, last: int, size: int | None = None) -> Iterator[tuple[int, NDArray[np.uint32]]]:
        """Keys ``first:last``, in order, as ``(position of the first, keys)`` chunks of ``size``
        (default `KEY_CHUNK`)."""
        if not 0 <= first <= last <= self.count:
            raise ValueError(f"keys {first:,}:{last:,} asked of a stream of {self.count:,}")
        bounds = [*range(first, last, size or KEY_CHUNK), last]
        yield from zip(bounds, self.spans(bounds))

    def spans(self, bounds: list[int]) -> Iterator[NDArray[np.uint32]]:
        """Keys ``bounds[0]:bounds[1]``, ``bounds[1]:bounds[2]``, ... (non-decreasing bounds), an array each."""
        rng = np.random.Generator(copy.deepcopy(self.bit_generator))
        _skip_keys(rng, bounds[0])
        for first, last in zip(bounds[:-1], bounds[1:]):
            yield rng.integers(0, 2**32, size=last - first, dtype=np.uint32)


def _skip_keys(rng: np.random.Generator, count: int) -> None:
    """Move ``rng`` past ``count`` uint32 draws without making them.

    numpy draws a uint32 key as half of a 64-bit output and keeps the other half for the
    next one (``has_uint32``): ``count`` keys use ``ceil`` of half of them, counting a half
    kept from before. A bit generator that cannot jump ahead draws them in chunks.
    """
    if count <= 0:
        return
    if not hasattr(rng.bit_generator, "advance"):
        for first in range(0, count, KEY_CHUNK):
            rng.integers(0, 2**32, size=min(KEY_CHUNK, count - first), dtype=np.uint32)
        return
    if rng.bit_generator.state["has_uint32"]:
        rng.integers(0, 2**32, size=1, dtype=np.uint32)  # takes the kept half
        count -= 1
    rng.bit_generator.advance(count // 2)  # whole outputs (advancing drops no kept half: none is left)
    if count % 2:
        rng.integers(0, 2**32, size=1, dtype=np.uint32)  # one half used, the other kept, as drawing does


def unshuffle_by_group(
    keys: KeyStream, start: NDArray[np.int64], block: NDArray[np.int64], values: NDArray, *, threads: int = 1
) -> None:
    """Undo on ``values`` the within-group shuffle `shuffle_by_group` makes with ``keys``
    (`batchplan.kernels.bin_layout.unshuffle_groups`): group ``g`` holds item positions
    ``start[g]:start[g + 1]`` and its values lie from ``block[g]`` on. Afterwards the value
    the shuffle's position ``p`` held sits where item ``p`` was before the shuffle.

    Keys are read in chunks; on ``threads`` threads, each takes whole groups (its own share
    of the keys, read from its first position): the same result for any number.
    """
    count = int(start[-1])
    if keys.count != count or values.shape[0] < count:
        raise ValueError(f"{keys.count:,} keys and {values.shape[0]:,} values for {count:,} items")
    bounds = _group_bounds(start, max(1, min(threads, count // KEY_CHUNK + 1)))
    run_in_parts(_unshuffle_part, len(bounds) - 1, keys, start, block, values, bounds)


def _unshuffle_part(keys: KeyStream, start, block, values, bounds: list[int], part: int, parts: int) -> None:
    for position, chunk in keys.chunks(bounds[part], bounds[part + 1]):
        unshuffle_groups(start, block, chunk, position, values)
