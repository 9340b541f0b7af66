"""Read per-sample token lengths from Parquet or a ``datasets`` folder, column-only, in parallel.

The dataset's files and the pieces they are read in: `batchplan.formats.dataset_files`. A
length comes from an integer column (``length_column``) or, when that column is absent, from a
list column of token ids (``tokens_column``), whose list offsets give the lengths; no other
column is read. Two passes, each on up to 16 threads (object storage is latency-bound): the
row counts (Parquet footers), then each piece's column(s) into its slice of the result.
Memory: 2 bytes per sample for lengths when every length is below 2^16 (uint16, the usual
case: read straight into it), else 4 (int32: a column with a larger value is read again);
a loss-token column the same again, on its own; plus one batch per piece in flight (at most
16). ``datasets`` is never imported, nor pandas for local files (objects are opened through
``pyarrow.dataset``, which imports pandas when it is installed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from batchplan.errors import DatasetError
from batchplan.formats.arrow import numpy_of, valid
from batchplan.formats.dataset_files import (
    DatasetFiles,
    ParquetSource,
    Piece,
    count_file_rows,
    count_samples,
    find_dataset_files,
    find_parquet_files,
    open_source,
    pieces_of,
)
from batchplan.formats.datasets_folder import StreamFile
from batchplan.formats.storage import for_each_file

__all__ = [
    "DatasetFiles",
    "SampleLengths",
    "count_samples",
    "find_dataset_files",
    "find_parquet_files",
    "fingerprint_lengths",
    "read_lengths",
]

PathLike = str | os.PathLike

_INT32_MAX = np.iinfo(np.int32).max
_UINT16_END = 1 << 16
_CHUNK = 1 << 20  # values converted at a time when hashing (4 MiB as int32)


@dataclasses.dataclass(frozen=True)
class SampleLengths:
    """Token counts of every sample of a dataset.

    Attributes:
        lengths: tokens per sample: uint16 when every length is below 2^16, else int32;
            a null length reads as 0.
        loss_tokens: tokens carrying a label per sample (uint16 when every value is below
            2^16, else int32), or None for the default ``length - 1``.
        files: the files read (Parquet, or a datasets folder's Arrow files), in
            sample order, with their row counts.
        column: the column the lengths came from.
    """

    lengths: NDArray[np.uint16] | NDArray[np.int32]
    loss_tokens: NDArray[np.uint16] | NDArray[np.int32] | None = None
    files: tuple[tuple[str, int], ...] = ()
    column: str = "length"

    @property
    def num_samples(self) -> int:
        return int(self.lengths.shape[0])

    def fingerprint(self) -> str:
        """Hash of the lengths (and loss tokens): what a plan was built for."""
        return fingerprint_lengths(self.lengths, self.loss_tokens)


def fingerprint_lengths(lengths: NDArray, loss_tokens: NDArray | None = None) -> str:
    """BLAKE2b (hex, 32 chars) of the sample count, lengths and loss tokens as int32.

    The digest depends on the values only, not their dtype (uint16, int32 or int64); other
    dtypes are hashed a chunk at a time, so no int32 copy of the whole array is made.
    """
    lengths = np.asarray(lengths)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.int64(lengths.shape[0]).tobytes())
    _hash_as_int32(digest, lengths)
    if loss_tokens is not None:
        digest.update(b"loss")
        _hash_as_int32(digest, np.asarray(loss_tokens))
    return digest.hexdigest()


def _hash_as_int32(digest, values: NDArray) -> None:
    """Hash ``values`` as little-endian int32 bytes; updating piece by piece gives the digest
    of one update with all of them."""
    values = values.reshape(-1)
    if values.dtype == np.dtype("<i4"):
        digest.update(np.ascontiguousarray(values).data)
        return
    for start in range(0, values.shape[0], _CHUNK):
        digest.update(np.ascontiguousarray(values[start : start + _CHUNK], dtype="<i4").data)


def read_lengths(
    paths: PathLike | Sequence[PathLike] | DatasetFiles,
    *,
    length_column: str = "length",
    tokens_column: str = "input_ids",
    loss_tokens_column: str | None = None,
    on_file: Callable[[str], None] | None = None,
) -> SampleLengths:
    """Read the token length of every sample.

    Args:
        paths: a Parquet file, several files, directories of them, ``s3://`` or ``gs://``
            URIs of objects or prefixes, or one folder written by
            ``datasets.Dataset.save_to_disk`` (`find_dataset_files`).
        length_column: integer column holding each sample's token count.
        tokens_column: list column of token ids, used when ``length_column`` is absent.
        loss_tokens_column: optional integer column: tokens carrying a label.
        on_file: called with each file's name as its lengths are read, in the calling thread.

    Raises:
        DatasetError: unreadable file, missing or mistyped column, negative values,
            loss tokens above the length, an object store that cannot be reached.
    """
    files = paths if isinstance(paths, DatasetFiles) else find_dataset_files(paths)
    column = _pick_length_column(open_source(files, 0), length_column, tokens_column)
    columns = [column] if loss_tokens_column is None else [column, loss_tokens_column]
    group_rows = count_file_rows(files, columns)
    counts = [sum(rows) for rows in group_rows]
    total = sum(counts)
    if total == 0:
        raise DatasetError(f"{files.folder or ', '.join(files.paths)}: dataset has 0 rows; nothing to plan")
    # Each piece fills its own slice: memory is the result plus the batches in flight, never a
    # list of parts. Columns are read into uint16 (lengths are almost always below 2^16); one
    # holding a larger value anywhere is read again, into int32.
    pieces = pieces_of(group_rows)
    done = _file_done(files, pieces, on_file)
    dtypes: list[type[np.integer]] = [np.uint16] * len(columns)
    while True:
        arrays = [np.empty(total, dtype=dtype) for dtype in dtypes]

        def read_piece(index: int, arrays=arrays) -> None:
            piece = pieces[index]
            _read_into(open_source(files, piece.file), columns, piece, *arrays)

        try:
            for_each_file(len(pieces), read_piece, on_done=done)
            break
        except _TooLarge as larger:
            del arrays, read_piece  # the narrow arrays go before the wider ones are filled
            dtypes[larger.column] = np.int32
    lengths, loss = arrays[0], (arrays[1] if len(arrays) > 1 else None)
    # Arrow's allocator keeps the freed read buffers for reuse (~0.2 GB); planning never reads
    # Arrow again: give them back.
    pa.default_memory_pool().release_unused()
    counted = tuple(zip(files.paths, counts))
    if loss is not None:
        _check_loss_tokens(counted, lengths, loss, loss_tokens_column)
    return SampleLengths(lengths=lengths, loss_tokens=loss, files=counted, column=column)


class _TooLarge(Exception):
    """A value of ``columns[column]`` does not fit the uint16 array being filled."""

    def __init__(self, column: int) -> None:
        super().__init__(column)
        self.column = column


def _fitted(values: NDArray, out: NDArray, column: int) -> NDArray:
    """``values``, checked to fit ``out``'s dtype (a uint16 array would wrap larger ones)."""
    if out.dtype == np.uint16 and values.size and values.max() >= _UINT16_END:
        raise _TooLarge(column)
    return values


def _read_into(
    source: ParquetSource | StreamFile, columns: list[str], piece: Piece, lengths: NDArray, loss: NDArray | None = None
) -> None:
    """The lengths (and loss tokens) of one piece of a file, into its samples."""
    row = piece.start
    if piece.row_groups is None:
        batches = source.iter_batches(columns)
    else:
        assert isinstance(source, ParquetSource)  # only Parquet files are cut into row groups
        batches = source.iter_batches(columns, piece.row_groups)
    for batch in batches:
        stop = row + batch.num_rows
        if stop > piece.end:
            break
        where = _Rows(str(source.path), file_row=row - piece.file_start, sample=row)
        lengths[row:stop] = _fitted(_lengths_of(where, batch.column(columns[0]), columns[0]), lengths, 0)
        if loss is not None:
            loss[row:stop] = _fitted(_integers_of(where, batch.column(columns[1]), columns[1]), loss, 1)
        row = stop
    if row != piece.end:
        raise DatasetError(
            f"{source.path}: holds a different number of rows than the {piece.end - piece.start:,} its footer "
            "counted a moment before; the file changed while it was read: read the dataset again once it is written"
        )


def _file_done(files: DatasetFiles, pieces: list[Piece], on_file: Callable[[str], None] | None):
    """``on_done`` for `for_each_file` over ``pieces``: ``on_file(path)`` once a file's last piece is read."""
    if on_file is None:
        return None
    left = [0] * len(files.paths)
    for piece in pieces:
        left[piece.file] += 1

    def done(index: int) -> None:
        file = pieces[index].file
        left[file] -= 1
        if left[file] == 0:
            on_file(files.paths[file])

    return done


def _pick_length_column(source: ParquetSource | StreamFile, length_column: str, tokens_column: str) -> str:
    names = source.schema.names
    if length_column in names:
        kind = source.schema.field(length_column).type
        listed = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
        if listed and length_column != tokens_column:
            raise DatasetError(
                f"{source.path}: length column {length_column!r} holds lists ({kind}), not token counts; "
                f"to count the items of each list pass it as the token column (`tokens_column={length_column!r}` "
                "and a `length_column` the file does not have), or name an integer column as the length column"
            )
        return length_column
    if tokens_column in names:
        return tokens_column
    raise DatasetError(
        f"{source.path}: no length column {length_column!r} and no token column {tokens_column!r}; "
        f"columns are {names}; pass `length_column` or `tokens_column`"
    )


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Where a batch starts: its file, its first row in the file and as a sample."""

    path: str
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
        return np.where(valid(array), np.int32(array.type.list_size), np.int32(0))
    return _integers_of(where, array, column)


def _integers_of(where: _Rows, array: pa.Array, column: str) -> np.ndarray:
    if not pa.types.is_integer(array.type):
        raise DatasetError(
            f"{where.path}: column {column!r} has type {array.type}; expected integer token counts "
            "or a list of token ids; cast the column to an integer type or pick another with "
            "`length_column` / `tokens_column`"
        )
    values = numpy_of(array)
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


def _check_loss_tokens(counts, lengths, loss, loss_column) -> None:
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
