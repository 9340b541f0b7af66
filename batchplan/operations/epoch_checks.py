"""The checks of one epoch of a plan (`batchplan.operations.validate` runs them): ranks, caps,
counts, cost, step sums, the sequence-length warmup, coverage and spans.

They read one rank's record batch at a time, in two passes over the ranks. The first checks
the layout (each rank's rows are its own, of this epoch, in the same steps as rank 0's and
numbered 0..m-1 per step) and sums ``tokens`` and ``loss_tokens`` per step over all ranks; the
second checks every row against its entries and those sums, and counts coverage
(`batchplan.operations.coverage`). Memory: one rank's rows, a few numbers per step and one byte
per sample; sample indices stay in their stored dtype (int32 below 2³¹ samples).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
from numpy.typing import NDArray

from batchplan.formats.plan_rows import PlanRows
from batchplan.operations.coverage import EpochCoverage, RankEntries
from batchplan.planning.cost import micro_batch_costs
from batchplan.reduce import segment_max, segment_sum

__all__ = ["EpochChecker", "Violation"]

# The checks of ``counts``, in the order they are reported.
_COUNTS = {
    "tokens": "a micro-batch's tokens differ from the sum of its samples' lengths",
    "padded_tokens": "padded_tokens differs from count x longest",
    "loss_tokens": "a micro-batch's loss_tokens differ from its samples' loss tokens",
    "cost": "a micro-batch's cost differs from the cost model of its samples",
    "step_tokens": "step_tokens is not the sum over all ranks of the step",
    "step_loss_tokens": "step_loss_tokens is not the sum over all ranks of the step",
    "tokens_before_step": "tokens_before_step is not the running total of step tokens",
}


@dataclasses.dataclass(frozen=True)
class Violation:
    """One broken guarantee."""

    guarantee: str
    message: str

    def __str__(self) -> str:
        return f"[{self.guarantee}] {self.message}"


@dataclasses.dataclass
class _Steps:
    """The epoch's steps, the same on every rank (the first pass finds them)."""

    step: NDArray[np.int64]  # each row's step, from the epoch's first (0-based)
    micro: NDArray[np.int64]  # each row's expected ``micro``
    num_micro: NDArray[np.int64]  # each row's expected ``num_micro``
    bounds: NDArray[np.int64]  # shape (num_steps + 1,): a rank's rows of step k are bounds[k]:bounds[k + 1]
    tokens: NDArray[np.int64]  # per step, summed over all ranks
    loss_tokens: NDArray[np.int64]


@dataclasses.dataclass
class _Tally:
    """What the second pass finds, rank after rank."""

    over_cap: int = 0  # micro-batches above max_tokens
    heaviest: int = 0  # the largest of their loads
    wrong: set[str] = dataclasses.field(default_factory=set)  # keys of _COUNTS
    over_warmup: int = 0  # micro-batches above their step's warmup cap
    first_over_warmup: str = ""


