"""Read per-sample token lengths from Parquet, column-only and batch by batch.

Sample ``i`` is global row ``i`` over the files in sorted path order. A length comes
from an integer column (``length_column``) or, when that column is absent, from a
list column of token ids (``tokens_column``), whose list offsets give the lengths;
no other column is read. Memory: 4 bytes per sample for lengths (+4 with a
loss-token column), plus one Parquet batch in flight.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from numpy.typing import NDArray

from batchplan.errors import DatasetError

__all__ = ["SampleLengths", "find_parquet_files", "fingerprint_lengths", "read_lengths"]

_BATCH_ROWS = 1 << 20
_INT32_MAX = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class SampleLengths:
    """Token counts of every sample of a dataset.

    Attributes:
        lengths: tokens per sample (int32); a null length reads as 0.
        loss_tokens: tokens carrying a label per sample (int32), or None for the
            default ``length - 1``.
        files: the Parquet files read, in sample order, with their row counts.
        column: the column the lengths came from.
    """

    lengths: NDArray[np.int32]
    loss_tokens: NDArray[np.int32] | None = None
    files: tuple[tuple[str, int], ...] = ()
    column: str = "length"

    @property
    def num_samples(self) -> int:
        return int(self.lengths.shape[0])

    def fingerprint(self) -> str:
        """Hash of the lengths (and loss tokens): what a plan was built for."""
        return fingerprint_lengths(self.lengths, self.loss_tokens)


def fingerprint_lengths(lengths: NDArray, loss_tokens: NDArray | None = None) -> str:
    """BLAKE2b (hex, 32 chars) of the sample count, lengths and loss tokens as int32."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.int64(lengths.shape[0]).tobytes())
    digest.update(np.ascontiguousarray(lengths, dtype="<i4").data)
    if loss_tokens is not None:
        digest.update(b"loss")
        digest.update(np.ascontiguousarray(loss_tokens, dtype="<i4").data)
    return digest.hexdigest()


