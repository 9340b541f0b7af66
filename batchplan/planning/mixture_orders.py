"""A source's order of uses: what is left of a pass under way, whole seeded passes, then the
prefix of one more pass whose tokens are nearest the rest of the target.

Pass ``p`` of a source is a permutation of its samples drawn from
`batchplan.planning.randomness.source_pass_rng` (the build's seed, the source's *name*,
``p``), so a source's order does not depend on the other sources, and a pass can be drawn
again from the seed alone (`pass_order`). Cost: one permutation per whole pass
(`batchplan.planning.randomness.permute`), the lengths carried along by its shuffles (no
gather); a partial pass is written and shuffled only as far as its prefix reaches
(`batchplan.planning.randomness.PermutedPrefix`), its lengths carried along too. No loop
runs per sample.

Where every whole pass is shuffled again after sizing anyway (a run of one epoch without a
warmup: forming shuffles each pass's chunk, `batchplan.planning.mixture_entries`), whole
passes are taken in sample order (`draw_order`'s ``shuffled``): a copy, not a permutation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from batchplan.planning.randomness import PermutedPrefix, permute, source_pass_rng

__all__ = ["Drawn", "SourceResume", "draw_order", "in_sample_order", "partial_pass_of", "pass_order"]

_CHUNK = 1 << 20  # prefix sums of a partial pass computed at a time (8 MiB)


@dataclasses.dataclass(frozen=True)
class SourceResume:
    """Where a source's order goes on from (a run re-planned part-way): pass ``pass_index`` is
    under way and ``left`` (one bool per sample of the source) marks the samples it has not
    used yet; the order takes them first, in that pass's order, then whole passes on."""

    pass_index: int
    left: NDArray[np.bool_]


class Drawn(NamedTuple):
    """A source's order and how it was drawn (`SourceSelection`'s fields of the same names)."""

    order: NDArray
    planned: int
    head: int
    whole: int
    pass_index: int


def draw_order(
    name: str,
    lengths: NDArray,
    start: int,
    end: int,
    tokens: int,
    target: int,
    seed: int,
    dtype: np.dtype,
    threads: int,
    resume: SourceResume | None = None,
    room: NDArray | None = None,
    along: NDArray | None = None,
    partial_drawn: Callable[[], tuple[NDArray, NDArray, int]] | None = None,
    shuffled: bool = True,
    in_order_written: bool = True,
) -> Drawn:
    """What is left of a pass under way (``resume``), whole passes, then the prefix of one more
    nearest the rest; the order is drawn into the start of ``room`` when given, and the
    lengths along it written to the start of ``along`` when given (carried by the shuffles:
    no gather). ``partial_drawn``: gives that prefix, drawn already (`partial_pass_of`).
    ``shuffled`` False: whole passes in sample order (`in_sample_order`), left unwritten in
    ``room`` with ``in_order_written`` False (their lengths are written to ``along``): for a
    caller that reads them as ranges (`batchplan.planning.mixture_sizing.SourceSelection.draw`)."""
    count = end - start
    first_pass = 0 if resume is None else resume.pass_index
    if target == 0:
        return Drawn(np.empty(0, dtype=dtype) if room is None else room[:0], 0, 0, 0, first_pass)
    head, whole_from = np.empty(0, dtype=dtype), first_pass
    if resume is not None and not resume.left.all():
        head = pass_order(name, start, count, first_pass, seed, dtype, threads)
        head = head[resume.left[head - start]]
        head_tokens = int(lengths[head].sum(dtype=np.int64))
        if target <= head_tokens:
            head, planned = _nearest_prefix(head, lengths, target)
            return Drawn(_laid(head, lengths, room, along), planned, head.shape[0], 0, first_pass)
        target -= head_tokens
        whole_from += 1
    whole, rest = divmod(target, tokens)
    partial, partial_lengths, partial_tokens = np.empty(0, dtype=dtype), np.empty(0, dtype=lengths.dtype), 0
    if rest and partial_drawn is not None:
        partial, partial_lengths, partial_tokens = partial_drawn()
    elif rest:
        partial, partial_lengths, partial_tokens = _partial_pass(
            name, lengths, start, count, tokens, whole_from + whole, rest, seed, dtype, threads
        )
    size = head.shape[0] + whole * count + partial.shape[0]
    order = np.empty(size, dtype=dtype) if room is None else room[:size]
    values = None if along is None else along[:size]
    _laid(head, lengths, order, values)
    for index in range(whole):
        at = head.shape[0] + index * count
        if not shuffled:
            if in_order_written:
                in_sample_order(order[at : at + count], start)
            if values is not None:
                values[at : at + count] = lengths[start:end]
            continue
        carried = {} if values is None else {"values": lengths[start:end], "carried": values[at : at + count]}
        permute(
            source_pass_rng(seed, name, whole_from + index), order[at : at + count], start, **carried, threads=threads
        )
    order[head.shape[0] + whole * count :] = partial
    if values is not None:
        values[head.shape[0] + whole * count :] = partial_lengths
    planned = int(lengths[head].sum(dtype=np.int64)) + whole * tokens + partial_tokens
    return Drawn(order, planned, head.shape[0], whole, first_pass if head.shape[0] else whole_from)


