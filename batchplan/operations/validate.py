"""Re-check every guarantee of a plan file, independently of how it was built.

Checks (each violation names its guarantee):
- ``integrity``: the content hash matches; metadata agrees with the rows.
- ``dataset``: the plan was built for these lengths (count and fingerprint).
- ``coverage``: every epoch holds every sample exactly once (split samples: their
  pieces tile the sample), except samples the plan lists as dropped, for a reason
  that holds.
- ``max_tokens``: pack: sum of lengths <= max_tokens; pad: count x longest <= max_tokens.
- ``equal_micro_batches``: every rank runs the same number of micro-batches in every
  step, numbered 0..m-1.
- ``counts``: tokens, loss tokens and the per-step sums (the loss normaliser) are exact.
- ``seqlen_warmup``: with a sequence-length warmup, a step that ends after ``t`` tokens
  of the run holds no sequence longer than the warmup cap at ``t`` (`batchplan.planning.warmup`).

A resharded plan (``batchplan reshard``) continues its parent from ``first_step``: its
epochs before the resumed one must be empty, steps and token counts run on from the
parent's, and coverage of the resumed epoch counts what the parent trained before
(``consumed``): together they hold every sample exactly once.

Vectorised numpy, one rank's record batch at a time (`batchplan.operations.epoch_checks`): a
plan of the 16 M-sample Wikipedia file checks in seconds. Memory: the dataset's lengths (4 bytes
per sample), one byte per sample for coverage (two for a resharded plan's resumed epoch), the
pieces of split samples (`batchplan.operations.coverage`), one rank's rows and a few numbers per
step, whatever the world size.
"""

from __future__ import annotations

import binascii
import dataclasses
import os
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from batchplan.errors import DatasetError, PlanFormatError
from batchplan.formats.bitmap import decode_bitmap
from batchplan.formats.lengths import fingerprint_lengths, read_lengths
from batchplan.formats.opened_plan import OpenedPlan
from batchplan.formats.opening import open_plan
from batchplan.operations.epoch_checks import EpochChecker, Violation
from batchplan.operations.mixture_checks import check_mixture

__all__ = ["Violation", "check_plan", "validate_plan"]

PathLike = str | os.PathLike


def check_plan(
    plan: OpenedPlan,
    lengths: NDArray[np.integer] | None = None,
    loss_tokens: NDArray[np.integer] | None = None,
) -> list[Violation]:
    """Every violated guarantee of ``plan`` (an empty list when the plan is sound).

    Args:
        plan: the opened plan.
        lengths: the dataset's sample lengths; without them the checks that need
            the dataset (coverage by length, exact token counts) use the plan alone.
        loss_tokens: the dataset's loss-token column, if the plan was built with one.
    """
    found: list[Violation] = []
    try:
        plan.verify()
    except PlanFormatError as error:
        found.append(Violation("integrity", str(error)))
    found += _check_drop_last_allowed(plan)
    if lengths is not None:
        lengths = np.asarray(lengths)
        found += _check_dataset(plan, lengths, loss_tokens)
        if any(v.guarantee == "dataset" for v in found):
            return found
        found += _check_dropped_reasons(plan, lengths)
    lineage, problems = _read_lineage(plan)
    found += problems + _check_mixture(plan, lengths)
    step_base, tokens_base = lineage.first_step, lineage.tokens_before
    for epoch in range(plan.num_epochs):
        try:
            if epoch < lineage.first_epoch:
                found += _check_trained_on_parent(plan, epoch)
                continue
            trained = lineage.trained_before(epoch)
            checker = EpochChecker(plan, epoch, lengths, loss_tokens, step_base, tokens_base, trained)
            found += checker.run()
        except (PlanFormatError, OSError, ValueError, IndexError, TypeError, KeyError) as error:
            # Structure too damaged to check (list offsets out of range, unreadable batch, a
            # metadata key renamed by a flipped byte).
            found.append(Violation("integrity", f"epoch {epoch}: rows or metadata are unreadable ({error!r})"))
            return found
        step_base += plan.metadata["steps_per_epoch"][epoch]
        tokens_base += checker.total_tokens
    return found


