"""`PlanFile`: a plan file opened by memory map (the format: `batchplan.formats.plan_format`,
docs/plan-format.md).

Opening reads the footer, the schema and the metadata, and checks them (format version,
metadata keys, columns and types, one record batch per (epoch, rank)); no row is read.
Reading one rank's epoch touches only that rank's record batch, in O(its rows), validated and
checked against its checksum (`batchplan.formats.arrow_file.read_batch`). A file cut short
says so, and every damaged file is a one-line `PlanFormatError`.

This module never imports numba: the runtime reads plans through it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa

from batchplan.errors import PlanFormatError
from batchplan.formats.arrow_file import (
    check_batch_count,
    open_arrow,
    read_batch,
    read_metadata,
    unreadable_schema,
    verify_batches,
)
from batchplan.formats.opened_plan import OpenedPlan, check_epoch_rank
from batchplan.formats.plan_format import check_columns, check_metadata

__all__ = ["PlanFile"]


class PlanFile(OpenedPlan):
    """A plan file opened by memory map; reading one rank's epoch touches only its rows."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._reader = open_arrow(self.path)
        with unreadable_schema(self.path):
            self.metadata = read_metadata(self._reader, self.path)
            if self.metadata.get("layout") == "epoch":
                raise PlanFormatError(
                    f"{self.path}: one epoch's file of a plan directory; open the directory {self.path.parent}"
                )
            check_metadata(self.metadata, self.path)
            check_columns(self.schema, self.metadata, self.path)
        why = f" (epochs {self.num_epochs} x world_size {self.world_size})"
        check_batch_count(self._reader, self.num_epochs * self.world_size, self.path, why)

    @property
    def schema(self) -> pa.Schema:
        return self._reader.schema

    def read_rank(self, epoch: int, rank: int, *, checked: bool = True) -> pa.RecordBatch:
        """This rank's micro-batches of this epoch, in (step, micro) order (`OpenedPlan.read_rank`)."""
        check_epoch_rank(self, epoch, rank)
        what = f"epoch {epoch} rank {rank}"
        return read_batch(self._reader, epoch * self.world_size + rank, self.path, what, checked=checked)

    def read_all(self) -> pa.Table:
        """The whole plan as one table (epoch-major, then rank)."""
        try:
            table = self._reader.read_all()
            table.validate(full=True)  # see read_batch
            return table
        except (pa.ArrowException, OSError) as error:
            message = f"{self.path}: cannot read the plan ({error}); the file is corrupt, rebuild it"
            raise PlanFormatError(message) from error

    def verify(self) -> None:
        """Recompute the content hash; raise `PlanFormatError` if the file was altered."""
        verify_batches(self._reader, self.metadata, self.path)
