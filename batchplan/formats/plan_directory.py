"""A plan directory: the layout of plans too large for one file, read like a plan file.

The directory holds ``manifest.json`` and one Arrow IPC file per epoch (one record batch
per rank, columns as in a plan file), named ``epoch-00000.<plan>.arrow``, ... where
``<plan>`` is the plan's fingerprint (16 hex of the SHA-256 of its header). The manifest
holds the plan's metadata (the keys of a plan file's), ``epoch_files`` (each file's name,
content hash and tokens) and a content hash over the manifest, which covers the epoch
files through their hashes. An epoch file's metadata holds its epoch's part of the plan's
(steps, rows per rank, tokens, drops, packing), ``plan``, and its own content hash; its
``step`` and ``tokens_before_step`` count from the epoch's start, and `PlanDirectory` adds
the epoch's first step and the tokens before it.

Opening reads the manifest only: it checks the manifest's content hash (a hand-edited value
is refused) and that every epoch file it lists is there. Reading a rank's epoch opens that
epoch's file by memory map, checks that its metadata agrees with the manifest, and touches
only the rank's rows. The manifest is the plan: files it does not list (epoch files of
another plan being built, temporaries) are ignored. A rebuild writes its epoch files under
its own fingerprint beside the previous plan's and switches by renaming its manifest over
the previous one (`batchplan.formats.directory_writer`). Directories written before names
carried the fingerprint (``epoch-00000.arrow``) are read as they are: the manifest names
their files. Every damaged directory is a one-line `PlanFormatError`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from batchplan.errors import PlanFormatError
from batchplan.formats.arrow_file import (
    check_batch_count,
    open_arrow,
    read_batch,
    read_metadata,
    shift_columns,
    unreadable_schema,
    verify_batches,
)
from batchplan.formats.opened_plan import OpenedPlan, check_epoch_rank
from batchplan.formats.plan_format import (
    check_columns,
    check_metadata,
    decode_metadata,
    expected_schema,
    hash_text,
    metadata_crc,
)

__all__ = ["EPOCH_FILE", "MANIFEST", "PlanDirectory", "epoch_file_name", "open_manifest", "read_manifest_names"]

MANIFEST = "manifest.json"
# epoch-00003.0123456789abcdef.arrow (group 2: the plan's fingerprint); without it, the
# names of directories written before names carried the fingerprint.
EPOCH_FILE = re.compile(r"epoch-(\d{5,})(?:\.([0-9a-f]{16}))?\.arrow")


def epoch_file_name(epoch: int, plan: str) -> str:
    """The name of epoch ``epoch``'s file of the plan whose fingerprint is ``plan``."""
    return f"epoch-{epoch:05d}.{plan}.arrow"


class PlanDirectory(OpenedPlan):
    """A plan directory opened by its manifest (``metadata``: a plan file's metadata keys,
    ``layout``, ``plan``, ``epoch_files``)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.metadata, self._files = open_manifest(self.path)
        with unreadable_schema(self.path / MANIFEST):
            steps = np.asarray(self.metadata["steps_per_epoch"], dtype=np.int64)
            tokens = np.asarray([f["tokens"] for f in self._files], dtype=np.int64)
            self._schema = expected_schema(self.metadata)
        missing = [f["name"] for f in self._files if not (self.path / f["name"]).is_file()]
        if missing:
            raise PlanFormatError(
                f"{self.path}: epoch file(s) {', '.join(missing)} missing; copy them back, or build those "
                "epochs again with the plan's build command and `only_epochs`"
            )
        self._first_step = np.cumsum(steps) - steps
        self._tokens_before = np.cumsum(tokens) - tokens
        self._readers: dict[int, pa.ipc.RecordBatchFileReader] = {}

    @property
    def schema(self) -> pa.Schema:
        return self._schema

    def read_rank(self, epoch: int, rank: int, *, checked: bool = True) -> pa.RecordBatch:
        """This rank's micro-batches of this epoch, in (step, micro) order (`OpenedPlan.read_rank`)."""
        check_epoch_rank(self, epoch, rank)
        path = self.path / self._files[epoch]["name"]
        batch = read_batch(self._reader(epoch), rank, path, f"rank {rank}", checked=checked)
        shifts = {"step": int(self._first_step[epoch]), "tokens_before_step": int(self._tokens_before[epoch])}
        return shift_columns(batch, shifts)

    def read_all(self) -> pa.Table:
        """The whole plan as one table (epoch-major, then rank)."""
        batches = [self.read_rank(e, r) for e in range(self.num_epochs) for r in range(self.world_size)]
        return pa.Table.from_batches(batches, self.schema)

    def verify(self) -> None:
        """Recompute the manifest's and every epoch file's content hash; raise `PlanFormatError`
        if one was altered."""
        _check_manifest_hash(self.metadata, self.path / MANIFEST)
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
            differ = [key for key, value in self._expected(epoch).items() if metadata.get(key) != value]
            if differ:
                raise PlanFormatError(
                    f"{path}: not the epoch file the manifest lists ({', '.join(differ)} differ); it was "
                    "replaced or damaged: build the whole plan again"
                )
            check_batch_count(reader, self.world_size, path, " (one per rank)")
            self._readers[epoch] = reader
        return self._readers[epoch]

    def _expected(self, epoch: int) -> dict[str, Any]:
        """What epoch ``epoch``'s file's metadata says, by the manifest."""
        entry = self._files[epoch]
        return {
            "layout": "epoch",
            "plan": self.metadata["plan"],
            "epoch": epoch,
            "epochs": self.num_epochs,
            "world_size": self.world_size,
            "content_hash": entry["content_hash"],
            "tokens": entry["tokens"],
            "steps": self.metadata["steps_per_epoch"][epoch],
            "rows_per_rank": self.metadata["rows_per_rank"][epoch],
        }


