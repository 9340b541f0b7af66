"""`OpenedPlan`: what every layout of an opened plan offers its readers, whether a plan file
(`batchplan.formats.plan_file.PlanFile`) or a plan directory
(`batchplan.formats.plan_directory.PlanDirectory`): the metadata, one rank's rows of an
epoch as a record batch (`read_rank`), and the same as numpy (`rank_rows`, `epoch_rows`:
`PlanRows`, the view every reader in batchplan uses)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from batchplan.errors import PlanFormatError
from batchplan.formats.plan_rows import PlanRows

__all__ = ["OpenedPlan", "check_epoch_rank"]


class OpenedPlan:
    """An opened plan, whatever its layout.

    Attributes:
        path: the file or directory.
        metadata: the decoded ``batchplan`` metadata (a directory's manifest).
    """

    path: Path
    metadata: dict[str, Any]

    @property
    def schema(self) -> pa.Schema:
        raise NotImplementedError

    @property
    def world_size(self) -> int:
        return int(self.metadata["world_size"])

    @property
    def num_epochs(self) -> int:
        return int(self.metadata["epochs"])

    @property
    def num_samples(self) -> int:
        return int(self.metadata["num_samples"])

    @property
    def num_steps(self) -> int:
        return int(sum(self.metadata["steps_per_epoch"]))

    def read_rank(self, epoch: int, rank: int, *, checked: bool = True) -> pa.RecordBatch:
        """This rank's micro-batches of this epoch, in (step, micro) order; ``checked``: against
        the checksum of its rows (`batchplan.formats.arrow_file.read_batch`); `batchplan validate`,
        which checks the whole plan's, reads on without it so as to report what else a damaged
        plan breaks."""
        raise NotImplementedError

    def read_epoch(self, epoch: int) -> pa.Table:
        """Every rank's micro-batches of one epoch, rank-major."""
        return pa.Table.from_batches([self.read_rank(epoch, r) for r in range(self.world_size)], self.schema)

    def rank_rows(self, epoch: int, rank: int, *, checked: bool = True) -> PlanRows:
        """`read_rank` as numpy (`PlanRows`): O(the rank's rows), no copy."""
        return PlanRows(self.read_rank(epoch, rank, checked=checked), self.path, f"epoch {epoch} rank {rank}")

    def epoch_rows(self, epoch: int) -> PlanRows:
        """`read_epoch` as numpy (`PlanRows`): every rank's rows of one epoch, rank-major."""
        return PlanRows(self.read_epoch(epoch), self.path, f"epoch {epoch}")

    def verify(self) -> None:
        """Recompute the content hash(es); raise `PlanFormatError` if the plan was altered."""
        raise NotImplementedError


def check_epoch_rank(plan: OpenedPlan, epoch: int, rank: int) -> None:
    """An epoch and a rank of ``plan``, or a `PlanFormatError`."""
    if not 0 <= epoch < plan.num_epochs:
        raise PlanFormatError(f"{plan.path}: epoch {epoch} is outside the plan's 0..{plan.num_epochs - 1}")
    if not 0 <= rank < plan.world_size:
        raise PlanFormatError(f"{plan.path}: rank {rank} is outside the plan's 0..{plan.world_size - 1}")
