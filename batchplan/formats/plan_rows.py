"""Plan rows as numpy: the one view of a plan's columns that every reader above formats/ uses.

`PlanRows` holds rows of a plan (one rank's rows of an epoch, `OpenedPlan.rank_rows`: one
record batch; every rank's rows of an epoch, `OpenedPlan.epoch_rows`) and hands out each
column by name as numpy over Arrow's buffers, read once (no copy for one record batch; one
per column for several):

- `numbers`: a numeric column in its stored dtype. ``padded_tokens`` is ``tokens`` in pack
  plans, which leave the column out (format version 2: pack mode pads nothing).
- `offsets`, `entries`, `counts`: a list column (``samples``, ``starts``, ``lengths``) as CSR:
  row ``i`` holds ``entries(name)[offsets(name)[i]:offsets(name)[i + 1]]``; offsets are int64
  from 0, entries in their stored dtype (int32 sample indices below 2³¹ samples).

One null policy: every column of a plan is non-nullable, so a null where a reader looks (a
number, a list, an entry of a list) is a `PlanFormatError` that names the file, the rows and
the column, never a value. The check costs nothing: Arrow records each array's null count.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from batchplan.errors import PlanFormatError
from batchplan.formats.arrow import numpy_of

__all__ = ["PlanRows"]


class PlanRows:
    """Rows of a plan, their columns as numpy (module docstring).

    Attributes:
        path: the plan the rows are from (in messages).
        where: which rows they are, e.g. ``epoch 0 rank 3`` (in messages).
        names: the columns, in the plan's order.
        num_rows: the rows (micro-batches).
    """

    def __init__(self, rows: pa.RecordBatch | pa.Table, path: str | os.PathLike, where: str) -> None:
        self.path = path
        self.where = where
        self.names = tuple(rows.schema.names)
        self.num_rows = rows.num_rows
        self._rows = rows
        self._numbers: dict[str, np.ndarray] = {}  # numeric columns read so far
        self._lists: dict[str, tuple[NDArray[np.int64], np.ndarray]] = {}  # list columns: offsets, entries

    def __contains__(self, name: str) -> bool:
        """Whether the rows have column ``name`` (``"cost" in rows``)."""
        return name in self.names

    @property
    def has_spans(self) -> bool:
        """Whether entries are token spans of samples (``starts`` and ``lengths`` columns)."""
        return "starts" in self.names

    def numbers(self, name: str) -> np.ndarray:
        """A numeric column's values in its stored dtype, read-only where viewed over the file.

        Raises:
            PlanFormatError: no such column, or it holds a null.
        """
        if name == "padded_tokens" and name not in self.names:
            name = "tokens"  # a pack plan: no padding
        values = self._numbers.get(name)
        if values is None:
            column = self._column(name)
            self._check_nulls(name, column.null_count)
            try:
                values = self._numbers[name] = numpy_of(column)
            except (pa.ArrowException, ValueError) as error:
                raise self._unreadable(name, error) from error
        return values

    def offsets(self, name: str = "samples") -> NDArray[np.int64]:
        """Shape (num_rows + 1,), from 0: row ``i`` holds ``entries(name)[offsets[i]:offsets[i + 1]]``."""
        return self._list(name)[0]

    def entries(self, name: str = "samples") -> np.ndarray:
        """A list column's entries, row after row, in its value dtype."""
        return self._list(name)[1]

    def counts(self, name: str = "samples") -> NDArray[np.int64]:
        """Entries of each row's list."""
        return np.diff(self.offsets(name))

    def _list(self, name: str) -> tuple[NDArray[np.int64], np.ndarray]:
        if name not in self._lists:
            column = self._column(name)
            chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
            try:
                parts = [self._list_chunk(name, chunk) for chunk in chunks]
            except (pa.ArrowException, ValueError, IndexError) as error:
                raise self._unreadable(name, error) from error
            if len(parts) == 1:
                self._lists[name] = parts[0]
            else:
                sizes = [values.shape[0] for _, values in parts]
                starts = np.cumsum([0] + sizes[:-1])
                offsets = [np.zeros(1, np.int64)] + [part[1:] + start for (part, _), start in zip(parts, starts)]
                entries = np.concatenate([values for _, values in parts]) if parts else np.empty(0, np.int64)
                self._lists[name] = np.concatenate(offsets), entries
        return self._lists[name]

    def _list_chunk(self, name: str, array: pa.ListArray) -> tuple[NDArray[np.int64], np.ndarray]:
        """One array of a list column: its offsets from 0 and its entries (a view)."""
        self._check_nulls(name, array.null_count)
        if len(array) == 0:
            return np.zeros(1, np.int64), numpy_of(array.values)[:0]
        stored = numpy_of(array.offsets)  # into ``array.values``, which ignores the array's own offset
        first, last = int(stored[0]), int(stored[-1])
        values = array.values
        if values.null_count:  # a null outside these rows' entries is not theirs
            self._check_nulls(name, values.slice(first, last - first).null_count)
        offsets = stored.astype(np.int64)
        if first:
            offsets -= first
        return offsets, numpy_of(values)[first:last]

    def _column(self, name: str) -> pa.Array | pa.ChunkedArray:
        try:
            return self._rows.column(name)
        except KeyError:
            raise PlanFormatError(
                f"{self.path}: {self.where} has no column {name!r}; the plan is corrupt or not from batchplan, "
                "rebuild it"
            ) from None

    def _unreadable(self, name: str, error: Exception) -> PlanFormatError:
        return PlanFormatError(
            f"{self.path}: {self.where}: cannot read column {name!r} ({error}); the file is corrupt, rebuild it"
        )

    def _check_nulls(self, name: str, count: int) -> None:
        if count:
            raise PlanFormatError(
                f"{self.path}: {self.where}: column {name!r} holds {count:,} null value(s), which a plan never "
                "has; the file is corrupt, rebuild it"
            )