def open_manifest(directory: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The manifest of a plan directory and its epoch files, checked against its content hash.

    Raises:
        PlanFormatError: no manifest (the message says which epoch files are there), or one
            that is unreadable, edited or damaged.
    """
    manifest = directory / MANIFEST
    if not manifest.is_file():
        raise PlanFormatError(_incomplete(directory))
    try:
        raw = manifest.read_bytes()
    except OSError as error:
        raise PlanFormatError(f"{manifest}: cannot read the manifest ({error.strerror}); make it readable") from error
    metadata = decode_metadata(raw, manifest)
    with unreadable_schema(manifest):
        _check_manifest_hash(metadata, manifest)
        check_metadata(metadata, manifest)
        return metadata, _epoch_files(metadata, manifest)


def read_manifest_names(directory: Path) -> set[str] | None:
    """The names of the epoch files the manifest in ``directory`` lists: empty without a
    manifest, None when there is one that cannot be read (then no file may be taken as unlisted)."""
    try:
        return {entry["name"] for entry in open_manifest(directory)[1]}
    except PlanFormatError:
        return None if (directory / MANIFEST).exists() else set()


def _check_manifest_hash(metadata: dict[str, Any], manifest: Path) -> None:
    """The manifest's recorded content hash against its contents: the values readers add to
    every row (steps, tokens before each epoch) are used only as they were written."""
    found = hash_text(metadata_crc(metadata))
    if found != metadata.get("content_hash"):
        raise PlanFormatError(
            f"{manifest}: content hash {found} does not match the recorded {metadata.get('content_hash')}; "
            "the manifest was edited or is corrupt: restore it or build the plan again"
        )


def _epoch_files(metadata: dict[str, Any], manifest: Path) -> list[dict[str, Any]]:
    """The manifest's ``epoch_files``, each named as epoch ``i``'s file of the plan."""
    files, plan = metadata.get("epoch_files"), metadata.get("plan")
    keys = {"name": str, "content_hash": str, "tokens": int}
    if (
        metadata.get("layout") != "directory"
        or not isinstance(plan, str)
        or not isinstance(files, list)
        or len(files) != metadata["epochs"]
        or not all(isinstance(f, dict) and all(isinstance(f.get(k), t) for k, t in keys.items()) for f in files)
    ):
        raise PlanFormatError(f"{manifest}: the manifest does not list the plan's epoch files; rebuild the plan")
    for epoch, entry in enumerate(files):
        if entry["name"] not in (epoch_file_name(epoch, plan), f"epoch-{epoch:05d}.arrow"):
            raise PlanFormatError(
                f"{manifest}: epoch {epoch}'s file is listed as {entry['name']!r}, expected "
                f"{epoch_file_name(epoch, plan)!r}; the manifest is corrupt, rebuild the plan"
            )
    return files


def _incomplete(path: Path) -> str:
    """Why a directory without a manifest is not (yet) a plan: which epoch files are there."""
    plans: dict[str | None, list[int]] = {}
    for child in sorted(path.iterdir()) if path.is_dir() else []:
        match = EPOCH_FILE.fullmatch(child.name)
        if match:
            plans.setdefault(match[2], []).append(int(match[1]))
    if not plans:
        return f"{path}: a directory without a plan's {MANIFEST} or epoch files; not a plan"
    plan, found = max(plans.items(), key=lambda item: len(item[1]))
    found.sort()
    others = f" (and epoch files of {len(plans) - 1} other plan(s))" if len(plans) > 1 else ""
    epochs = _epochs_of(path / (epoch_file_name(found[0], plan) if plan else f"epoch-{found[0]:05d}.arrow"), plan)
    if epochs is None:
        there = f"epoch files of epochs {_ranges(_spans(found))} are there{others}"
    elif not _missing(found, epochs):
        return (
            f"{path}: incomplete plan directory: all {epochs} epoch files are there{others} but no {MANIFEST}: "
            "the build that wrote the last one stopped before writing it, or is still running; run any part of "
            "that build again (the same command, with or without `only_epochs`) to write it"
        )
    else:
        there = f"epochs {_ranges(_missing(found, epochs))} of {epochs} are missing{others}"
    return (
        f"{path}: incomplete plan directory: no {MANIFEST}; {there}; build them with the same command "
        "and `only_epochs` (the build that writes the last one writes the manifest)"
    )


def _epochs_of(path: Path, plan: str | None) -> int | None:
    """The plan's epoch count by one of its epoch files, None if that file does not say."""
    try:
        metadata = read_metadata(open_arrow(path), path)
    except PlanFormatError:
        return None
    epochs = metadata.get("epochs")
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        return None
    return epochs if plan is None or metadata.get("plan") == plan else None


def _missing(found: list[int], epochs: int) -> list[tuple[int, int]]:
    """The epochs of ``0..epochs-1`` not in ``found`` (sorted), as inclusive spans: O(found)."""
    gaps, start = [], 0
    for epoch in [e for e in found if e < epochs] + [epochs]:
        if epoch > start:
            gaps.append((start, epoch - 1))
        start = epoch + 1
    return gaps


def _spans(values: list[int]) -> list[tuple[int, int]]:
    """Sorted ``[0, 1, 2, 5]`` as inclusive spans ``[(0, 2), (5, 5)]``."""
    spans: list[tuple[int, int]] = []
    for value in values:
        if spans and spans[-1][1] + 1 == value:
            spans[-1] = (spans[-1][0], value)
        else:
            spans.append((value, value))
    return spans


def _ranges(spans: list[tuple[int, int]]) -> str:
    """Inclusive spans ``[(0, 2), (5, 5)]`` as ``0-2, 5``."""
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
