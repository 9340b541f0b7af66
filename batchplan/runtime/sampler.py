"""`PlanSampler`: one rank's replay of a plan, as a ``DataLoader`` batch sampler.

Opening memory-maps the plan and decodes its metadata (no rows are read); the
first iteration of an epoch reads this rank's record batch of that epoch only, as
zero-copy numpy views. Each micro-batch then costs a few microseconds (one
record and one list; ``bench/sampler_overhead.py`` measures it).

Iteration yields `PlannedRows`: the dataset rows of a micro-batch, carrying its
`MicroBatch` record, which `PlanDataset` and the collators put on the batch
(``batch.record``). Epochs follow each other by themselves: iterating again after
an epoch is done walks the next one, and past the last one it raises, so a loop
that never calls ``set_epoch`` cannot train an epoch twice. ``state_dict`` says
where the loader is (epoch, micro-batches drawn); ``state_dict(after=record)``
says where training is, whatever the loader has prefetched.

This rank's rows of an epoch are checked when read (`batchplan.runtime.checks`): a
sample index beyond the dataset is a `PlanFormatError`, never a row served.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sized
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from torch.utils.data import Sampler

from batchplan.errors import ConfigError, PlanFormatError, PlanMismatchError
from batchplan.formats.opened_plan import OpenedPlan
from batchplan.formats.opening import open_plan
from batchplan.runtime.checks import check_plan_dataset, check_rank_rows, check_runtime_columns, span_cap
from batchplan.runtime.distributed import check_world_size, resolve_placement
from batchplan.runtime.records import MicroBatch, PlannedRows
from batchplan.runtime.rows import RankRows
from batchplan.runtime.state import check_state, make_identity, make_state

__all__ = ["PlanSampler"]


class PlanSampler(Sampler[list[int]]):
    """Replays this rank's micro-batches of a plan, epoch after epoch.

    Pass it as ``DataLoader(PlanDataset(dataset), batch_sampler=sampler,
    collate_fn=PackCollator())``; each batch then carries its plan record as
    ``batch.record``.

    Args:
        plan: a plan file (``batchplan build ... -o plan.arrow``), directory, or opened plan (used as is).
        rank: this process's data-parallel rank; default: ``torch.distributed``,
            then the ``RANK`` environment variable, then 0.
        world_size: number of data-parallel ranks; default like ``rank``. It must
            equal the plan's world size.

    Raises:
        PlanFormatError: the file is not a plan this runtime can read.
        PlanMismatchError: the run's world size is not the plan's.
        ConfigError: rank or world size are not valid integers.
    """

    def __init__(self, plan: str | os.PathLike | OpenedPlan, rank: int | None = None, world_size: int | None = None):
        self._plan = plan if isinstance(plan, OpenedPlan) else open_plan(plan)
        self._placement = resolve_placement(rank, world_size)
        check_world_size(self._placement, self._plan.world_size, self._plan.path)
        check_runtime_columns(self._plan)
        metadata = self._plan.metadata
        self._rows_per_epoch = [int(n) for n in metadata["rows_per_rank"]]
        self._sample_lengths: np.ndarray | None = None  # the dataset's, once check_dataset had them
        self._rows: RankRows | None = None
        self._move_to(0, 0)

    # -- what the plan and this rank are ------------------------------------------

    @property
    def path(self) -> Path:
        return self._plan.path

    @property
    def plan(self) -> OpenedPlan:
        """The opened plan (metadata, other ranks' rows for inspection)."""
        return self._plan

    @property
    def rank(self) -> int:
        return self._placement.rank

    @property
    def world_size(self) -> int:
        return self._placement.world_size

    @property
    def epoch(self) -> int:
        """The epoch that the next iteration walks (the last one once every epoch is done)."""
        return self._next_start()[0]

    @property
    def num_epochs(self) -> int:
        return self._plan.num_epochs

    @property
    def num_steps(self) -> int:
        """Optimizer steps of the whole plan, all epochs."""
        return self._plan.num_steps

    @property
    def steps_per_epoch(self) -> list[int]:
        return [int(n) for n in self._plan.metadata["steps_per_epoch"]]

    @property
    def first_step(self) -> int:
        """Global step of the plan's first row (0, or where a resharded plan starts)."""
        return int(self._plan.metadata.get("first_step", 0))

    @property
    def mode(self) -> str:
        """``"pack"`` or ``"pad"``: pick `PackCollator` or `PadCollator` to match."""
        return str(self._plan.metadata["mode"])

    @property
    def max_tokens(self) -> int:
        return int(self._plan.metadata["max_tokens"])

    @property
    def has_spans(self) -> bool:
        """True when entries are token spans of samples (``oversize="truncate"`` or ``"split"``)."""
        return "starts" in self._plan.schema.names

    @property
    def position(self) -> int:
        """Micro-batches of `epoch` drawn so far."""
        return self._position

    @property
    def finished(self) -> bool:
        """True once every micro-batch of every epoch has been drawn."""
        last = self.num_epochs - 1
        return self._epoch == last and self._position == self._rows_per_epoch[last]

    @property
    def batch_size(self) -> int:
        """A plan has no batch size: reading it is how wrappers re-batch or re-shard a batch
        sampler (Accelerate's ``BatchSamplerShard``, Lightning's sampler injection), which
        would move micro-batches between ranks; so it raises.

        Raises:
            PlanMismatchError: always, naming the integration to use instead.
        """
        raise PlanMismatchError(
            f"{self.path}: something is re-sharding the PlanSampler's micro-batches (it read batch_size): each "
            "rank's micro-batches are fixed by the plan. With Accelerate use "
            "batchplan.integrations.accelerate.prepare_plan_loader(accelerator, loader) instead of "
            "accelerator.prepare(loader); with Lightning pass use_distributed_sampler=False (or use "
            "batchplan.integrations.lightning.PlanDataModule); with Trainer use PlanTrainer"
        )

    def __len__(self) -> int:
        """Micro-batches the next iteration yields: its epoch's, less those already drawn."""
        epoch, start = self._next_start()
        return self._rows_per_epoch[epoch] - start

    def check_dataset(
        self,
        dataset: Sized | int,
        lengths: ArrayLike | None = None,
        *,
        loss_tokens: ArrayLike | None = None,
    ) -> None:
        """Raise unless the plan was built for this dataset; call it once before training.

        A plan indexes dataset rows, so on other data it trains without error on the
        wrong samples. The row count is compared always; given the dataset's token
        ``lengths`` (and ``loss_tokens``, for a plan built with a loss-tokens column),
        their fingerprint too, which catches another dataset of the same size or
        another row order. Cost: ``len(dataset)``; with lengths, one hash over them
        (~1 GB/s).

        Args:
            dataset: the map-style dataset (anything with ``len``), or its row count.
            lengths: token count of every row, in dataset order (``read_lengths(...).lengths``).
            loss_tokens: loss-token count of every row, when the plan was built with
                a loss-tokens column (``loss_tokens_column``).

        Raises:
            PlanMismatchError: another row count, or other lengths; the message names both.
            ConfigError: ``dataset`` has no length, or the plan needs ``loss_tokens``.
            PlanFormatError: lengths are given but the plan records no fingerprint.
        """
        check_plan_dataset(self._plan, dataset, lengths, loss_tokens)
        if lengths is not None:  # now known to be the plan's: rows read from here on are checked against them
            self._sample_lengths = np.asarray(lengths)
            self._rows = None

    # -- epochs and iteration -----------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Walk ``epoch`` next: from where a loaded state left it, else from its start.

        Not needed: iterating again after an epoch walks the next one. Calling it with
        the epoch the sampler is at changes nothing, so loops that call it every epoch
        (Trainer, Accelerate) keep a resumed position.

        Raises:
            PlanMismatchError: ``epoch`` is outside the plan, or differs from the
                epoch of a state just loaded (the caller's epoch counter was not
                restored with the sampler: following it would replay or skip data).
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise ConfigError(f"epoch must be an integer, got {epoch!r}")
        if not 0 <= epoch < self.num_epochs:
            raise PlanMismatchError(
                f"{self.path}: epoch {epoch} is beyond the plan, which has epochs 0..{self.num_epochs - 1}; "
                f"rebuild it with `epochs={epoch + 1}` or more to train longer"
            )
        if self._resume_pending:
            self._set_resumed_epoch(epoch)
        elif epoch != self._epoch or self._position != 0:
            self._move_to(epoch, 0)
        self._hold = True

    def _set_resumed_epoch(self, epoch: int) -> None:
        done = self._position == self._rows_per_epoch[self._epoch]
        if epoch == self._epoch:
            return
        if epoch == self._epoch + 1 and done:  # saved right at the end of an epoch
            self._move_to(epoch, 0, resume=True)
            return
        raise PlanMismatchError(
            f"{self.path}: set_epoch({epoch}) right after loading a state at epoch {self._epoch}, "
            f"micro-batch {self._position}: walking epoch {epoch} would "
            f"{'replay' if epoch < self._epoch else 'skip'} data. Restore the training loop's epoch "
            f"counter with the sampler (it is sampler.epoch = {self.epoch}), or do not call set_epoch"
        )

    def __iter__(self) -> Iterator[PlannedRows]:
        """This rank's remaining micro-batches of the epoch, as `PlannedRows`.

        The epoch and start are picked at the first ``next`` (so a state loaded after
        the iterator was made, as a stateful loader does, is honoured). Rows are
        `SpanIndex` ints when the plan has token spans (wrap the dataset in
        `PlanDataset` so the collators receive them).

        Raises:
            PlanMismatchError: every epoch of the plan is already done.
        """
        epoch, start = self._next_start(strict=True)
        self._move_to(epoch, start)
        for planned in self._epoch_rows().planned_rows(start):
            self._position = planned.record.position + 1
            yield planned

    def schedule(self) -> Iterator[MicroBatch]:
        """The records of the micro-batches the next iteration yields, without drawing them."""
        epoch, start = self._next_start()
        if epoch != self._epoch:
            return iter(self._read_rows(epoch).records(start))
        return self._epoch_rows().records(start)

    def _next_start(self, strict: bool = False) -> tuple[int, int]:
        """``(epoch, position)`` where the next iteration starts: an epoch whose every
        micro-batch was drawn gives way to the next one, unless set_epoch chose it."""
        if self._hold or self._position < self._rows_per_epoch[self._epoch]:
            return self._epoch, self._position
        if self._epoch + 1 < self.num_epochs:
            return self._epoch + 1, 0
        if strict:
            raise PlanMismatchError(
                f"{self.path}: all {self.num_epochs} epoch(s) of the plan are done on rank {self.rank}; "
                f"rebuild it with `epochs={self.num_epochs + 1}` or more to train longer, or stop the loop "
                "when sampler.finished is True"
            )
        return self._epoch, self._position

    def _epoch_rows(self) -> RankRows:
        if self._rows is None or self._rows.epoch != self._epoch:
            self._rows = self._read_rows(self._epoch)
        return self._rows

    def _read_rows(self, epoch: int) -> RankRows:
        """This rank's rows of ``epoch``, checked (`check_rank_rows`)."""
        read = self._plan.rank_rows(epoch, self.rank)
        expected = self._rows_per_epoch[epoch]
        if read.num_rows != expected:
            raise PlanFormatError(
                f"{self.path}: epoch {epoch} rank {self.rank} has {read.num_rows} rows but the "
                f"metadata says {expected}; the file is corrupt, rebuild it"
            )
        cap = span_cap(self._plan.metadata, epoch)
        rows = RankRows(read, epoch, self.world_size, rank=self.rank, span_cap=cap)
        check_rank_rows(rows, self._plan, self.rank, self._sample_lengths)
        return rows

    def _move_to(self, epoch: int, position: int, *, resume: bool = False) -> None:
        self._epoch = epoch
        self._position = position
        self._resume_pending = resume
        self._hold = False

    # -- checkpointing ----------------------------------------------------------------

    @cached_property
    def _identity(self) -> dict[str, Any]:
        """What a state is a position in (`make_identity`): hashed once, when first needed."""
        return make_identity(self._plan.metadata, self.rank, self.world_size)

    def state_dict(self, after: MicroBatch | None = None) -> dict[str, Any]:
        """Where this rank is: plan identity, rank, world size, epoch, micro-batches done.

        Without ``after``, the position is what the loader has drawn: exact with
        ``num_workers=0``, and what torchdata's ``StatefulDataLoader`` needs (it
        snapshots the sampler as each batch is drawn and returns the snapshot of the
        batch it yielded). A loader that prefetches (``num_workers > 0``, Accelerate's
        look-ahead) draws ahead of training: pass the record of the last micro-batch
        trained, ``state_dict(after=batch.record)``, and the state resumes right after
        it. Take it after an optimizer step so a resume starts on a step boundary.
        Small (about 300 bytes) and plain (``torch.save``/JSON-able).

        Raises:
            ConfigError: ``after`` is not a record this sampler has yielded.
        """
        if after is None:
            return make_state(self._identity, self._epoch, self._position)
        if not isinstance(after, MicroBatch):
            raise ConfigError(f"after must be a MicroBatch record (batch.record), got {type(after).__name__}")
        known = 0 <= after.epoch < self.num_epochs and 0 <= after.position < self._rows_per_epoch[after.epoch]
        if not known or (after.epoch, after.position) >= (self._epoch, self._position):
            raise ConfigError(
                f"record of epoch {after.epoch}, micro-batch {after.position} was not drawn by this sampler "
                f"(it is at epoch {self._epoch}, micro-batch {self._position}); pass the record of a batch "
                "this sampler's loader yielded"
            )
        return make_state(self._identity, after.epoch, after.position + 1)

    def state_at_step(self, step: int) -> dict[str, Any]:
        """The state of this rank right before global optimizer step ``step``.

        What a framework that counts optimizer steps (Trainer's ``global_step``,
        Lightning's ``global_step``) resumes from: ``step`` steps done. Reads one
        column of this rank's rows of one epoch.

        Raises:
            ConfigError: ``step`` is outside ``first_step..first_step + num_steps``.
        """
        steps = self.steps_per_epoch
        done = step - self.first_step
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= done <= sum(steps):
            raise ConfigError(
                f"step {step!r} is outside the plan, whose steps are {self.first_step}..{self.first_step + sum(steps)}"
            )
        epoch = 0
        while epoch < len(steps) - 1 and done >= steps[epoch]:
            done -= steps[epoch]
            epoch += 1
        rows = self._epoch_rows() if epoch == self._epoch else self._read_rows(epoch)
        position = int(np.searchsorted(rows.column("step"), step, side="left"))
        return make_state(self._identity, epoch, position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` was taken; the next iteration continues from there.

        A state taken at the end of an epoch continues with the next epoch. A
        following ``set_epoch`` with the saved epoch keeps the position; another
        epoch is an error (see `set_epoch`).

        A plan made by ``batchplan reshard`` also accepts a state of the plan it was
        resharded from (any rank, any world size of that plan) saved exactly at the
        step it was resharded from, and continues at that step: see docs/resharding.md.

        Raises:
            PlanMismatchError: the state belongs to another plan, rank or world size
                (the message names both values), or, for a resharded plan, is a
                parent's state saved at another step.
            PlanFormatError: ``state`` is not a PlanSampler state of a known version.
        """
        parent = self._plan.metadata.get("resharded_from")
        parent = parent if isinstance(parent, dict) else None
        epoch, position = check_state(state, self._identity, self._rows_per_epoch, parent)
        self._move_to(epoch, position, resume=True)

    def __getstate__(self) -> dict[str, Any]:
        # The memory map cannot be pickled: keep what reopens the plan at the same place.
        return {
            "path": str(self.path),
            "rank": self.rank,
            "world_size": self.world_size,
            "cursor": (self._epoch, self._position, self._resume_pending, self._hold),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        PlanSampler.__init__(self, state["path"], state["rank"], state["world_size"])  # the arguments kept
        self._epoch, self._position, self._resume_pending, self._hold = state["cursor"]

    def __repr__(self) -> str:
        return (
            f"PlanSampler({str(self.path)!r}, rank={self.rank}, world_size={self.world_size}, "
            f"epoch={self._epoch}, position={self._position})"
        )