def find_parquet_files(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """Expand files and directories (all ``*.parquet`` below them) into sorted file paths."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            inside = sorted(p for p in path.rglob("*.parquet") if p.is_file())
            if not inside:
                raise DatasetError(f"{path}: directory holds no *.parquet files")
            found.extend(inside)
        elif path.is_file():
            found.append(path)
        else:
            raise DatasetError(f"{path}: no such file or directory")
    if not found:
        raise DatasetError("no dataset files given")
    files = sorted(found)
    for before, after in zip(files, files[1:]):
        if before == after:
            raise DatasetError(f"{after}: file given twice; each sample must be read once")
    return files


def read_lengths(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    length_column: str = "length",
    tokens_column: str = "input_ids",
    loss_tokens_column: str | None = None,
) -> SampleLengths:
    """Read the token length of every sample.

    Args:
        paths: a Parquet file, several files, or directories of them.
        length_column: integer column holding each sample's token count.
        tokens_column: list column of token ids, used when ``length_column`` is absent.
        loss_tokens_column: optional integer column: tokens carrying a label.

    Raises:
        DatasetError: unreadable file, missing or mistyped column, negative values,
            loss tokens above the length.
    """
    files = find_parquet_files(paths)
    column = _pick_length_column(files[0], length_column, tokens_column)
    parquets = [_open_parquet(path) for path in files]
    for path, parquet in zip(files, parquets):
        _check_columns(path, parquet.schema_arrow, column, loss_tokens_column)
    total = sum(parquet.metadata.num_rows for parquet in parquets)
    if total == 0:
        raise DatasetError(f"{', '.join(map(str, files))}: dataset has 0 rows; nothing to plan")
    # Filled batch by batch: memory is the result plus one batch, never a list of parts.
    lengths = np.empty(total, dtype=np.int32)
    loss = None if loss_tokens_column is None else np.empty(total, dtype=np.int32)
    counts: list[tuple[str, int]] = []
    row = 0
    for path, parquet in zip(files, parquets):
        first = row
        for batch in _iter_batches(path, parquet, column, loss_tokens_column):
            end = row + batch.num_rows
            where = _Rows(path, file_row=row - first, sample=row)
            lengths[row:end] = _lengths_of(where, batch.column(0), column)
            if loss is not None:
                loss[row:end] = _integers_of(where, batch.column(1), loss_tokens_column)
            row = end
        counts.append((str(path), row - first))
    if loss is not None:
        _check_loss_tokens(files, counts, lengths, loss, loss_tokens_column)
    return SampleLengths(lengths=lengths, loss_tokens=loss, files=tuple(counts), column=column)


def _open_parquet(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise DatasetError(
            f"{path}: not a readable Parquet file ({_one_line(error)}); give Parquet files or directories of them"
        ) from error


def _pick_length_column(path: Path, length_column: str, tokens_column: str) -> str:
    names = _open_parquet(path).schema_arrow.names
    if length_column in names:
        return length_column
    if tokens_column in names:
        return tokens_column
    raise DatasetError(
        f"{path}: no length column {length_column!r} and no token column {tokens_column!r}; "
        f"columns are {names}; pass --length-column or --tokens-column"
    )


def _check_columns(path: Path, schema: pa.Schema, column: str, loss_column: str | None) -> None:
    for name in (column, loss_column):
        if name is not None and name not in schema.names:
            raise DatasetError(
                f"{path}: column {name!r} is missing (columns are {schema.names}); every file "
                "of a dataset must have the same columns"
            )


def _iter_batches(path: Path, parquet: pq.ParquetFile, column: str, loss_column: str | None):
    columns = [column] if loss_column is None else [column, loss_column]
    try:
        yield from parquet.iter_batches(batch_size=_BATCH_ROWS, columns=columns)
    except (pa.ArrowException, OSError) as error:
        raise DatasetError(f"{path}: cannot read column(s) {columns} ({_one_line(error)})") from error


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Where a Parquet batch starts: its file, its first row in the file and as a sample."""

    path: Path
    file_row: int
    sample: int

    def describe(self, offset: int) -> str:
        return f"{self.path} row {self.file_row + offset:,} (sample {self.sample + offset:,})"


def _lengths_of(where: _Rows, array: pa.Array, column: str) -> np.ndarray:
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        # Lengths from the list offsets; the token values are never converted.
        import pyarrow.compute as pc  # ~45 ms to import: only for list columns

        array = pc.list_value_length(array)
    elif pa.types.is_fixed_size_list(array.type):
        array = pa.array(np.full(len(array), array.type.list_size), mask=array.is_null())
    return _integers_of(where, array, column)


def _integers_of(where: _Rows, array: pa.Array, column: str) -> np.ndarray:
    if not pa.types.is_integer(array.type):
        raise DatasetError(
            f"{where.path}: column {column!r} has type {array.type}; expected integer token counts "
            "or a list of token ids; cast the column to an integer type or pick another with "
            "--length-column / --tokens-column"
        )
    if array.null_count:
        array = array.fill_null(0)  # imports pyarrow.compute (~45 ms): only when there are nulls
    values = array.to_numpy(zero_copy_only=False)
    if values.size and values.min() < 0:
        bad = np.flatnonzero(values < 0)
        raise DatasetError(
            f"{where.describe(int(bad[0]))}: column {column!r} has negative value {int(values[bad[0]]):,} "
            f"({bad.size:,} negative in this batch of {values.size:,} rows); token counts must be >= 0, "
            "fix the column"
        )
    if values.size and values.max() > _INT32_MAX:
        row = int(np.argmax(values > _INT32_MAX))
        raise DatasetError(
            f"{where.describe(row)}: column {column!r} has value {int(values[row]):,}, above 2^31 - 1; "
            "token counts must fit in int32, fix the column"
        )
    return values.astype(np.int32, copy=False)


def _check_loss_tokens(files, counts, lengths, loss, loss_column) -> None:
    bad = np.flatnonzero(loss > lengths)
    if bad.size == 0:
        return
    sample = int(bad[0])
    raise DatasetError(
        f"{_where(counts, sample)}: {bad.size:,} samples have more loss tokens than tokens "
        f"(sample {sample:,}: {int(loss[sample]):,} in {loss_column!r} > length "
        f"{int(lengths[sample]):,}); fix the column"
    )


def _where(counts: list[tuple[str, int]], sample: int) -> str:
    """The file holding a global sample index, for messages."""
    start = 0
    for path, rows in counts:
        if sample < start + rows:
            return f"{path} (row {sample - start:,})"
        start += rows
    return "dataset"


def _one_line(error: BaseException) -> str:
    """pyarrow messages may span lines (C++ context); errors are printed as one line."""
    return " ".join(str(error).split())
