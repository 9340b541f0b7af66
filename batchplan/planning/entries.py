"""Apply the empty and oversize policies: samples in, plan entries out.

An entry is what a micro-batch holds: a sample, or a span of one when samples are
truncated or split. The policies are the same for every epoch, so this runs once.
Nothing is lost silently: each dropped sample is listed under its reason.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig
from batchplan.errors import DatasetError
from batchplan.plan import Entries, index_dtype, length_dtype

__all__ = ["make_entries"]

_CHUNK = 1 << 20  # samples looked at a time when indexing the kept ones


def make_entries(
    lengths: NDArray[np.integer],
    config: PlanConfig,
    loss_tokens: NDArray[np.integer] | None = None,
) -> Entries:
    """Turn sample lengths into entries under ``config.oversize`` and ``config.drop_empty``.

    The entries' lengths (and loss tokens) are uint16 when every one is below 2^16, else
    int32 (`batchplan.plan.length_dtype`): ``lengths`` itself when it has that dtype and
    every sample is kept. Plans do not depend on the dtype given.

    Raises:
        DatasetError: empty samples without ``drop_empty``; oversize samples under
            ``oversize="error"``; truncating or splitting (also by a sequence-length
            warmup) when a loss-token column is given (where the labelled tokens lie
            inside a sample is unknown).
    """
    lengths = np.asarray(lengths)
    num_samples = lengths.shape[0]
    shortest = int(lengths.min()) if num_samples else 1
    longest = int(lengths.max()) if num_samples else 0
    _check_inputs(lengths, shortest, config, loss_tokens is not None)
    dropped: dict[str, NDArray[np.int64]] = {}
    keep = None  # all samples kept (the common case: no mask, no copies)
    if shortest == 0:
        empty = np.flatnonzero(lengths == 0)
        if not config.drop_empty:
            raise DatasetError(
                f"{empty.size:,} samples are empty (length 0 or null; first: sample "
                f"{int(empty[0]):,}); pass `drop_empty=True` to leave them out"
            )
        dropped["empty"] = empty.astype(np.int64)
        keep = lengths != 0
    oversize = np.flatnonzero(lengths > config.max_tokens) if longest > config.max_tokens else None
    if oversize is not None:
        _check_oversize(lengths, oversize, config, loss_tokens is not None)
        if config.oversize == "drop":
            dropped["oversize"] = oversize.astype(np.int64)
            keep = lengths <= config.max_tokens if keep is None else keep & (lengths <= config.max_tokens)

    index = index_dtype(num_samples)
    sample = None if keep is None else _kept_samples(keep, index)  # None: entry i is sample i
    kept = lengths if sample is None else lengths[sample]
    if oversize is not None and config.oversize in ("truncate", "split"):
        every = np.arange(num_samples, dtype=index) if sample is None else sample
        return _spans(every, kept, config, dropped)
    # Oversize samples are dropped here: every kept length is at most max_tokens.
    kept_lengths = kept.astype(length_dtype(min(longest, config.max_tokens)), copy=False)
    kept_loss = None if loss_tokens is None else _narrow_loss(np.asarray(loss_tokens), sample)
    return Entries(length=kept_lengths, dropped=dropped, sample=sample, loss_tokens=kept_loss)


def _kept_samples(keep: NDArray[np.bool_], index: np.dtype) -> NDArray[np.integer]:
    """Indices of the kept samples as ``index``, found a chunk at a time (never an int64
    index of them all: 8 bytes per sample)."""
    sample = np.empty(int(np.count_nonzero(keep)), dtype=index)
    filled = 0
    for first in range(0, keep.shape[0], _CHUNK):
        found = np.flatnonzero(keep[first : first + _CHUNK])
        sample[filled : filled + found.shape[0]] = found + first
        filled += found.shape[0]
    return sample


def _narrow_loss(loss_tokens: NDArray[np.integer], sample: NDArray[np.integer] | None) -> NDArray[np.integer]:
    """The kept samples' loss tokens: uint16 when every one is in ``0..2^16 - 1``, else int32."""
    kept = loss_tokens if sample is None else loss_tokens[sample]
    if kept.dtype == np.uint16:
        return kept
    fits = kept.size and int(kept.min()) >= 0
    return kept.astype(length_dtype(int(kept.max())) if fits else np.int32, copy=False)


def _check_inputs(lengths, shortest: int, config: PlanConfig, has_loss_column: bool) -> None:
    if has_loss_column and config.has_seqlen_warmup:
        raise DatasetError(
            "a sequence-length warmup (`seqlen_warmup_min`) splits samples into pieces, and with a "
            "loss-tokens column where the labelled tokens lie inside a sample is unknown (no exact loss-token "
            "count per piece); leave out the warmup or the loss-tokens column"
        )
    if shortest < 0:
        negative = np.flatnonzero(lengths < 0)
        first = int(negative[0])
        raise DatasetError(
            f"{negative.size:,} samples have a negative length (sample {first:,}: {int(lengths[first]):,}); "
            "token counts must be >= 0"
        )


def _check_oversize(lengths, oversize, config: PlanConfig, has_loss_column: bool) -> None:
    longest = int(lengths[oversize].max())
    first = int(oversize[0])
    if config.oversize == "error":
        raise DatasetError(
            f"{oversize.size:,} samples are longer than max_tokens {config.max_tokens:,} "
            f"(longest: {longest:,} tokens; first: sample {first:,} with "
            f"{int(lengths[first]):,}); raise `max_tokens` or set `oversize` to drop, truncate or split"
        )
    if has_loss_column and config.oversize in ("truncate", "split"):
        raise DatasetError(
            f"`oversize={config.oversize!r}` cannot keep an exact loss-token count with a "
            f"loss-tokens column: {oversize.size:,} samples exceed max_tokens "
            f"{config.max_tokens:,} and where their labelled tokens lie is unknown; "
            'use `oversize="drop"` or raise `max_tokens`'
        )


def _spans(sample, lengths, config: PlanConfig, dropped) -> Entries:
    """Cut samples into spans of at most max_tokens (split) or keep the first (truncate)."""
    cap = config.max_tokens
    lengths = lengths.astype(np.int64)
    if config.oversize == "truncate":
        pieces = np.ones(sample.shape[0], dtype=np.int64)
    else:
        pieces = (lengths + cap - 1) // cap
    entry_sample = np.repeat(sample, pieces)
    first_piece = np.cumsum(pieces) - pieces
    # shape (entries,): index of each piece within its sample
    piece = np.arange(entry_sample.shape[0], dtype=np.int64) - np.repeat(first_piece, pieces)
    start = piece * cap
    # Some sample is longer than the cap here: the longest span has cap tokens.
    length = np.minimum(cap, np.repeat(lengths, pieces) - start).astype(length_dtype(cap))
    # Each span is trained as its own sequence: its first token has no target (length - 1).
    return Entries(length=length, dropped=dropped, sample=entry_sample, start=start)