class EpochChecker:
    """The checks of one epoch: `run` returns their violations."""

    def __init__(self, plan, epoch, lengths, loss_tokens, step_base, tokens_base, trained_before) -> None:
        self.plan, self.epoch, self.lengths = plan, epoch, lengths
        whole, self.trained_spans = trained_before  # what a parent trained before
        self.trained_whole = whole if whole is not None and whole.any() else None
        self.loss_column = None if loss_tokens is None else np.asarray(loss_tokens)
        self.step_base, self.tokens_base = step_base, tokens_base
        self.meta = plan.metadata
        self.has_spans = "starts" in plan.schema.names
        self.is_mixture = "mixture" in self.meta
        self._steps: _Steps | None = None  # set by `check_ranks` (`read_steps`) when the layout holds
        self.total_tokens = 0  # the epoch's tokens, summed by `check_ranks`

    def fail(self, guarantee: str, message: str) -> list[Violation]:
        return [Violation(guarantee, f"epoch {self.epoch}: {message}")]

    def run(self) -> list[Violation]:
        found = self.check_ranks()
        if found:  # the rest assumes a well-formed layout
            return found
        tally, coverage, caps = _Tally(), self.coverage(), self.warmup_caps()
        for rank in range(self.plan.world_size):
            rows = self.plan.rank_rows(self.epoch, rank, checked=False)
            samples = rows.entries("samples")
            if samples.size and (samples.min() < 0 or samples.max() >= self.plan.num_samples):
                return self.fail("integrity", "a sample index is outside the dataset")
            self.check_rows(rows, tally, caps)
            if not self.is_mixture:
                coverage.add(samples, *self.spans(rows))
        # A mixture's epochs hold parts of its sources' passes (`batchplan.operations.mixture_checks`).
        return self.report(tally) + ([] if self.is_mixture else self.check_coverage(coverage))

    # -- first pass: the layout ----------------------------------------------------------------

    def check_ranks(self) -> list[Violation]:
        """Every rank's rows are its own and of this epoch, in rank 0's steps, numbered 0..m-1 per
        step; sums every rank's ``tokens`` (`total_tokens`, even when a check fails) and, per step,
        ``tokens`` and ``loss_tokens`` (`steps`). A row stored wrongly is reported before the steps."""
        stored: list[Violation] = []  # a rank's rows stored under another rank or epoch
        layout: list[Violation] = []  # the steps or micro indices
        first = None  # rank 0's steps
        for rank in range(self.plan.world_size):
            rows = self.plan.rank_rows(self.epoch, rank, checked=False)
            self.total_tokens += int(rows.numbers("tokens").sum())
            if stored:
                continue
            first = rows.numbers("step") if first is None else first
            stored = self.check_stored(rank, rows, first)
            if not (stored or layout):
                layout = (self.read_steps(first) if rank == 0 else []) or self.check_micro(rank, rows)
        if stored or layout:
            self._steps = None
        return stored or layout

    def check_stored(self, rank: int, rows: PlanRows, first: np.ndarray) -> list[Violation]:
        if not (rows.numbers("rank") == rank).all():
            return self.fail("integrity", f"rows of rank {rank} are stored under another rank")
        if not (rows.numbers("epoch") == self.epoch).all():
            return self.fail("integrity", f"rank {rank} holds rows of another epoch")
        if not np.array_equal(rows.numbers("step"), first):
            return self.fail("equal_micro_batches", f"rank {rank} runs other micro-batch counts per step than rank 0")
        return []

    def read_steps(self, first: np.ndarray) -> list[Violation]:
        """`steps` from rank 0's rows: steps in order, each with micro-batches."""
        num_steps = self.meta["steps_per_epoch"][self.epoch]
        step = first - self.step_base
        if step.size and (np.any(np.diff(step) < 0) or step[0] != 0 or step[-1] != num_steps - 1):
            return self.fail("integrity", f"steps are not {self.step_base}..{self.step_base + num_steps - 1} in order")
        per_step = np.bincount(step, minlength=num_steps) if step.size else np.zeros(0, np.int64)
        if num_steps and (per_step == 0).any():
            return self.fail("integrity", "a step has no micro-batches")
        bounds = np.zeros(per_step.shape[0] + 1, dtype=np.int64)
        np.cumsum(per_step, out=bounds[1:])
        micro = np.arange(step.size) - bounds[step] if step.size else step
        zeros = np.zeros(per_step.shape[0], dtype=np.int64)
        self._steps = _Steps(step, micro, per_step[step], bounds, zeros, zeros.copy())
        return []

    @property
    def steps(self) -> _Steps:
        """The epoch's steps, read by `check_ranks`; every check after it runs on a well-formed layout."""
        assert self._steps is not None  # `run` stops when check_ranks finds the layout broken
        return self._steps

    def check_micro(self, rank: int, rows: PlanRows) -> list[Violation]:
        """Micro indices 0..m-1 per step; adds the rank's tokens and loss tokens to the step sums."""
        if not np.array_equal(rows.numbers("micro"), self.steps.micro):
            return self.fail("equal_micro_batches", f"rank {rank}'s micro indices are not 0..m-1 per step")
        if not np.array_equal(rows.numbers("num_micro"), self.steps.num_micro):
            return self.fail("equal_micro_batches", f"rank {rank}'s num_micro disagrees with its rows")
        self.steps.tokens += segment_sum(rows.numbers("tokens"), self.steps.bounds)
        self.steps.loss_tokens += segment_sum(rows.numbers("loss_tokens"), self.steps.bounds)
        return []

    # -- second pass: each rank's rows ---------------------------------------------------------

    def check_rows(self, rows: PlanRows, tally: _Tally, caps: NDArray[np.int64] | None) -> None:
        """One rank's caps, counts, cost, step sums and warmup caps, into ``tally``."""
        lengths = self.entry_lengths(rows)
        totals = longest = None
        if lengths is not None:
            totals = segment_sum(lengths, rows.offsets("samples"))
            longest = segment_max(lengths, rows.offsets("samples")) if self.meta["mode"] == "pad" else None
            self.check_counts(rows, lengths, totals, longest, tally)
        self.check_caps(rows, totals, longest, tally)
        self.check_step_sums(rows, tally)
        if caps is not None:
            self.check_seqlen_warmup(rows, caps, tally)

    def entry_lengths(self, rows: PlanRows) -> np.ndarray | None:
        """Tokens of each entry: the plan's ``lengths``, else the dataset's; None without either."""
        if self.has_spans:
            return rows.entries("lengths")
        if self.lengths is not None:
            return self.lengths[rows.entries("samples")]
        return None

    def check_caps(self, rows: PlanRows, totals, longest, tally: _Tally) -> None:
        if self.meta["mode"] == "pad":
            load = rows.numbers("padded_tokens") if totals is None else rows.counts() * longest
        else:
            load = rows.numbers("tokens") if totals is None else totals
        over = load > self.meta["max_tokens"]
        if over.any():
            tally.over_cap += int(np.count_nonzero(over))
            tally.heaviest = max(tally.heaviest, int(load[over].max()))

    def check_counts(self, rows: PlanRows, lengths, totals, longest, tally: _Tally) -> None:
        counts = rows.counts()
        if not np.array_equal(totals, rows.numbers("tokens")):
            tally.wrong.add("tokens")
        if longest is not None and not np.array_equal(counts * longest, rows.numbers("padded_tokens")):
            tally.wrong.add("padded_tokens")
        if self.loss_column is not None and not self.has_spans:
            loss = segment_sum(self.loss_column[rows.entries("samples")], rows.offsets("samples"))
        else:
            loss = totals - counts  # an entry of L tokens has L - 1 loss tokens
        if not np.array_equal(loss, rows.numbers("loss_tokens")):
            tally.wrong.add("loss_tokens")
        if "cost" in self.plan.schema.names:
            coefficient = float(self.meta["attention_coefficient"])
            expected = micro_batch_costs(lengths, rows.offsets("samples"), self.meta["mode"], coefficient)
            if not np.allclose(rows.numbers("cost"), expected, rtol=1e-9, atol=0.0):
                tally.wrong.add("cost")

    def check_step_sums(self, rows: PlanRows, tally: _Tally) -> None:
        step, steps = self.steps.step, self.steps
        for name, sums in (("step_tokens", steps.tokens), ("step_loss_tokens", steps.loss_tokens)):
            if not np.array_equal(sums[step], rows.numbers(name)):
                tally.wrong.add(name)
        before = self.tokens_base + np.cumsum(steps.tokens) - steps.tokens
        if not np.array_equal(before[step], rows.numbers("tokens_before_step")):
            tally.wrong.add("tokens_before_step")

    def warmup_caps(self) -> NDArray[np.int64] | None:
        """Under a sequence-length warmup, the longest entry each step may hold: the cap at the
        tokens of the run when the step ends (`batchplan.planning.warmup`); None when there is
        nothing to check (no warmup; no spans, which `report` names; a resharded plan, which
        schedules the rest of a warmup anew)."""
        config = self.meta["config"]
        low, span = config.get("seqlen_warmup_min"), config.get("seqlen_warmup_tokens")
        if low is None or "resharded_from" in self.meta or not self.has_spans:
            return None
        step_end = self.tokens_base + np.cumsum(self.steps.tokens)
        warm = np.flatnonzero(step_end < span)  # steps that end inside the warmup
        # Exact integer caps (Python ints: no overflow), one per step inside the warmup.
        cap = np.full(step_end.shape[0], self.meta["max_tokens"], dtype=np.int64)
        cap[warm] = [low + (self.meta["max_tokens"] - low) * int(t) // span for t in step_end[warm]]
        return cap

    def check_seqlen_warmup(self, rows: PlanRows, caps: NDArray[np.int64], tally: _Tally) -> None:
        step = self.steps.step
        longest = segment_max(rows.entries("lengths"), rows.offsets("samples"))
        over = np.flatnonzero(longest > caps[step])
        if over.size:
            if not tally.first_over_warmup:
                row = int(over[0])
                tally.first_over_warmup = (
                    f"step {int(step[row]) + self.step_base}: {int(longest[row]):,} > {int(caps[step[row]]):,}"
                )
            tally.over_warmup += over.size

    def report(self, tally: _Tally) -> list[Violation]:
        """The second pass's violations, in the order of the checks."""
        found = []
        if tally.over_cap:
            what = "count x longest" if self.meta["mode"] == "pad" else "tokens"
            found += self.fail(
                "max_tokens",
                f"{tally.over_cap:,} micro-batches exceed max_tokens "
                f"{self.meta['max_tokens']:,} ({what} up to {tally.heaviest:,})",
            )
        found += [v for key, message in _COUNTS.items() if key in tally.wrong for v in self.fail("counts", message)]
        config = self.meta["config"]
        if config.get("seqlen_warmup_min") is not None and "resharded_from" not in self.meta and not self.has_spans:
            found += self.fail("seqlen_warmup", "the plan has a sequence-length warmup but no spans")
        if tally.over_warmup:
            message = f"{tally.over_warmup:,} micro-batches hold a sequence above the warmup cap"
            found += self.fail("seqlen_warmup", f"{message} ({tally.first_over_warmup})")
        return found

    # -- coverage --------------------------------------------------------------------------------

    def coverage(self) -> EpochCoverage:
        cap = None
        if self.lengths is not None and self.meta["config"]["oversize"] == "truncate":
            cap = self.meta["max_tokens"]  # an epoch covers a truncated sample's first max_tokens
        return EpochCoverage(
            self.plan.num_samples, self.has_spans, self.lengths, cap, self.trained_whole, self.trained_spans
        )

    def check_coverage(self, coverage: EpochCoverage) -> list[Violation]:
        dropped = self.meta.get("dropped", {})
        always = np.concatenate([np.asarray(dropped.get(r, []), dtype=np.int64) for r in ("empty", "oversize")])
        last = np.asarray(dropped.get("drop_last", {}).get(str(self.epoch), []), dtype=np.int64)
        spans = np.zeros((0, 3), dtype=np.int64)
        if self.has_spans:
            spans = dropped.get("drop_last_spans", {}).get(str(self.epoch), [])
            spans = np.asarray(spans, dtype=np.int64).reshape(-1, 3)
        message = coverage.check(always, last, spans, self.rank_entries)
        return self.fail("coverage", message) if message else []

    def spans(self, rows: PlanRows) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Each entry's first token and tokens (None, None in a plan without spans)."""
        return (rows.entries("starts"), rows.entries("lengths")) if self.has_spans else (None, None)

    def rank_entries(self) -> Iterator[RankEntries]:
        """Every rank's entries, read again (coverage's second pass)."""
        for rank in range(self.plan.world_size):
            rows = self.plan.rank_rows(self.epoch, rank, checked=False)
            yield (rows.entries("samples"), *self.spans(rows))
