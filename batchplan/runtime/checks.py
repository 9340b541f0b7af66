"""What the runtime checks before it serves a plan, and as it serves it.

- Before a rank replays a plan: the runtime's columns, and the dataset it was built for
  (row count, and the fingerprint of the lengths when given).
- Each rank's rows of an epoch, when read (`check_rank_rows`): every sample index within
  the plan's ``num_samples``, every span inside its sample (``start >= 0``, ``length >= 1``;
  against the dataset's lengths when the sampler was given them), and each row's
  ``tokens`` equal to its spans' (or known samples') tokens. Vectorised, O(the rank's
  entries): one unsigned ``max`` over the indices (~0.1 ms per 10^6 entries); a damaged
  row is a `PlanFormatError` before any row of the epoch is served.
- Each micro-batch, when fetched and collated (`check_items`): the items hold the tokens
  the record counts, and every span lies inside its item and ends where its sample
  ends when the plan says it is the sample's last; drift is a `PlanMismatchError` that
  names the micro-batch and the sample. A few microseconds per micro-batch.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence, Sized
from typing import Any

import numpy as np
from numpy.typing import NDArray

from batchplan.errors import ConfigError, PlanFormatError, PlanMismatchError
from batchplan.formats.opened_plan import OpenedPlan
from batchplan.runtime.records import MicroBatch
from batchplan.runtime.rows import RUNTIME_COLUMNS, RankRows

__all__ = ["check_items", "check_plan_dataset", "check_rank_rows", "check_runtime_columns", "span_cap"]

_LISTED_SAMPLES = 8  # samples a drift message lists when it cannot tell which one changed


def check_runtime_columns(plan: OpenedPlan) -> None:
    missing = [name for name in RUNTIME_COLUMNS if name not in plan.schema.names]
    if missing:
        raise PlanFormatError(
            f"{plan.path}: column(s) {missing} missing; the runtime needs them to know step "
            "boundaries and token counts; rebuild the plan with this batchplan"
        )
    if "rows_per_rank" not in plan.metadata or "steps_per_epoch" not in plan.metadata:
        raise PlanFormatError(f"{plan.path}: metadata lacks rows_per_rank/steps_per_epoch; rebuild the plan")


def check_plan_dataset(plan: OpenedPlan, dataset, lengths, loss_tokens) -> None:
    """`PlanSampler.check_dataset`."""
    if isinstance(dataset, Sized):
        num_rows = len(dataset)
    elif isinstance(dataset, numbers.Integral) and not isinstance(dataset, bool):
        num_rows = int(dataset)
    else:
        raise ConfigError(
            f"check_dataset needs a dataset with len() or its row count, got {type(dataset).__name__}; "
            "for an iterable dataset pass its number of rows"
        )
    if num_rows != plan.num_samples:
        raise PlanMismatchError(
            f"{plan.path}: the plan was built for a dataset of {plan.num_samples:,} rows but this dataset "
            f"has {num_rows:,}; rebuild the plan on this dataset or load the dataset it was built for"
        )
    if lengths is None:
        return
    if plan.metadata.get("mixture") is not None:  # each source's lengths have their own fingerprint
        from batchplan.runtime.mixture import check_mixture_lengths

        check_mixture_lengths(plan, lengths, loss_tokens)
        return
    from batchplan.formats.lengths import fingerprint_lengths  # Parquet reading: only when lengths are given

    recorded = plan.metadata.get("lengths_fingerprint")
    if recorded is None:
        raise PlanFormatError(
            f"{plan.path}: the plan records no lengths fingerprint, so lengths cannot be compared; "
            "rebuild it with `batchplan build` (or write_plan(..., lengths_fingerprint=...))"
        )
    column = (plan.metadata.get("dataset") or {}).get("loss_tokens_column")
    if column is not None and loss_tokens is None:
        raise ConfigError(
            f"{plan.path}: the plan was built with loss-tokens column {column!r}; pass loss_tokens= "
            "(that column's values) with the lengths"
        )
    if isinstance(plan.metadata.get("dataset"), dict) and column is None and loss_tokens is not None:
        raise ConfigError(f"{plan.path}: the plan was built without a loss-tokens column; drop loss_tokens=")
    lengths = np.asarray(lengths)
    if lengths.shape != (num_rows,):
        raise ConfigError(f"lengths has shape {lengths.shape}, expected ({num_rows:,},): one per dataset row")
    found = fingerprint_lengths(lengths, None if loss_tokens is None else np.asarray(loss_tokens))
    if found != recorded:
        what = "lengths and loss tokens" if loss_tokens is not None else "lengths"
        raise PlanMismatchError(
            f"{plan.path}: the dataset's {what} have fingerprint {found} but the plan was built for "
            f"{recorded}; same row count, other data (or another row order); rebuild the plan on this dataset"
        )


def span_cap(metadata: dict[str, Any], epoch: int) -> int:
    """The tokens a span holds unless it is its sample's last: ``max_tokens`` (``split`` and
    ``truncate`` cut spans of that length), or the warmup's shortest cap in an epoch that may
    hold sequence-length warmup pieces (cut to caps from that up to ``max_tokens``)."""
    config = metadata.get("config")
    warmup = config.get("seqlen_warmup_min") if isinstance(config, dict) else None
    if isinstance(warmup, int) and (epoch == 0 or "resharded_from" in metadata):
        return warmup
    return int(metadata["max_tokens"])


def check_rank_rows(rows: RankRows, plan: OpenedPlan, rank: int, sample_lengths: NDArray | None = None) -> None:
    """Raise `PlanFormatError` unless this rank's rows of an epoch index only the plan's
    samples, with spans inside them and ``tokens`` that add up (module docstring)."""
    columns = rows.entries()
    relative, samples = columns["samples"]  # offsets from 0, shape (num_rows + 1,)
    bad = _first_at_or_above(samples, plan.num_samples)
    if bad is not None:
        n = plan.num_samples
        what = f"holds sample index {int(samples[bad]):,} but the plan has {n:,} samples (0..{n - 1:,})"
        raise _corrupt(plan, rows, rank, relative, bad, what)
    if rows.has_spans:
        entry_tokens = _check_spans(plan, rows, rank, columns, relative, sample_lengths)
    elif sample_lengths is not None:
        entry_tokens = sample_lengths[samples]
    else:
        return
    cumulative = np.concatenate([[0], np.cumsum(entry_tokens, dtype=np.int64)])
    found = cumulative[relative[1:]] - cumulative[relative[:-1]]  # shape (num_rows,)
    wrong = np.flatnonzero(found != rows.column("tokens"))
    if wrong.size:
        row = int(wrong[0])
        what = f"counts {int(rows.column('tokens')[row]):,} tokens but its entries hold {int(found[row]):,}"
        raise _corrupt(plan, rows, rank, relative, int(relative[row]), what)


def _check_spans(plan, rows: RankRows, rank: int, columns, relative, sample_lengths) -> NDArray:
    """The span lengths, once every span is a part of its sample."""
    samples = columns["samples"][1]
    for name in ("starts", "lengths"):
        if not np.array_equal(columns[name][0], relative):
            raise _corrupt(plan, rows, rank, relative, 0, f"has {name} that do not pair with its samples")
    starts, lengths = columns["starts"][1], columns["lengths"][1]
    if starts.size and (starts.min() < 0 or lengths.min() < 1):
        bad = _first((starts < 0) | (lengths < 1))
        what = f"has a span of {int(lengths[bad]):,} tokens from token {int(starts[bad]):,} of sample "
        raise _corrupt(plan, rows, rank, relative, bad, what + f"{int(samples[bad]):,}")
    if sample_lengths is not None:
        beyond = np.flatnonzero(starts + lengths.astype(np.int64) > sample_lengths[samples])
        if beyond.size:
            i = int(beyond[0])
            end, tokens = int(starts[i]) + int(lengths[i]), int(sample_lengths[samples[i]])
            what = f"takes tokens [{int(starts[i]):,}, {end:,}) of sample {int(samples[i]):,}, which has {tokens:,}"
            raise _corrupt(plan, rows, rank, relative, i, what)
    return lengths


def _first_at_or_above(values: NDArray, limit: int) -> int | None:
    """The first position of a value outside ``0..limit-1``, or None: one ``max`` over the
    values seen as unsigned (a negative one becomes larger than any limit)."""
    unsigned = values.view(np.dtype(f"u{values.itemsize}"))
    if not unsigned.size or int(unsigned.max()) < limit:
        return None
    return _first(unsigned >= limit)


def _first(mask: NDArray[np.bool_]) -> int:
    return int(np.argmax(mask))


def _corrupt(plan: OpenedPlan, rows: RankRows, rank: int, relative, entry: int, what: str) -> PlanFormatError:
    """The damaged row holding ``entry`` (an index into the rank's entries), named."""
    row = min(int(np.searchsorted(relative, entry, side="right")) - 1, max(rows.num_rows - 1, 0))
    at = ""
    if rows.num_rows:
        at = f" the micro-batch at step {int(rows.column('step')[row]):,}, micro {int(rows.column('micro')[row])}"
    return PlanFormatError(
        f"{plan.path}: epoch {rows.epoch}, rank {rank}:{at} {what}; the plan is damaged: rebuild it, "
        f"or run `batchplan validate {plan.path}` to see what else is"
    )


def check_items(
    record: MicroBatch,
    item_tokens: Sequence[int],
    *,
    ends_sample: Sequence[bool] | None = None,
    padded: bool = False,
) -> None:
    """Raise `PlanMismatchError` unless a micro-batch's items hold the tokens its record plans.

    Args:
        record: the micro-batch's record.
        item_tokens: the tokens of each item, whole (before a span is taken).
        ends_sample: per span, whether the plan has it end its sample (`SpanIndex.ends_sample`).
        padded: the items are padded to the longest (pad mode): the record's
            ``padded_tokens`` bounds each one.
    """
    if record.starts is not None and record.lengths is not None:
        found = np.asarray(item_tokens, dtype=np.int64)
        _check_item_spans(record, record.starts, record.lengths, found, ends_sample)
    elif sum(item_tokens) != record.tokens:
        raise _drift(record, _changed(record, np.asarray(item_tokens, dtype=np.int64), padded))


def _check_item_spans(
    record: MicroBatch, starts: list[int], lengths: list[int], found: NDArray[np.int64], ends_sample
) -> None:
    """``found``: each span's sample's tokens; ``starts`` and ``lengths``: the record's spans."""
    ends = np.asarray(starts, dtype=np.int64) + np.asarray(lengths, dtype=np.int64)
    bad = found < ends
    if ends_sample is not None:
        bad |= np.asarray(ends_sample, dtype=bool) & (found != ends)
    if not bad.any():
        return
    i = _first(bad)
    sample, start, end, tokens = record.indices[i], starts[i], int(ends[i]), int(found[i])
    if tokens < end:
        what = f"sample {sample:,} has {tokens:,} tokens but the plan takes tokens [{start:,}, {end:,}) of it"
    else:
        what = (
            f"sample {sample:,} has {tokens:,} tokens but the plan has {end:,} (its last span, "
            f"[{start:,}, {end:,}), ends there): {tokens - end:,} tokens would never be trained"
        )
    raise _drift(record, what)


def _changed(record: MicroBatch, found: NDArray[np.int64], padded: bool) -> str:
    """Which sample of a micro-batch changed, as far as its record tells."""
    samples = record.indices
    if len(samples) == 1:
        return f"sample {samples[0]:,} has {int(found[0]):,} tokens but the plan has {record.tokens:,}"
    if padded:
        longest = record.padded_tokens // len(samples)
        over = np.flatnonzero(found > longest)
        if over.size:
            i = int(over[0])
            return (
                f"sample {samples[i]:,} has {int(found[i]):,} tokens but the longest the plan has in "
                f"this micro-batch is {longest:,}"
            )
    listed = ", ".join(f"{s:,}: {int(n):,}" for s, n in zip(samples[:_LISTED_SAMPLES], found))
    more = ", ..." if len(samples) > _LISTED_SAMPLES else ""
    return (
        f"its {len(samples)} samples hold {int(found.sum()):,} tokens but the plan has {record.tokens:,} "
        f"(sample: tokens {listed}{more}); one of them changed"
    )


def _drift(record: MicroBatch, what: str) -> PlanMismatchError:
    rank = "" if record.rank is None else f" of rank {record.rank}"
    return PlanMismatchError(
        f"step {record.step:,}, micro {record.micro}{rank} (epoch {record.epoch}): {what}; the dataset "
        "does not match the plan: rebuild the plan on this dataset, or compare the plan with the "
        "dataset's lengths: `batchplan.validate_plan(PLAN, DATA)` (the command `batchplan validate`)"
    )
