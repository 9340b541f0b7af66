"""The checks of one epoch of a plan file (`batchplan.operations.validate` runs them):
ranks, caps, counts, cost, step sums, the sequence-length warmup, coverage and spans."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from batchplan.formats.arrow import list_offsets, list_values, numpy_of
from batchplan.planning.cost import micro_batch_costs
from batchplan.reduce import segment_max, segment_sum, sum_by_group

__all__ = ["EpochChecker", "Violation"]


@dataclasses.dataclass(frozen=True)
class Violation:
    """One broken guarantee."""

    guarantee: str
    message: str

    def __str__(self) -> str:
        return f"[{self.guarantee}] {self.message}"


class EpochChecker:
    """The checks of one epoch; each method returns its violations."""

    def __init__(self, plan, epoch, lengths, loss_tokens, step_base, tokens_base, trained_before):
        self.plan, self.epoch, self.lengths = plan, epoch, lengths
        self.trained_whole, self.trained_spans = trained_before  # what a parent trained before
        self.loss_column = loss_tokens
        self.step_base, self.tokens_base = step_base, tokens_base
        self.meta = plan.metadata
        self.batches = [plan.read_rank(epoch, r) for r in range(plan.world_size)]
        table = pa.Table.from_batches(self.batches, plan.schema)  # the epoch, rank-major (as read_epoch)
        self.col = {name: table.column(name) for name in table.column_names}
        self._read: dict[str, np.ndarray] = {}
        self.offsets = list_offsets(self.col["samples"])
        self.samples = self.entries("samples")
        self.tokens = self.numbers("tokens")
        self.total_tokens = int(self.tokens.sum())

    def numbers(self, name: str) -> np.ndarray:
        """The epoch's values of a numeric column, in its dtype (read once)."""
        if name not in self._read:
            self._read[name] = numpy_of(self.col[name])
        return self._read[name]

    def entries(self, name: str) -> NDArray[np.int64]:
        """The epoch's entries of a list column (``samples``, ``starts``, ``lengths``) as int64,
        row after row (``self.offsets`` bound them; read once)."""
        key = f"{name}[]"
        if key not in self._read:
            self._read[key] = list_values(self.col[name]).astype(np.int64)
        return self._read[key]

    def fail(self, guarantee: str, message: str) -> list[Violation]:
        return [Violation(guarantee, f"epoch {self.epoch}: {message}")]

    def run(self) -> list[Violation]:
        found = self.check_ranks()
        if found:  # the rest assumes a well-formed layout
            return found
        if self.samples.size and (self.samples.min() < 0 or self.samples.max() >= self.plan.num_samples):
            return self.fail("integrity", "a sample index is outside the dataset")
        return self.check_caps() + self.check_counts() + self.check_seqlen_warmup() + self.check_coverage()

    def check_ranks(self) -> list[Violation]:
        steps = [numpy_of(b.column("step")) for b in self.batches]
        for rank, batch in enumerate(self.batches):
            if not (numpy_of(batch.column("rank")) == rank).all():
                return self.fail("integrity", f"rows of rank {rank} are stored under another rank")
            if not (numpy_of(batch.column("epoch")) == self.epoch).all():
                return self.fail("integrity", f"rank {rank} holds rows of another epoch")
            if not np.array_equal(steps[rank], steps[0]):
                return self.fail("equal_micro_batches", f"rank {rank} runs other micro-batch counts per step than rank 0")
        num_steps = self.meta["steps_per_epoch"][self.epoch]
        step = steps[0] - self.step_base
        if step.size and (np.any(np.diff(step) < 0) or step[0] != 0 or step[-1] != num_steps - 1):
            return self.fail("integrity", f"steps are not {self.step_base}..{self.step_base + num_steps - 1} in order")
        per_step = np.bincount(step, minlength=num_steps) if step.size else np.zeros(0, np.int64)
        if num_steps and (per_step == 0).any():
            return self.fail("integrity", "a step has no micro-batches")
        first = np.concatenate([[0], np.cumsum(per_step)[:-1]])
        expected_micro = np.arange(step.size) - first[step] if step.size else step
        for rank, batch in enumerate(self.batches):
            micro = numpy_of(batch.column("micro"))
            if not np.array_equal(micro, expected_micro):
                return self.fail("equal_micro_batches", f"rank {rank}'s micro indices are not 0..m-1 per step")
            if not np.array_equal(numpy_of(batch.column("num_micro")), per_step[step]):
                return self.fail("equal_micro_batches", f"rank {rank}'s num_micro disagrees with its rows")
        return []

    def entry_lengths(self) -> NDArray[np.int64] | None:
        if "lengths" in self.col:
            return self.entries("lengths")
        if self.lengths is not None:
            return self.lengths[self.samples].astype(np.int64)
        return None

    def check_caps(self) -> list[Violation]:
        cap = self.meta["max_tokens"]
        counts = np.diff(self.offsets)
        lengths = self.entry_lengths()
        if self.meta["mode"] == "pad":
            longest = segment_max(lengths, self.offsets) if lengths is not None else None
            load = self.numbers("padded_tokens") if longest is None else counts * longest
        else:
            load = segment_sum(lengths, self.offsets) if lengths is not None else self.tokens
        over = np.flatnonzero(load > cap)
        if over.size:
            what = "count x longest" if self.meta["mode"] == "pad" else "tokens"
            return self.fail("max_tokens", f"{over.size:,} micro-batches exceed max_tokens {cap:,} "
                             f"({what} up to {int(load[over].max()):,})")  # fmt: skip
        return []

    def check_counts(self) -> list[Violation]:
        found = []
        lengths = self.entry_lengths()
        if lengths is not None:
            if not np.array_equal(segment_sum(lengths, self.offsets), self.tokens):
                found += self.fail("counts", "a micro-batch's tokens differ from the sum of its samples' lengths")
            if self.meta["mode"] == "pad":
                padded = np.diff(self.offsets) * segment_max(lengths, self.offsets)
                if not np.array_equal(padded, self.numbers("padded_tokens")):
                    found += self.fail("counts", "padded_tokens differs from count x longest")
            loss = self.numbers("loss_tokens")
            if self.loss_column is not None and "lengths" not in self.col:
                per_entry = np.asarray(self.loss_column)[self.samples].astype(np.int64)
            else:
                per_entry = lengths - 1
            if not np.array_equal(segment_sum(per_entry, self.offsets), loss):
                found += self.fail("counts", "a micro-batch's loss_tokens differ from its samples' loss tokens")
            if "cost" in self.col:
                found += self.check_cost(lengths)
        found += self.check_step_sums()
        return found

    def check_cost(self, lengths) -> list[Violation]:
        coefficient = float(self.meta["attention_coefficient"])
        expected = micro_batch_costs(lengths, self.offsets, self.meta["mode"], coefficient)
        if not np.allclose(self.numbers("cost"), expected, rtol=1e-9, atol=0.0):
            return self.fail("counts", "a micro-batch's cost differs from the cost model of its samples")
        return []

    def check_step_sums(self) -> list[Violation]:
        step = self.numbers("step") - self.step_base
        num_steps = self.meta["steps_per_epoch"][self.epoch]
        found = []
        for name, per_row in (("step_tokens", self.tokens), ("step_loss_tokens", self.numbers("loss_tokens"))):
            sums = sum_by_group(step, per_row, num_steps)
            if not np.array_equal(sums[step], self.numbers(name)):
                found += self.fail("counts", f"{name} is not the sum over all ranks of the step")
        sums = sum_by_group(step, self.tokens, num_steps)
        before = self.tokens_base + np.cumsum(sums) - sums
        if not np.array_equal(before[step], self.numbers("tokens_before_step")):
            found += self.fail("counts", "tokens_before_step is not the running total of step tokens")
        return found

    def check_seqlen_warmup(self) -> list[Violation]:
        """No sequence above the warmup cap at the end of its step (not checked on a
        resharded plan, which schedules the rest of a warmup anew)."""
        config = self.meta["config"]
        low, span = config.get("seqlen_warmup_min"), config.get("seqlen_warmup_tokens")
        if low is None or "resharded_from" in self.meta:
            return []
        if "lengths" not in self.col:
            return self.fail("seqlen_warmup", "the plan has a sequence-length warmup but no spans")
        step = self.numbers("step") - self.step_base
        sums = sum_by_group(step, self.tokens, self.meta["steps_per_epoch"][self.epoch])
        step_end = self.tokens_base + np.cumsum(sums)
        warm = np.flatnonzero(step_end < span)  # steps that end inside the warmup
        # Exact integer caps (Python ints: no overflow), one per step inside the warmup.
        cap = np.full(sums.shape[0], self.meta["max_tokens"], dtype=np.int64)
        cap[warm] = [low + (self.meta["max_tokens"] - low) * int(t) // span for t in step_end[warm]]
        longest = segment_max(self.entries("lengths"), self.offsets)
        over = np.flatnonzero(longest > cap[step])
        if over.size:
            row = int(over[0])
            where = f"step {int(step[row]) + self.step_base}: {int(longest[row]):,} > {int(cap[step[row]]):,}"
            message = f"{over.size:,} micro-batches hold a sequence above the warmup cap ({where})"
            return self.fail("seqlen_warmup", message)
        return []

    def check_coverage(self) -> list[Violation]:
        num_samples = self.plan.num_samples
        dropped = self.meta.get("dropped", {})
        always = np.concatenate([np.asarray(dropped.get(r, []), dtype=np.int64) for r in ("empty", "oversize")])
        last = np.asarray(dropped.get("drop_last", {}).get(str(self.epoch), []), dtype=np.int64)
        seen = np.bincount(self.samples, minlength=num_samples) + self.trained_whole
        seen += np.bincount(self.trained_spans[:, 0], minlength=num_samples)
        if (seen[always] > 0).any():
            return self.fail("coverage", "a sample listed as dropped is in the plan (or was trained before it)")
        if "starts" in self.col:
            return self.check_spans(always, last)
        if self.trained_spans.size:
            return self.fail("coverage", "pieces of samples are listed as consumed in a plan without spans")
        expected = np.ones(num_samples, dtype=bool)
        expected[always] = False
        expected[last] = False
        wrong = np.flatnonzero((seen != 1) & expected)
        if wrong.size:
            first = int(wrong[0])
            return self.fail("coverage", f"{wrong.size:,} samples are not planned exactly once "
                             f"(sample {first:,} appears {int(seen[first])} times)")  # fmt: skip
        if (seen[last] > 0).any():
            return self.fail("coverage", "a sample dropped by drop_last is in the plan (or was trained before it)")
        return []

    def kept_lengths(self) -> NDArray[np.int64]:
        """Tokens of each sample that an epoch covers (truncate keeps the first max_tokens)."""
        want = self.lengths.astype(np.int64)
        if self.meta["config"]["oversize"] == "truncate":
            want = np.minimum(want, self.meta["max_tokens"])
        return want

    def check_spans(self, always, last) -> list[Violation]:
        """Truncated or split samples: the planned pieces, the pieces dropped by drop_last
        and (resharded plans) the pieces trained before never overlap and tile each
        sample's kept tokens exactly."""
        spans = self.meta.get("dropped", {}).get("drop_last_spans", {}).get(str(self.epoch), [])
        spans = np.asarray(spans, dtype=np.int64).reshape(-1, 3)
        if not np.array_equal(np.unique(spans[:, 0]), np.unique(last)):
            return self.fail("coverage", "drop_last lists other samples than its dropped pieces")
        trained = self.trained_spans
        sample = np.concatenate([self.samples, spans[:, 0], trained[:, 0]])
        start = np.concatenate([self.entries("starts"), spans[:, 1], trained[:, 1]])
        length = np.concatenate([self.entries("lengths"), spans[:, 2], trained[:, 2]])
        whole = np.flatnonzero(self.trained_whole)
        if np.isin(whole, sample).any():
            return self.fail("coverage", "a sample trained whole before the plan's first step is planned again")
        want = None if self.lengths is None else self.kept_lengths()
        if want is not None:  # a sample trained whole is one piece covering it
            sample, start = np.concatenate([sample, whole]), np.concatenate([start, np.zeros_like(whole)])
            length = np.concatenate([length, want[whole]])
        order = np.lexsort((start, sample))
        sample, start, length = sample[order], start[order], length[order]
        same = sample[1:] == sample[:-1]
        if (same & (start[1:] < start[:-1] + length[:-1])).any():
            return self.fail("coverage", "two pieces of a sample overlap")
        expected = np.ones(self.plan.num_samples, dtype=bool)
        expected[always] = False
        pieces = np.bincount(sample, minlength=expected.size) + self.trained_whole
        if want is None:
            if (pieces[expected] == 0).any():
                return self.fail("coverage", "a sample is neither planned, trained before, nor listed as dropped")
            return []
        if (start + length > want[sample]).any():
            return self.fail("coverage", "a piece reaches past the end of its sample")
        first_piece = np.concatenate([[True], ~same])
        if (start[first_piece] != 0).any():
            return self.fail("coverage", "a sample's first piece does not start at token 0")
        # Without overlaps, from token 0 and never past the end: equal totals mean no gap.
        covered = np.bincount(sample, weights=length, minlength=expected.size).astype(np.int64)
        wrong = np.flatnonzero(expected & (covered != want))
        if wrong.size:
            return self.fail("coverage", f"{wrong.size:,} samples are not covered exactly once "
                             f"(sample {int(wrong[0]):,})")  # fmt: skip
        return []