def validate_plan(
    plan: PathLike | OpenedPlan,
    dataset: PathLike | Sequence[PathLike] | None = None,
    *,
    mixture: PathLike | None = None,
) -> list[Violation]:
    """Every violated guarantee of a plan file (an empty list when it is sound), checked
    against the dataset's lengths when ``dataset`` (its files) is given, or a mixture's plan
    against its sources' when ``mixture`` (its file) is; `check_plan` for lengths already in
    memory."""
    plan = open_plan(plan) if isinstance(plan, (str, os.PathLike)) else plan
    if mixture is not None:
        return _validate_mixture_plan(plan, mixture)
    if not dataset:
        return check_plan(plan)
    source = plan.metadata.get("dataset") or {}
    column = source.get("length_column", "length")  # the column actually used: integer or list
    lengths = read_lengths(
        dataset, length_column=column, tokens_column=column, loss_tokens_column=source.get("loss_tokens_column")
    )
    return check_plan(plan, lengths.lengths, lengths.loss_tokens)


def _validate_mixture_plan(plan: OpenedPlan, mixture: PathLike) -> list[Violation]:
    """Check a mixture's plan against its mixture file's sources, laid out by name at the
    plan's offsets (a re-planned plan's sources: the parent's, then those it added)."""
    from batchplan.formats.mixture_file import read_mixture
    from batchplan.operations.replan_mixture import sources_in_plan

    if "mixture" not in plan.metadata:
        return [Violation("dataset", "the plan was built from one dataset, not a mixture; pass `dataset`")]
    recorded = plan.metadata["mixture"]["sources"]
    given = read_mixture(mixture)
    unknown = sorted(set(given.names) - {source["name"] for source in recorded})
    missing = [s["name"] for s in recorded if s["planned_tokens"] > 0 and s["name"] not in given.names]
    if unknown or missing:
        why = ([f"the plan has no source {unknown}"] if unknown else []) + (
            [f"the mixture leaves out {missing}, which the plan uses"] if missing else []
        )
        return [Violation("dataset", f"the mixture's sources are not the plan's: {'; '.join(why)}")]
    try:
        sources = sources_in_plan(recorded, given, where=" than the plan's")
    except DatasetError as error:
        return [Violation("dataset", str(error))]
    if plan.metadata.get("lengths_fingerprint") not in (None, sources.fingerprint()):
        return [
            Violation(
                "dataset",
                f"the mixture's lengths fingerprint {sources.fingerprint()} differs from the "
                f"plan's {plan.metadata['lengths_fingerprint']}; the plan was built for other sources or "
                "data",
            )
        ]
    lengths, loss_tokens = sources.lengths()
    return check_plan(plan, lengths, loss_tokens)


