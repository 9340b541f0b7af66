"""The files of a dataset, and the pieces they are read in.

A dataset is Parquet files and directories of them, on local disk or in object storage
(``s3://`` and ``gs://`` URIs naming an object or a prefix; `batchplan.formats.storage`):
sample ``i`` is global row ``i`` over the files in sorted path order, the same for a prefix
and a local copy of it. Or it is one local folder written by Hugging Face
``Dataset.save_to_disk`` (sample ``i`` is row ``i`` of the dataset: its Arrow files in
``state.json`` order; `batchplan.formats.datasets_folder`).

Files are read in pieces, on up to 16 threads (`batchplan.formats.storage.for_each_file`): a
Parquet file of more than `PIECE_ROWS` rows is cut into runs of whole row groups of at least
that many rows each, so that one large file is read on every core, as many small ones are.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa

from batchplan.errors import DatasetError, one_line
from batchplan.formats.datasets_folder import StreamFile, is_datasets_folder, list_arrow_files
from batchplan.formats.storage import Storage, for_each_file, is_uri, names_of, order_key, storage_error, uri_hint

__all__ = [
    "DatasetFiles",
    "ParquetSource",
    "Piece",
    "count_file_rows",
    "count_samples",
    "find_dataset_files",
    "find_parquet_files",
    "open_source",
    "pieces_of",
]

PathLike = str | os.PathLike

# Rows decoded per record batch.
BATCH_ROWS = 1 << 20
# A piece of a file holds whole row groups of at least this many rows (2^23: 16 MiB of uint16 lengths).
PIECE_ROWS = 1 << 23


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


@dataclasses.dataclass(frozen=True)
class Piece:
    """Samples ``start:end`` of the dataset: file ``file``'s row groups ``row_groups`` (None: the
    whole file), whose first sample is ``file_start``."""

    file: int
    row_groups: range | None
    start: int
    end: int
    file_start: int


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
        return sum(sum(rows) for rows in count_file_rows(files, None))
    except DatasetError:
        return None


def count_file_rows(files: DatasetFiles, columns: list[str] | None) -> list[list[int]]:
    """Rows of each row group of each file (Parquet footers; a stream file is one group),
    checking that each file holds ``columns``."""
    counts: list[list[int]] = [[] for _ in files.paths]

    def count(index: int) -> None:
        source = open_source(files, index)
        if columns is not None:
            check_columns(source.path, source.schema, columns)
        if isinstance(source, ParquetSource):
            counts[index] = source.row_group_rows()
        else:
            counts[index] = [source.count_rows(columns or source.schema.names[:1])]

    for_each_file(len(files.paths), count)
    return counts


def pieces_of(group_rows: list[list[int]]) -> list[Piece]:
    """The pieces the files are read in (the module docstring), in sample order; a file with
    one row group, or of at most `PIECE_ROWS` rows, is one piece."""
    piece_rows = PIECE_ROWS
    pieces: list[Piece] = []
    start = 0
    for file, rows in enumerate(group_rows):
        file_start, total = start, sum(rows)
        if len(rows) <= 1 or total <= piece_rows:
            pieces.append(Piece(file, None, start, start + total, file_start))
            start += total
            continue
        first, held = 0, 0
        for group, count in enumerate(rows):
            held += count
            if held >= piece_rows or group == len(rows) - 1:
                pieces.append(Piece(file, range(first, group + 1), start, start + held, file_start))
                start += held
                first, held = group + 1, 0
    return pieces


class ParquetSource:
    """One Parquet file, read like a `StreamFile`: schema, row counts, batches of some columns."""

    def __init__(self, path: str, storage: Storage):
        self.path = path
        try:
            self._file = storage.open_parquet(path)
        except (pa.ArrowException, OSError) as error:
            raise read_error(
                path,
                error,
                "not a readable Parquet file",
                "give Parquet files or directories of them, or a folder written by Hugging Face Dataset.save_to_disk",
            ) from error
        self.schema: pa.Schema = self._file.schema_arrow

    def row_group_rows(self) -> list[int]:
        metadata = self._file.metadata
        return [metadata.row_group(group).num_rows for group in range(metadata.num_row_groups)]

    def iter_batches(self, columns: list[str], row_groups: range | None = None) -> Iterator[pa.RecordBatch]:
        """Record batches of ``columns`` of the whole file, or of ``row_groups``."""
        groups = None if row_groups is None else list(row_groups)
        try:
            yield from self._file.iter_batches(batch_size=BATCH_ROWS, columns=columns, row_groups=groups)
        except (pa.ArrowException, OSError) as error:
            raise read_error(self.path, error, f"cannot read column(s) {columns}", "") from error


def open_source(files: DatasetFiles, index: int) -> ParquetSource | StreamFile:
    if files.folder is None:
        return ParquetSource(files.paths[index], files.storage)
    return StreamFile(Path(files.paths[index]), files.folder)


def read_error(path: str, error: BaseException, what: str, fix: str) -> DatasetError:
    """A read error as one line; a URI's I/O error says what to check on the store."""
    if is_uri(path) and isinstance(error, OSError):
        return storage_error(path, error)
    return DatasetError(f"{path}: {what} ({one_line(error)}){'; ' + fix if fix else ''}")


def check_columns(path: str | Path, schema: pa.Schema, columns: list[str]) -> None:
    for name in columns:
        if name not in schema.names:
            raise DatasetError(
                f"{path}: column {name!r} is missing (columns are {schema.names}); every file "
                "of a dataset must have the same columns"
            )
