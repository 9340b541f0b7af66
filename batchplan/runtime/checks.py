"""What a plan must hold before a rank replays it: the runtime's columns, and the
dataset it was built for (row count, and the fingerprint of the lengths when given)."""

from __future__ import annotations

import numbers
from collections.abc import Sized

import numpy as np

from batchplan.errors import ConfigError, PlanFormatError, PlanMismatchError
from batchplan.formats.plan_file import OpenedPlan
from batchplan.runtime.rows import RUNTIME_COLUMNS

__all__ = ["check_plan_dataset", "check_runtime_columns"]


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