def _no_pieces() -> NDArray[np.int64]:
    return np.zeros((0, 3), dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class _Lineage:
    """Where a plan starts: 0 for a built plan; for a resharded one, its parent's step."""

    first_step: int = 0
    tokens_before: int = 0
    first_epoch: int = 0  # epochs before it were trained on the parent and hold no rows
    consumed_whole: NDArray[np.bool_] | None = None  # samples trained before first_step
    # Shape (n, 3): the pieces (sample, start, length) trained before first_step.
    consumed_spans: NDArray[np.int64] = dataclasses.field(default_factory=_no_pieces)

    def trained_before(self, epoch: int) -> tuple[NDArray[np.bool_] | None, NDArray[np.int64]]:
        """What the parent trained of ``epoch`` before ``first_step``: (whole samples, or None
        for none; pieces)."""
        if epoch != self.first_epoch or self.consumed_whole is None:
            return None, _no_pieces()
        return self.consumed_whole, self.consumed_spans


def _read_lineage(plan: OpenedPlan) -> tuple[_Lineage, list[Violation]]:
    meta = plan.metadata
    if "resharded_from" not in meta and "first_step" not in meta:
        return _Lineage(), []
    try:
        parent, consumed = meta["resharded_from"], meta["consumed"]
        lineage = _Lineage(
            first_step=_non_negative(meta["first_step"]),
            tokens_before=_non_negative(meta["tokens_before_first_step"]),
            first_epoch=_non_negative(parent["epoch"]),
            consumed_whole=decode_bitmap(consumed["samples"], plan.num_samples),
            consumed_spans=np.asarray(consumed["spans"], dtype=np.int64).reshape(-1, 3),
        )
        if consumed["epoch"] != lineage.first_epoch or lineage.first_epoch >= plan.num_epochs:
            raise ValueError(f"consumed epoch {consumed['epoch']} / resumed epoch {lineage.first_epoch} mismatch")
        spans = lineage.consumed_spans
        if (
            spans.size
            and ((spans[:, 0] < 0) | (spans[:, 0] >= plan.num_samples) | (spans[:, 1] < 0) | (spans[:, 2] < 1)).any()
        ):
            raise ValueError("a consumed piece lies outside the dataset")
    except (KeyError, TypeError, ValueError, binascii.Error) as error:
        message = f"the lineage of a resharded plan (first_step, resharded_from, consumed) is malformed ({error})"
        return _Lineage(), [Violation("integrity", message)]
    return lineage, []


def _check_mixture(plan: OpenedPlan, lengths) -> list[Violation]:
    """`check_mixture`'s violations; rows it cannot read are an ``integrity`` one, as in the epochs' checks."""
    try:
        return check_mixture(plan, lengths)
    except PlanFormatError as error:
        return [Violation("integrity", f"a mixture's rows are unreadable ({error})")]


def _non_negative(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not an integer >= 0")
    return value


def _check_trained_on_parent(plan: OpenedPlan, epoch: int) -> list[Violation]:
    rows = sum(plan.rank_rows(epoch, rank).num_rows for rank in range(plan.world_size))
    if rows or plan.metadata["steps_per_epoch"][epoch] or plan.metadata["rows_per_rank"][epoch]:
        return [
            Violation(
                "integrity",
                f"epoch {epoch}: trained on the parent plan before step "
                f"{plan.metadata.get('first_step')}, but it holds rows or steps",
            )
        ]
    return []


def _check_dataset(plan: OpenedPlan, lengths, loss_tokens) -> list[Violation]:
    if lengths.shape[0] != plan.num_samples:
        return [Violation("dataset", f"plan is for {plan.num_samples:,} samples, the dataset has {lengths.shape[0]:,}")]
    recorded = plan.metadata.get("lengths_fingerprint")
    if "mixture" in plan.metadata:  # a mixture's fingerprint is over its sources' (`_validate_mixture_plan`)
        return []
    actual = fingerprint_lengths(lengths, loss_tokens)
    if recorded is not None and recorded != actual:
        return [
            Violation(
                "dataset",
                f"lengths fingerprint {actual} differs from the plan's {recorded}; "
                "the plan was built for other data (or another loss-tokens column)",
            )
        ]
    return []


def _check_drop_last_allowed(plan: OpenedPlan) -> list[Violation]:
    dropped = plan.metadata.get("dropped", {})
    if dropped.get("drop_last") and not plan.metadata["config"].get("drop_last"):
        return [Violation("coverage", "samples are listed as dropped by drop_last, but the plan was built without it")]
    return []


def _check_dropped_reasons(plan: OpenedPlan, lengths) -> list[Violation]:
    found = []
    dropped = plan.metadata.get("dropped", {})
    max_tokens = plan.metadata["max_tokens"]
    rules = {"empty": lambda x: x <= 0, "oversize": lambda x: x > max_tokens}
    for reason, rule in rules.items():
        samples = np.asarray(dropped.get(reason, []), dtype=np.int64)
        if samples.size and not rule(lengths[samples]).all():
            found.append(Violation("coverage", f"samples listed as dropped for {reason!r} do not meet that reason"))
    return found
