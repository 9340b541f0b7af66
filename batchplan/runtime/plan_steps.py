"""`PlanSteps`: a plan loader's batches grouped into optimizer steps, checked as they come.

For training loops that take one *step* per batch (Hugging Face ``Trainer`` with
``gradient_accumulation_steps=1``, Lightning's manual optimisation): each item is
a `PlanStep`, the list of this rank's micro-batches of one step, so steps whose
micro-batch count varies (``tokens_per_step``) stay whole. Every micro-batch's
record is checked against the one before it (same epoch, next position, step
boundaries where the plan has them), so a loader that skips, repeats or reorders
micro-batches raises `PlanMismatchError` instead of training on the wrong data.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from batchplan.errors import PlanMismatchError
from batchplan.runtime.batch import PlanBatch, record_of
from batchplan.runtime.records import MicroBatch
from batchplan.runtime.sampler import PlanSampler

__all__ = ["PlanStep", "PlanSteps"]


class PlanStep(list):
    """This rank's micro-batches (`PlanBatch`) of one optimizer step, in plan order."""

    @property
    def step(self) -> int:
        return self[-1].record.step

    @property
    def step_loss_tokens(self) -> int:
        """Loss tokens of the whole step on all ranks: the exact loss normaliser."""
        return self[-1].record.step_loss_tokens


class PlanSteps:
    """Iterates a plan loader one `PlanStep` at a time.

    Args:
        loader: yields `PlanBatch` items of ``sampler`` (a ``DataLoader`` with
            ``batch_sampler=sampler``, ``PlanDataset`` and a plan collator).
        sampler: the loader's `PlanSampler`.
    """

    def __init__(self, loader: Iterable[PlanBatch], sampler: PlanSampler) -> None:
        self.loader = loader
        self.sampler = sampler

    @property
    def dataset(self):
        return getattr(self.loader, "dataset", None)

    def __len__(self) -> int:
        """Steps the next iteration yields (those left of its epoch)."""
        return len({record.step for record in self.sampler.schedule()})

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[PlanStep]:
        step, previous = PlanStep(), None
        for batch in self.loader:
            record = record_of(batch)
            check_follows(previous, record)
            step.append(batch)
            previous = record
            if record.is_last:
                yield step
                step = PlanStep()
        if step:
            assert previous is not None  # the step holds a micro-batch
            raise PlanMismatchError(
                f"the loader ended inside step {previous.step} after micro-batch {previous.micro} of "
                f"{previous.num_micro}; the plan's steps must arrive whole"
            )


def check_follows(previous: MicroBatch | None, record: MicroBatch) -> None:
    """Raise unless ``record`` is the micro-batch right after ``previous`` on this rank.

    The first record of an iteration (``previous`` None) must open a step.
    """
    if previous is None:
        if record.micro != 0:
            raise PlanMismatchError(
                f"the first micro-batch is micro-batch {record.micro} of step {record.step}; the loader skipped "
                "the start of the step (something re-sharded or skipped the plan's batches)"
            )
        return
    if record.epoch == previous.epoch and record.position == previous.position + 1:
        return
    raise PlanMismatchError(
        f"micro-batch {record.position} of epoch {record.epoch} came right after micro-batch {previous.position} "
        f"of epoch {previous.epoch}: the loader skipped, repeated or reordered the plan's micro-batches "
        "(a wrapper that re-shards the batch sampler, such as accelerator.prepare, does this)"
    )
