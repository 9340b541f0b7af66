"""Where dataset files live: local paths, ``s3://`` and ``gs://`` URIs, through pyarrow's filesystems.

A URI names one object (that file) or a prefix (every ``*.parquet`` object below it, in the
order `order_key` gives local paths, so a prefix and a local copy of it list the same files
in the same order). Files under a URI are named ``scheme://bucket/key``, without the URI's
query or credentials; `Storage` keeps the filesystem each bucket was reached with and opens
its files with it. Credentials and endpoints are pyarrow's: the AWS variables and config
files (``AWS_ENDPOINT_URL`` for an S3-compatible store), Google's application default
credentials, or the query parameters ``FileSystem.from_uri`` takes
(``?endpoint_override=HOST:PORT&scheme=http``). Object stores are latency-bound, so files
are read on `MAX_THREADS` threads (`for_each_file`).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path, PurePath
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from batchplan.errors import DatasetError, one_line

__all__ = [
    "MAX_THREADS",
    "ParquetObject",
    "Storage",
    "for_each_file",
    "is_uri",
    "names_of",
    "order_key",
    "storage_error",
    "uri_hint",
]

MAX_THREADS = 16
GCS_RETRY_SECONDS = 60  # how long a gs:// read retries (a URI's own retry_limit_seconds wins)
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
_STORES = {"s3": "S3", "gs": "GCS", "gcs": "GCS"}
_HINTS = {
    "S3": "check the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) and, for an "
    "S3-compatible store, its endpoint (AWS_ENDPOINT_URL=http://HOST:PORT)",
    "GCS": "check the credentials (GOOGLE_APPLICATION_CREDENTIALS, or gcloud auth application-default login) "
    "and the network; gs://anonymous@BUCKET/PREFIX reads a public bucket",
}
_DATASETS_FILES = ("state.json", "dataset_dict.json")


def is_uri(name: str) -> bool:
    """Whether ``name`` is a URI (``scheme://...``) rather than a local path."""
    return _URI.match(name) is not None


def names_of(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Each path as a string: URIs as given, local paths as ``str(Path(path))``."""
    raw = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    names = [os.fspath(path) for path in raw]
    return [name if is_uri(name) else str(Path(name)) for name in names]


def uri_hint(name: str) -> str:
    """What to do when a missing local path is a URI that `pathlib.Path` collapsed; else ""."""
    if re.match(r"^(s3|gs|gcs):/[^/]", name):
        return "; a URI? pass it as a str: pathlib.Path turns s3://bucket into s3:/bucket"
    return ""


def order_key(name: str) -> PurePath:
    """Sort key of a file: its path components, compared one by one, as `pathlib` orders paths.

    ``s3://b/k`` orders as ``s3:/b/k``: the key is only compared, never opened.
    """
    return PurePath(name)


class Storage:
    """The filesystems of a dataset's URIs, one per ``scheme://bucket``, made once and reused."""

    def __init__(self) -> None:
        self._filesystems: dict[str, pafs.FileSystem] = {}
        self._sizes: dict[str, int] = {}  # bytes of each listed object: opening it needs no HEAD request
        self._lock = threading.Lock()

    def expand(self, uri: str) -> list[str]:
        """The Parquet files ``uri`` names: the object itself, or every ``*.parquet`` below the prefix.

        Raises:
            DatasetError: an unsupported scheme or malformed URI, a missing bucket, object or
                prefix, a prefix without Parquet files, a store that cannot be reached.
        """
        store = _store_of(uri)
        filesystem, path = _call(uri, pafs.FileSystem.from_uri, _with_retry_limit(uri))
        with self._lock:
            self._filesystems.setdefault(_root(uri, path), filesystem)
        info = _call(uri, filesystem.get_file_info, path)
        if info.type == pafs.FileType.File:
            return self._keep_sizes(uri, [info])
        if info.type == pafs.FileType.NotFound:
            raise _missing(uri, store, filesystem, path)
        listed = _call(uri, filesystem.get_file_info, pafs.FileSelector(path, recursive=True))
        found = [item for item in listed if item.type == pafs.FileType.File]
        inside = self._keep_sizes(uri, [item for item in found if item.path.endswith(".parquet")])
        if inside:
            return sorted(inside, key=order_key)
        if any(item.base_name in _DATASETS_FILES for item in found):
            raise DatasetError(
                f"{uri}: a Hugging Face datasets folder (state.json) in object storage; such folders are read "
                "from local disk only: copy the folder to local disk, or write the dataset as Parquet "
                "(Dataset.to_parquet) under the prefix"
            )
        raise DatasetError(
            f"{uri}: prefix holds no *.parquet objects ({len(found):,} other object(s)); expected Parquet "
            "files below it, or name one object"
        )

    def _keep_sizes(self, uri: str, infos: list[pafs.FileInfo]) -> list[str]:
        names = [_name(uri, info.path) for info in infos]
        with self._lock:
            self._sizes.update((name, info.size) for name, info in zip(names, infos))
        return names

    def open_parquet(self, name: str) -> pq.ParquetFile | ParquetObject:
        """A local Parquet file (`pyarrow.parquet.ParquetFile`), or an object of a URI from `expand`."""
        if not is_uri(name):
            return pq.ParquetFile(name)
        scheme, path = name.split("://", 1)
        root = f"{scheme.lower()}://{path.split('/', 1)[0]}"
        with self._lock:
            filesystem, size = self._filesystems.get(root), self._sizes.get(name)
        if filesystem is None:  # files listed by hand, not by `expand`: the URI's own filesystem
            _store_of(name)
            filesystem = _call(name, pafs.FileSystem.from_uri, _with_retry_limit(root))[0]
            with self._lock:
                filesystem = self._filesystems.setdefault(root, filesystem)
        return ParquetObject(filesystem, path, size)


class ParquetObject:
    """A Parquet object read like a `pyarrow.parquet.ParquetFile` (``schema_arrow``, ``metadata``,
    ``iter_batches``), opened with the size its listing gave: one request for the footer and
    one per column chunk, no HEAD request."""

    def __init__(self, filesystem: pafs.FileSystem, path: str, size: int | None):
        import pyarrow.dataset as ds  # ~0.26 s to import: only for object storage

        try:
            self._fragment = ds.ParquetFileFormat().make_fragment(path, filesystem=filesystem, file_size=size)
        except TypeError:  # pyarrow 14 takes no file_size: one HEAD request more per object
            self._fragment = ds.ParquetFileFormat().make_fragment(path, filesystem=filesystem)
        self._fragment.ensure_complete_metadata()
        self.metadata: pq.FileMetaData = self._fragment.metadata
        self.schema_arrow: pa.Schema = self._fragment.physical_schema

    def iter_batches(
        self, batch_size: int, columns: list[str], row_groups: list[int] | None = None
    ) -> Iterator[pa.RecordBatch]:
        """Batches of ``columns``, of the whole object or of ``row_groups``."""
        fragment = self._fragment if row_groups is None else self._fragment.subset(row_group_ids=row_groups)
        # One batch read ahead: memory stays at about two batches per file in flight.
        return fragment.to_batches(columns=columns, batch_size=batch_size, batch_readahead=1, use_threads=False)


def storage_error(name: str, error: OSError) -> DatasetError:
    """``error`` from reading URI ``name`` as one line, with what to check."""
    store = _STORES.get(_scheme(name), "S3")
    return DatasetError(f"{name}: cannot read from {store} ({one_line(error)}); {_HINTS[store]}")


def for_each_file(
    num_files: int,
    work: Callable[[int], None],
    on_done: Callable[[int], None] | None = None,
    max_threads: int = MAX_THREADS,
) -> None:
    """Run ``work(index)`` for every file index on up to ``max_threads`` threads.

    At most twice ``max_threads`` files are submitted at a time, so nothing grows with the
    number of files. ``on_done(index)`` runs in the calling thread as each file finishes.
    After a failure no new file starts; the error of the lowest failing index is raised,
    the same one on every run.
    """
    threads = max(1, min(max_threads, num_files))
    pending: dict[Future, int] = {}
    errors: dict[int, BaseException] = {}
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="batchplan-read") as pool:
        next_index = 0
        try:
            while pending or (next_index < num_files and not errors):
                while next_index < num_files and len(pending) < 2 * threads and not errors:
                    pending[pool.submit(work, next_index)] = next_index
                    next_index += 1
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    index = pending.pop(future)
                    error = future.exception()
                    if error is not None:
                        errors[index] = error
                    elif on_done is not None:
                        on_done(index)
        finally:  # Ctrl-C or a failing on_done: files not started yet never start
            for future in pending:
                future.cancel()
    if errors:
        raise errors[min(errors)]


def _scheme(uri: str) -> str:
    """The scheme of ``uri`` in lower case ("s3"); "" for a local path."""
    match = _URI.match(uri)
    return "" if match is None else match.group(1).lower()


def _store_of(uri: str) -> str:
    scheme = _scheme(uri)
    if scheme not in _STORES:
        raise DatasetError(
            f"{uri}: unsupported URI scheme {scheme!r}; expected s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or a local path"
        )
    return _STORES[scheme]


def _call(uri: str, function, *args):
    """``function(*args)`` on ``uri``'s filesystem, its errors as one-line `DatasetError`."""
    try:
        return function(*args)
    except DatasetError:
        raise
    except OSError as error:
        raise storage_error(uri, error) from error
    except (pa.ArrowException, ValueError) as error:
        raise DatasetError(
            f"{uri}: not a usable URI ({one_line(error)}); expected s3://BUCKET/PREFIX or gs://BUCKET/PREFIX, "
            "optionally with pyarrow's query parameters, e.g. ?endpoint_override=HOST:PORT&scheme=http"
        ) from error


def _missing(uri: str, store: str, filesystem: pafs.FileSystem, path: str) -> DatasetError:
    bucket = path.split("/", 1)[0]
    if "/" not in path or _call(uri, filesystem.get_file_info, bucket).type == pafs.FileType.NotFound:
        return DatasetError(
            f"{uri}: {store} bucket {bucket!r} does not exist or is not visible with these credentials; "
            f"check the bucket's name, or {_HINTS[store]}"
        )
    return DatasetError(f"{uri}: no such object or prefix; check the key (listing is case-sensitive)")


def _with_retry_limit(uri: str) -> str:
    """``uri`` for pyarrow: a ``gs://`` URI that sets no ``retry_limit_seconds`` gets
    `GCS_RETRY_SECONDS`. Without credentials pyarrow's GCS client retries getting a token for
    15 minutes before it reports anything; one minute still rides out a brief outage."""
    parts = urlsplit(uri)
    keys = [key for key, _ in parse_qsl(parts.query, keep_blank_values=True)]
    if _STORES.get(parts.scheme.lower()) != "GCS" or "retry_limit_seconds" in keys:
        return uri
    limit = f"retry_limit_seconds={GCS_RETRY_SECONDS}"  # the query as given, this appended
    return urlunsplit(parts._replace(query=f"{parts.query}&{limit}" if parts.query else limit))


def _root(uri: str, path: str) -> str:
    return f"{urlsplit(uri).scheme.lower()}://{path.split('/', 1)[0]}"


def _name(uri: str, path: str) -> str:
    """A file's URI: the scheme and its filesystem path (bucket/key), no query or credentials."""
    return f"{urlsplit(uri).scheme.lower()}://{path}"
