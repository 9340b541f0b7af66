"""Read per-sample token lengths from Parquet or a ``datasets`` folder, column-only, files in parallel.

A dataset is Parquet files and directories of them, on local disk or in object storage
(``s3://`` and ``gs://`` URIs naming an object or a prefix; `batchplan.formats.storage`):
sample ``i`` is global row ``i`` over the files in sorted path order, the same for a prefix
and a local copy of it. Or it is one local folder written by Hugging Face
``Dataset.save_to_disk`` (sample ``i`` is row ``i`` of the dataset: its Arrow files in
``state.json`` order; `batchplan.formats.datasets_folder`). A length comes from an integer column
(``length_column``) or, when that column is absent, from a list column of token ids
(``tokens_column``), whose list offsets give the lengths; no other column is read.
Two passes over the files, each on up to 16 threads (object storage is latency-bound): the
row counts (Parquet footers), then each file's column(s) into its slice of the result.
Memory: 2 bytes per sample for lengths when every length is below 2^16 (uint16, the usual
case: read straight into it), else 4 (int32: a column with a larger value is read again);
a loss-token column the same again, on its own; plus one batch per file in flight (at most 16). ``datasets`` is never
imported, nor pandas for local files (objects are opened through ``pyarrow.dataset``, which
imports pandas when it is installed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from batchplan.errors import DatasetError, one_line
from batchplan.formats.arrow import numpy_of, valid
from batchplan.formats.datasets_folder import StreamFile, is_datasets_folder, list_arrow_files
from batchplan.formats.storage import Storage, for_each_file, is_uri, names_of, order_key, storage_error, uri_hint

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

_BATCH_ROWS = 1 << 20
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


@dataclasses.dataclass(frozen=True)
class DatasetFiles:
    """The files of one dataset, in sample order.

    Attributes:
        paths: Parquet files (local paths, or ``s3://bucket/key`` and ``gs://bucket/key``
            URIs), or the Arrow stream files of ``folder``.
        folder: the Hugging Face datasets folder the files belong to, or None for Parquet.
        storage: the filesystems that open the URIs among ``paths``.
    """

    paths: tuple[str, ...]
    folder: Path | None = None
    storage: Storage = dataclasses.field(default_factory=Storage, compare=False, repr=False)


def find_dataset_files(paths: PathLike | Sequence[PathLike]) -> DatasetFiles:
    """Expand the dataset paths of a command: Parquet files, directories and URIs, or one datasets folder.

    Raises:
        DatasetError: a missing path, bucket, object or prefix, a DatasetDict folder, a
            datasets folder given with other paths, a damaged ``state.json``, a directory or
            prefix with no dataset files, an object store that cannot be reached.
    """
    names = names_of(paths)
    folders = [Path(name) for name in names if not is_uri(name) and is_datasets_folder(Path(name))]
    if not folders:
        storage = Storage()
        return DatasetFiles(tuple(find_parquet_files(names, storage=storage)), storage=storage)
    if len(names) > 1:
        others = list(names)
        others.remove(str(folders[0]))
        raise DatasetError(
            f"{folders[0]}: a Hugging Face datasets folder given with {len(others)} other path(s) "
            f"{others}; expected it alone (it is a whole dataset): pass one datasets folder, or combine "
            "them with datasets.concatenate_datasets(...).save_to_disk(PATH) and pass PATH"
        )
    return DatasetFiles(tuple(str(path) for path in list_arrow_files(folders[0])), folder=folders[0])


def find_parquet_files(paths: PathLike | Sequence[PathLike], *, storage: Storage | None = None) -> list[str]:
    """Expand files, directories and URIs (all ``*.parquet`` below them) into sorted file names.

    Local paths come out as ``str(Path(path))``; URIs as ``scheme://bucket/key``, opened by
    ``storage`` (a new one when None).
    """
    storage = Storage() if storage is None else storage
    found: list[str] = []
    for name in names_of(paths):
        if is_uri(name):
            found.extend(storage.expand(name))
            continue
        path = Path(name)
        if path.is_dir():
            inside = sorted(p for p in path.rglob("*.parquet") if p.is_file())
            if not inside:
                raise DatasetError(
                    f"{path}: directory holds no *.parquet files and no state.json; expected Parquet "
                    "files or a folder written by Hugging Face Dataset.save_to_disk"
                )
            found.extend(str(p) for p in inside)
        elif path.is_file():
            found.append(name)
        else:
            raise DatasetError(f"{path}: no such file or directory{uri_hint(name)}")
    if not found:
        raise DatasetError("no dataset files given")
    files = sorted(found, key=order_key)
    for before, after in zip(files, files[1:]):
        if before == after:
            raise DatasetError(f"{after}: file given twice; each sample must be read once")
    return files


def count_samples(files: DatasetFiles) -> int | None:
    """Samples of the dataset before reading it: Parquet footers, or the streams' batch
    headers; None if a file is unreadable (`read_lengths` then reports it)."""
    try:
        return sum(_count_rows(files, None))
    except DatasetError:
        return None


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
    column = _pick_length_column(_open_source(files, 0), length_column, tokens_column)
    columns = [column] if loss_tokens_column is None else [column, loss_tokens_column]
    counts = _count_rows(files, columns)
    total = sum(counts)
    if total == 0:
        raise DatasetError(f"{files.folder or ', '.join(files.paths)}: dataset has 0 rows; nothing to plan")
    # Each file fills its own slice: memory is the result plus the batches in flight, never a
    # list of parts. Columns are read into uint16 (lengths are almost always below 2^16); one
    # holding a larger value anywhere is read again, into int32.
    starts = [0, *itertools.accumulate(counts)]
    done = None if on_file is None else (lambda index: on_file(files.paths[index]))
    dtypes: list[type[np.integer]] = [np.uint16] * len(columns)
    while True:
        arrays = [np.empty(total, dtype=dtype) for dtype in dtypes]

        def read_file(index: int, arrays=arrays) -> None:
            _read_into(_open_source(files, index), columns, starts[index], starts[index + 1], *arrays)

        try:
            for_each_file(len(files.paths), read_file, on_done=done)
            break
        except _TooLarge as larger:
            del arrays, read_file  # the narrow arrays go before the wider ones are filled
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


def _count_rows(files: DatasetFiles, columns: list[str] | None) -> list[int]:
    """Rows of each file (Parquet footers), checking that each holds ``columns``."""
    counts = [0] * len(files.paths)

    def count(index: int) -> None:
        source = _open_source(files, index)
        if columns is not None:
            _check_columns(source.path, source.schema, columns)
        counts[index] = source.count_rows(columns or source.schema.names[:1])

    for_each_file(len(files.paths), count)
    return counts


def _read_into(
    source: _ParquetFile | StreamFile, columns: list[str], start: int, end: int, lengths: NDArray,
    loss: NDArray | None = None,
) -> None:
    """The lengths (and loss tokens) of one file, into samples ``start:end``."""
    row = start
    for batch in source.iter_batches(columns):
        stop = row + batch.num_rows
        if stop > end:
            break
        where = _Rows(str(source.path), file_row=row - start, sample=row)
        lengths[row:stop] = _fitted(_lengths_of(where, batch.column(columns[0]), columns[0]), lengths, 0)
        if loss is not None:
            loss[row:stop] = _fitted(_integers_of(where, batch.column(columns[1]), columns[1]), loss, 1)
        row = stop
    if row != end:
        raise DatasetError(
            f"{source.path}: holds a different number of rows than the {end - start:,} its footer counted "
            "a moment before; the file changed while it was read: read the dataset again once it is written"
        )


class _ParquetFile:
    """One Parquet file, read like a `StreamFile`: schema, row count, batches of some columns."""

    def __init__(self, path: str, storage: Storage):
        self.path = path
        try:
            self._file = storage.open_parquet(path)
        except (pa.ArrowException, OSError) as error:
            raise _read_error(
                path, error, "not a readable Parquet file", "give Parquet files or directories of them, "
                "or a folder written by Hugging Face Dataset.save_to_disk"
            ) from error
        self.schema: pa.Schema = self._file.schema_arrow

    def count_rows(self, columns: list[str]) -> int:
        return self._file.metadata.num_rows

    def iter_batches(self, columns: list[str]) -> Iterator[pa.RecordBatch]:
        try:
            yield from self._file.iter_batches(batch_size=_BATCH_ROWS, columns=columns)
        except (pa.ArrowException, OSError) as error:
            raise _read_error(self.path, error, f"cannot read column(s) {columns}", "") from error


def _read_error(path: str, error: BaseException, what: str, fix: str) -> DatasetError:
    """A read error as one line; a URI's I/O error says what to check on the store."""
    if is_uri(path) and isinstance(error, OSError):
        return storage_error(path, error)
    return DatasetError(f"{path}: {what} ({one_line(error)}){'; ' + fix if fix else ''}")


def _open_source(files: DatasetFiles, index: int) -> _ParquetFile | StreamFile:
    if files.folder is None:
        return _ParquetFile(files.paths[index], files.storage)
    return StreamFile(Path(files.paths[index]), files.folder)


def _pick_length_column(source: _ParquetFile | StreamFile, length_column: str, tokens_column: str) -> str:
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


def _check_columns(path: str | Path, schema: pa.Schema, columns: list[str]) -> None:
    for name in columns:
        if name not in schema.names:
            raise DatasetError(
                f"{path}: column {name!r} is missing (columns are {schema.names}); every file "
                "of a dataset must have the same columns"
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