def partial_pass_of(
    name: str,
    lengths: NDArray,
    start: int,
    end: int,
    tokens: int,
    target: int,
    seed: int,
    dtype: np.dtype,
    resume: SourceResume | None = None,
) -> Callable[[], tuple[NDArray, NDArray, int]] | None:
    """The partial pass `draw_order` draws for the same arguments, as a call that draws it (one
    thread) and returns ``(its samples, their lengths, its tokens)``, to be drawn ahead of the
    order (its draws are its own); None where the order takes none, or where a pass under way
    (``resume``) decides what it takes."""
    if target == 0 or tokens == 0 or (resume is not None and not resume.left.all()):
        return None
    whole, rest = divmod(target, tokens)
    first_pass = 0 if resume is None else resume.pass_index
    if not rest:
        return None
    args = (name, lengths, start, end - start, tokens, first_pass + whole, rest, seed, dtype, 1)
    return functools.partial(_partial_pass, *args)


def _laid(order: NDArray, lengths: NDArray, room: NDArray | None, along: NDArray | None) -> NDArray:
    """``order`` at the start of ``room`` (itself without one), and its lengths at the start of ``along``."""
    if along is not None:
        np.take(lengths, order, out=along[: order.shape[0]], mode="clip")
    if room is None:
        return order
    room[: order.shape[0]] = order
    return room[: order.shape[0]]


def in_sample_order(out: NDArray, start: int) -> NDArray:
    """``out`` filled with ``start, start + 1, ...``: a whole pass in sample order, written
    `_CHUNK` positions at a time (no temporary as long as the pass)."""
    for first in range(0, out.shape[0], _CHUNK):
        last = min(out.shape[0], first + _CHUNK)
        out[first:last] = np.arange(start + first, start + last, dtype=out.dtype)
    return out


def pass_order(name: str, start: int, count: int, index: int, seed: int, dtype: np.dtype, threads: int) -> NDArray:
    """Pass ``index`` of a source: its global sample indices in that pass's seeded order."""
    order = np.empty(count, dtype=dtype)
    permute(source_pass_rng(seed, name, index), order, start, threads=threads)
    return order


def _partial_pass(
    name: str,
    lengths: NDArray,
    start: int,
    count: int,
    tokens: int,
    index: int,
    rest: int,
    seed: int,
    dtype: np.dtype,
    threads: int,
) -> tuple[NDArray, NDArray, int]:
    """The prefix of pass ``index`` whose tokens are nearest ``rest`` (`_nearest_prefix`) of a
    source of ``count`` samples and ``tokens`` tokens: ``(its samples, their lengths, its
    tokens)``. The pass is written and shuffled only as far as the prefix reaches
    (`PermutedPrefix`, asked first for the positions that hold ``rest`` tokens at the
    source's mean length), its lengths carried along (no gather)."""
    order, along = np.empty(count, dtype=dtype), np.empty(count, dtype=lengths.dtype)
    drawn = PermutedPrefix(
        source_pass_rng(seed, name, index),
        order,
        start,
        values=lengths[start : start + count],
        carried=along,
        threads=threads,
    )
    drawn.extend(-(-rest * count // tokens))
    done = 0
    for first in range(0, count, _CHUNK):
        drawn.extend(first + _CHUNK)
        found = _nearest(along[first : first + _CHUNK], done, rest)
        if found is not None:
            size = first + found[0]
            return order[:size].copy(), along[:size].copy(), found[1]
        done += int(along[first : first + _CHUNK].sum(dtype=np.int64))
    raise AssertionError(f"a prefix of {rest:,} tokens is asked of a pass of {done:,}")


def _nearest_prefix(order: NDArray, lengths: NDArray, rest: int) -> tuple[NDArray, int]:
    """The prefix of ``order`` whose tokens are nearest ``rest`` (a tie takes the shorter):
    ``(its global sample indices, its tokens)``; ``order`` holds at least ``rest`` tokens."""
    done = 0
    for first in range(0, order.shape[0], _CHUNK):
        chunk = lengths[order[first : first + _CHUNK]]
        found = _nearest(chunk, done, rest)
        if found is not None:
            return order[: first + found[0]].copy(), found[1]
        done += int(chunk.sum(dtype=np.int64))
    raise AssertionError(f"a prefix of {rest:,} tokens is asked of an order of {done:,}")


def _nearest(chunk: NDArray, done: int, rest: int) -> tuple[int, int] | None:
    """Where, in a chunk of lengths after ``done`` tokens, the prefix nearest ``rest`` tokens
    ends (a tie takes the shorter): ``(positions of the chunk in it, its tokens)``; None when
    the chunk does not reach ``rest``."""
    sums = np.cumsum(chunk, dtype=np.int64)
    sums += done
    if sums[-1] < rest:
        return None
    # sums[at] is the first prefix (of at + 1 positions) reaching rest; the one before it falls short.
    at = int(np.searchsorted(sums, rest, side="left"))
    before = int(sums[at - 1]) if at else done
    if rest - before <= int(sums[at]) - rest:
        return at, before
    return at + 1, int(sums[at])
