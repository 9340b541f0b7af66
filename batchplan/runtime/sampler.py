"""`PlanSampler`: one rank's replay of a plan, as a ``DataLoader`` batch sampler.

Opening memory-maps the plan and decodes its metadata (no rows are read); the
first iteration of an epoch reads this rank's record batch of that epoch only, as
zero-copy numpy views. Each micro-batch then costs about a microsecond (measured
by ``bench/sampler_overhead.py``).

Two iterators walk the same rows in the same order: ``iter(sampler)`` yields the
dataset rows of each micro-batch (what ``DataLoader(batch_sampler=...)`` fetches)
and `PlanSampler.schedule` yields the matching `MicroBatch` records (step, loss
normaliser, ...). ``state_dict`` counts the micro-batches the training loop has
taken from ``schedule()``; without ``schedule()`` it counts what the loader drew,
which runs ahead of training by the prefetched batches when ``num_workers > 0``.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any

from numpy.typing import ArrayLike
from torch.utils.data import Sampler

from batchplan.errors import ConfigError, PlanFormatError, PlanMismatchError
from batchplan.plan_file import PlanFile
from batchplan.runtime.distributed import check_world_size, resolve_placement
from batchplan.runtime.records import MicroBatch
from batchplan.runtime.rows import RUNTIME_COLUMNS, RankRows
from batchplan.runtime.state import check_state, make_state

__all__ = ["PlanSampler"]


class PlanSampler(Sampler[list[int]]):
    """Replays this rank's micro-batches of a plan, epoch by epoch.

    Pass it as ``DataLoader(dataset, batch_sampler=sampler, collate_fn=...)`` and
    iterate ``zip(sampler.schedule(), loader)`` to get each batch with its record.

    Args:
        path: the plan file (``batchplan build ... -o plan.arrow``).
        rank: this process's data-parallel rank; default: ``torch.distributed``,
            then the ``RANK`` environment variable, then 0.
        world_size: number of data-parallel ranks; default like ``rank``. It must
            equal the plan's world size.

    Raises:
        PlanFormatError: the file is not a plan this runtime can read.
        PlanMismatchError: the run's world size is not the plan's.
        ConfigError: rank or world size are not valid integers.
    """

    def __init__(self, path: str | os.PathLike, rank: int | None = None, world_size: int | None = None) -> None:
        self._plan = PlanFile(path)
        self._placement = resolve_placement(rank, world_size)
        check_world_size(self._placement, self._plan.world_size, self._plan.path)
        _check_runtime_columns(self._plan)
        metadata = self._plan.metadata
        self._rows_per_epoch = [int(n) for n in metadata["rows_per_rank"]]
        self._identity = {
            "content_hash": metadata.get("content_hash"),
            "config_fingerprint": metadata.get("config_fingerprint"),
            "world_size": self._placement.world_size,
            "rank": self._placement.rank,
        }
        self._rows: RankRows | None = None
        self._move_to(0, 0, resume=False)

    # -- what the plan and this rank are ------------------------------------------

    @property
    def path(self) -> Path:
        return self._plan.path

    @property
    def plan(self) -> PlanFile:
        """The opened plan file (metadata, other ranks' rows for inspection)."""
        return self._plan

    @property
    def rank(self) -> int:
        return self._placement.rank

    @property
    def world_size(self) -> int:
        return self._placement.world_size

    @property
    def epoch(self) -> int:
        """The epoch that the next iteration walks."""
        return self._epoch

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
    def mode(self) -> str:
        """``"pack"`` or ``"pad"``: pick `PackCollator` or `PadCollator` to match."""
        return str(self._plan.metadata["mode"])

    @property
    def max_tokens(self) -> int:
        return int(self._plan.metadata["max_tokens"])

    @property
    def has_spans(self) -> bool:
        """True when entries are token spans of samples (``--oversize truncate|split``)."""
        return "starts" in self._plan.schema.names

    @property
    def position(self) -> int:
        """Micro-batches of the current epoch consumed so far (what ``state_dict`` saves)."""
        return self._drawn if self._consumed is None else self._consumed

    def __len__(self) -> int:
        """Micro-batches the next iteration yields: the epoch's, less those done before a resume."""
        return self._rows_per_epoch[self._epoch] - self._start

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
                ``--loss-tokens-column``.

        Raises:
            PlanMismatchError: another row count, or other lengths; the message names both.
            ConfigError: ``dataset`` has no length, or the plan needs ``loss_tokens``.
            PlanFormatError: lengths are given but the plan records no fingerprint.
        """
        _check_dataset(self._plan, dataset, lengths, loss_tokens)

    # -- epochs and iteration -----------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Walk ``epoch`` next, from its start, unless a loaded state resumes inside it.

        Raises:
            PlanMismatchError: ``epoch`` is outside the plan's epochs.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise ConfigError(f"epoch must be an integer, got {epoch!r}")
        if not 0 <= epoch < self.num_epochs:
            raise PlanMismatchError(
                f"{self.path}: epoch {epoch} is beyond the plan, which has epochs 0..{self.num_epochs - 1}; "
                f"rebuild it with --epochs {epoch + 1} or more to train longer"
            )
        if self._resume_pending and epoch == self._epoch:
            return
        self._move_to(epoch, 0, resume=False)

    def __iter__(self) -> Iterator[list[int]]:
        """Dataset rows of each of this rank's remaining micro-batches of the epoch.

        Rows are `SpanIndex` ints when the plan has token spans (wrap the dataset
        in `PlanDataset` so the collators receive them).
        """
        for position, indices in enumerate(self._begin().index_lists(self._start), self._start + 1):
            self._drawn = position
            yield indices

    def schedule(self) -> Iterator[MicroBatch]:
        """The `MicroBatch` records matching ``iter(self)``, one per micro-batch, same order.

        From this call on, ``state_dict`` counts the records taken from it. Like
        ``iter(self)``, it picks its start at its first ``next``, so a state loaded in
        between (a stateful loader restoring itself when iterated) is honoured.
        """
        self._consumed = self._start
        return self._take()

    def _take(self) -> Iterator[MicroBatch]:
        rows = self._begin()
        self._consumed = self._start
        for record in rows.records(self._start):
            self._consumed = record.position + 1
            yield record

    def _begin(self) -> RankRows:
        self._resume_pending = False
        return self._epoch_rows()

    def _epoch_rows(self) -> RankRows:
        if self._rows is None or self._rows.epoch != self._epoch:
            batch = self._plan.read_rank(self._epoch, self.rank)
            expected = self._rows_per_epoch[self._epoch]
            if batch.num_rows != expected:
                raise PlanFormatError(
                    f"{self.path}: epoch {self._epoch} rank {self.rank} has {batch.num_rows} rows but the "
                    f"metadata says {expected}; the file is corrupt, rebuild it"
                )
            self._rows = RankRows(batch, self._epoch, self.path)
        return self._rows

    def _move_to(self, epoch: int, position: int, *, resume: bool) -> None:
        self._epoch = epoch
        self._start = position
        self._drawn = position
        self._consumed: int | None = None
        self._resume_pending = resume

    # -- checkpointing ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: plan identity, rank, world size, epoch, micro-batches consumed.

        Take it after the optimizer step (``mb.is_last``) so a resume starts on a
        step boundary. Small (about 300 bytes) and plain (``torch.save``/JSON-able).
        """
        return make_state(self._identity, self._epoch, self.position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` was taken; the next iteration continues from there.

        A following ``set_epoch`` with the saved epoch keeps the position.

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
            "cursor": (self._epoch, self._start, self._drawn, self._consumed, self._resume_pending),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["rank"], state["world_size"])
        self._epoch, self._start, self._drawn, self._consumed, self._resume_pending = state["cursor"]

    def __repr__(self) -> str:
        return (
            f"PlanSampler({str(self.path)!r}, rank={self.rank}, world_size={self.world_size}, "
            f"epoch={self._epoch}, position={self.position})"
        )


def _check_runtime_columns(plan: PlanFile) -> None:
    missing = [name for name in RUNTIME_COLUMNS if name not in plan.schema.names]
    if missing:
        raise PlanFormatError(
            f"{plan.path}: column(s) {missing} missing; the runtime needs them to know step "
            "boundaries and token counts; rebuild the plan with this batchplan"
        )
    if "rows_per_rank" not in plan.metadata or "steps_per_epoch" not in plan.metadata:
        raise PlanFormatError(f"{plan.path}: metadata lacks rows_per_rank/steps_per_epoch; rebuild the plan")


def _check_dataset(plan: PlanFile, dataset, lengths, loss_tokens) -> None:
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
    import numpy as np

    from batchplan.lengths import fingerprint_lengths

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
