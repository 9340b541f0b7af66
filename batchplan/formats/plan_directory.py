"""A plan directory: the layout of plans too large for one file, read like a plan file.

The directory holds ``epoch-00000.arrow``, ``epoch-00001.arrow``, ... (one Arrow IPC file
per epoch, one record batch per rank, columns as in a plan file) and ``manifest.json``:
the plan's metadata (the keys of a plan file's), ``epoch_files`` (each file's name,
content hash and tokens) and a content hash over the manifest, which covers the epoch
files through their hashes. An epoch file's metadata holds its epoch's part of the
plan's (steps, rows per rank, drops, packing), the fingerprint of the plan it belongs to
(``plan``), and its own content hash; its ``step`` and ``tokens_before_step`` count from
the epoch's start, and `PlanDirectory` adds the epoch's first step and the tokens before
it. Opening reads the manifest only (and checks that every epoch file is there);
reading a rank's epoch opens that epoch's file by memory map and touches only its rows.
A plan directory is complete once the manifest is written (`batchplan.formats.directory_writer`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from batchplan.errors import PlanFormatError
from batchplan.formats.plan_file import (
    OpenedPlan,
    check_batch_count,
    check_columns,
    check_epoch_rank,
    check_metadata,
    decode_metadata,
    expected_schema,
    hash_text,
    metadata_crc,
    open_arrow,
    read_batch,
    read_metadata,
    shift_columns,
    unreadable_schema,
    verify_batches,
)

__all__ = ["MANIFEST", "PlanDirectory", "epoch_file_name"]

MANIFEST = "manifest.json"


def epoch_file_name(epoch: int) -> str:
    return f"epoch-{epoch:05d}.arrow"


class PlanDirectory(OpenedPlan):
    """A plan directory opened by its manifest (``metadata``: a plan file's metadata keys,
    ``layout``, ``plan``, ``epoch_files``)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        manifest = self.path / MANIFEST
        if not manifest.is_file():
            raise PlanFormatError(_incomplete(self.path))
        self.metadata = decode_metadata(manifest.read_bytes(), manifest)
        with unreadable_schema(manifest):
            check_metadata(self.metadata, manifest)
            self._files = _epoch_files(self.metadata, manifest)
        missing = [f["name"] for f in self._files if not (self.path / f["name"]).is_file()]
        if missing:
            raise PlanFormatError(
                f"{self.path}: epoch file(s) {', '.join(missing)} missing; copy them back, or build those "
                "epochs again with the plan's build command and --only-epochs"
            )
        steps = np.asarray(self.metadata["steps_per_epoch"], dtype=np.int64)
        tokens = np.asarray([f["tokens"] for f in self._files], dtype=np.int64)
        self._first_step = np.cumsum(steps) - steps
        self._tokens_before = np.cumsum(tokens) - tokens
        self._schema = expected_schema(self.metadata)
        self._readers: dict[int, pa.ipc.RecordBatchFileReader] = {}

    @property
    def schema(self) -> pa.Schema:
        return self._schema

    def read_rank(self, epoch: int, rank: int) -> pa.RecordBatch:
        """This rank's micro-batches of this epoch, in (step, micro) order."""
        check_epoch_rank(self, epoch, rank)
        path = self.path / self._files[epoch]["name"]
        batch = read_batch(self._reader(epoch), rank, path, f"rank {rank}")
        shifts = {"step": int(self._first_step[epoch]), "tokens_before_step": int(self._tokens_before[epoch])}
        return shift_columns(batch, shifts)

    def read_all(self) -> pa.Table:
        """The whole plan as one table (epoch-major, then rank)."""
        batches = [self.read_rank(e, r) for e in range(self.num_epochs) for r in range(self.world_size)]
        return pa.Table.from_batches(batches, self.schema)

    def verify(self) -> None:
        """Recompute the manifest's and every epoch file's content hash; raise `PlanFormatError`
        if one was altered."""
        found = hash_text(metadata_crc(self.metadata))
        if found != self.metadata["content_hash"]:
            raise PlanFormatError(
                f"{self.path / MANIFEST}: content hash {found} does not match the recorded "
                f"{self.metadata['content_hash']}; the manifest is corrupt, rebuild the plan"
            )
        for epoch, entry in enumerate(self._files):
            reader = self._reader(epoch)
            verify_batches(reader, read_metadata(reader, self.path / entry["name"]), self.path / entry["name"])

    def _reader(self, epoch: int) -> pa.ipc.RecordBatchFileReader:
        """Epoch ``epoch``'s file, opened once, checked against the manifest."""
        if epoch not in self._readers:
            entry = self._files[epoch]
            path = self.path / entry["name"]
            reader = open_arrow(path)
            with unreadable_schema(path):
                metadata = read_metadata(reader, path)
                check_columns(reader.schema, self.metadata, path)
            expected = {"plan": self.metadata["plan"], "epoch": epoch, "content_hash": entry["content_hash"],
                        "rows_per_rank": self.metadata["rows_per_rank"][epoch]}  # fmt: skip
            differ = [key for key, value in expected.items() if metadata.get(key) != value]
            if differ:
                raise PlanFormatError(
                    f"{path}: not the epoch file the manifest lists ({', '.join(differ)} differ); it was "
                    "replaced by another build: build the whole plan again"
                )
            check_batch_count(reader, self.world_size, path, " (one per rank)")
            self._readers[epoch] = reader
        return self._readers[epoch]


def is_plan_directory(path: Path) -> bool:
    """Whether ``path`` is a directory holding a manifest or epoch files."""
    return path.is_dir() and ((path / MANIFEST).exists() or any(path.glob("epoch-*.arrow")))


def _epoch_files(metadata: dict[str, Any], manifest: Path) -> list[dict[str, Any]]:
    files = metadata.get("epoch_files")
    keys = {"name": str, "content_hash": str, "tokens": int}
    if (
        metadata.get("layout") != "directory" or not isinstance(metadata.get("plan"), str)
        or not isinstance(files, list) or len(files) != metadata["epochs"]
        or not all(isinstance(f, dict) and all(isinstance(f.get(k), t) for k, t in keys.items()) for f in files)
    ):  # fmt: skip
        raise PlanFormatError(f"{manifest}: the manifest does not list the plan's epoch files; rebuild the plan")
    return files


def _incomplete(path: Path) -> str:
    """Why a directory is not (yet) a plan: which epoch files are there."""
    found = sorted(int(p.stem[6:]) for p in path.glob("epoch-*.arrow") if p.stem[6:].isdigit())
    if not found:
        return f"{path}: a directory without a plan's {MANIFEST} or epoch files; not a plan"
    try:
        epochs = int(read_metadata(open_arrow(path / epoch_file_name(found[0])), path)["epochs"])
        missing = f"epochs {_ranges(sorted(set(range(epochs)) - set(found)))} of {epochs} are missing"
    except (PlanFormatError, KeyError, ValueError, TypeError):
        missing = f"epoch files of epochs {_ranges(found)} are there"
    return (
        f"{path}: incomplete plan directory: no {MANIFEST}; {missing}; build them with the same command "
        "and --only-epochs (the build that writes the last one writes the manifest)"
    )


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    parts, start = [], values[0]
    for before, after in zip(values, values[1:] + [None]):
        if after != before + 1:
            parts.append(str(start) if start == before else f"{start}-{before}")
            start = after
    return ", ".join(parts)

