"""Write a plan directory: one Arrow file per epoch, written as each epoch is planned, and
the manifest, written once every epoch's file is there (by whichever build completes
the set). The layout is in `batchplan.formats.plan_directory` and docs/plan-format.md.

A rebuild never touches the plan already there until the new one is complete. Epoch files
are named by their plan's fingerprint (``epoch-00000.<plan>.arrow``), so a build of other
settings writes beside the previous plan's files, and a build of the same settings writes
the same bytes over them (each file replaced atomically, `batchplan.formats.atomic`). The
manifest's atomic rename is the one switch: before it, the directory holds the previous
plan (its manifest and epoch files byte for byte); after it, the new one. Only then are
the files the new manifest does not list removed (the previous plan's, those of builds
that were killed, and their temporaries). So SIGKILL at any moment leaves one complete
plan, the previous or the new, plus files its manifest does not list, which readers
ignore and the next build that completes a plan removes. A build that fails or is
interrupted (an exception, a full disk, SIGTERM) first removes the epoch files it wrote
that no manifest there lists.

Epoch files depend only on the configuration, the lengths and their epoch, so builds of
disjoint epoch ranges (``only_epochs``), run anywhere and in any order, make the same
bytes as one build of every epoch. Completions of builds into one directory take a lock
(``flock`` on the directory, where the filesystem has it), so two builds of different
settings finishing together do not remove each other's files after the switch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchplan.errors import BatchPlanError, ConfigError, PlanFormatError
from batchplan.formats.arrow_file import open_arrow, read_metadata
from batchplan.formats.atomic import atomic_path, remove_stale_temporaries
from batchplan.formats.plan_directory import EPOCH_FILE, MANIFEST, epoch_file_name, read_manifest_names
from batchplan.formats.plan_format import dump_json, hash_text, metadata_crc
from batchplan.formats.plan_writer import epoch_batches, epoch_metadata, merge_metadata, plan_schema, write_batches

if TYPE_CHECKING:
    from batchplan.plan import Entries, EpochPlan

__all__ = ["DirectoryWriter", "header_fingerprint"]

_OWN_FILES = re.compile(rf"{EPOCH_FILE.pattern}|{re.escape(MANIFEST)}|\..+\.tmp")
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def header_fingerprint(header: dict[str, Any]) -> str:
    """What every epoch file of one plan carries: SHA-256 (16 hex) of the plan's header."""
    return hashlib.sha256(dump_json(header)).hexdigest()[:16]


class DirectoryWriter:
    """One build's writes into a plan directory: `write_epoch` for each planned epoch, then
    `complete`. Used as a context manager: on any exception it removes the epoch files it
    wrote that no manifest there lists, and an `OSError` (a full disk, permissions) becomes
    one line saying what is left.

    Args:
        directory: the plan directory; created if missing (its parent must exist); a
            symbolic link is written through. It may hold only a plan directory's files.
        header: the plan's header metadata (`batchplan.formats.plan_writer.header_metadata`),
            or a function that makes it, called when the first epoch is written (a build
            hashes the lengths for it while the first epoch is planned).

    Raises:
        ConfigError: the parent is missing, ``directory`` is a file, holds other files, or is
            not writable.
    """

    def __init__(self, directory: Path, header: dict[str, Any] | Callable[[], dict[str, Any]]) -> None:
        self.directory = _usable_directory(Path(directory))
        self._header = header
        self._had_plan = (self.directory / MANIFEST).is_file()
        self._written: list[str] = []

    @functools.cached_property
    def header(self) -> dict[str, Any]:
        return self._header() if callable(self._header) else self._header

    @functools.cached_property
    def plan(self) -> str:
        """What every epoch file of this plan carries (`header_fingerprint`)."""
        return header_fingerprint(self.header)

    def __enter__(self) -> DirectoryWriter:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if error is None:
            return
        removed = self._remove_written()
        if isinstance(error, OSError) and not isinstance(error, BatchPlanError):
            raise self._write_failed(error, removed) from error

    def write_epoch(
        self, entries: Entries, epoch: EpochPlan, on_batch: Callable[[int], None] | None = None
    ) -> dict[str, Any]:
        """Write one epoch's file atomically; return its metadata.

        Its ``step`` and ``tokens_before_step`` count from the epoch's start (the epochs before
        it may not be planned yet); readers add the epoch's first step and tokens before it,
        from the manifest.
        """
        header = self.header
        metadata = {
            "format_version": header["format_version"],
            "layout": "epoch",
            "plan": self.plan,
            "world_size": header["world_size"],
            "epochs": header["epochs"],
            **epoch_metadata(entries, epoch),
        }
        schema = plan_schema(
            header["num_samples"],
            header["has_spans"],
            has_cost=header["attention_coefficient"] is not None,
            has_padded=header["mode"] == "pad",
            has_source=header.get("mixture") is not None,
        )
        batches = epoch_batches(schema, entries, epoch, 0, 0, on_batch)
        name = epoch_file_name(epoch.epoch, self.plan)
        self._written.append(name)  # before the rename: an interrupted write may still land it
        return write_batches(self.directory / name, schema, metadata, batches)

    def complete(self) -> tuple[dict[str, Any] | None, list[int]]:
        """Write the manifest if every epoch's file is there, then remove the files it does not
        list: ``(manifest, [])``; else ``(None, the epochs still missing)``.

        Raises:
            ConfigError: an epoch file this build wrote is gone (another build of other
                settings completed its plan here meanwhile), or one there is damaged.
        """
        with _locked(self.directory):
            names = [epoch_file_name(e, self.plan) for e in range(self.header["epochs"])]
            missing = [e for e, name in enumerate(names) if not (self.directory / name).is_file()]
            lost = [names[e] for e in missing if names[e] in self._written]
            if lost:
                raise ConfigError(
                    f"{self.directory}: {', '.join(lost)}, written by this build, are gone: another build of "
                    "other settings may be running into this directory and completed its plan first; run one "
                    "build per directory at a time, then run this build again"
                )
            if missing:
                return None, missing
            manifest = self._manifest(names)
            with atomic_path(self.directory / MANIFEST) as temporary:
                temporary.write_bytes(dump_json(manifest))
            self._remove_unlisted(set(names))
        return manifest, []

    def _manifest(self, names: list[str]) -> dict[str, Any]:
        """The manifest of the epoch files ``names`` (checked: this plan's, of their epoch)."""
        parts, files, damaged = [], [], []
        for epoch, name in enumerate(names):
            path = self.directory / name
            try:
                metadata = read_metadata(open_arrow(path), path)
            except PlanFormatError:
                metadata = {}
            if metadata.get("plan") != self.plan or metadata.get("epoch") != epoch:
                damaged.append(name)
                continue
            parts.append(metadata)
            files.append({"name": name, "content_hash": metadata["content_hash"], "tokens": metadata["tokens"]})
        if damaged:
            raise ConfigError(
                f"{self.directory}: {', '.join(damaged)} are damaged or renamed (their metadata is not that "
                "epoch's of this plan); delete them and build those epochs again with the same command "
                "(`only_epochs`)"
            )
        manifest = {**merge_metadata(self.header, parts), "layout": "directory", "plan": self.plan}
        manifest["epoch_files"] = files
        manifest["content_hash"] = hash_text(metadata_crc(manifest))
        return manifest

    def _remove_unlisted(self, listed: set[str]) -> None:
        """After the switch: epoch files the manifest does not list, and temporaries of killed
        writers of them. Temporaries of this plan's files are left to the next write of that
        file (their writer may be alive on another machine)."""
        with contextlib.suppress(OSError):
            for child in self.directory.iterdir():
                if EPOCH_FILE.fullmatch(child.name) and child.name not in listed:
                    child.unlink(missing_ok=True)
            remove_stale_temporaries(self.directory, keep=lambda name: name in listed or name == MANIFEST)

    def _remove_written(self) -> int:
        """After a failure: the epoch files this build wrote that no manifest lists; how many."""
        listed = read_manifest_names(self.directory)
        if listed is None:
            return 0
        removed = 0
        for name in self._written:
            path = self.directory / name
            if name not in listed and path.is_file():
                with contextlib.suppress(OSError):
                    path.unlink()
                    removed += 1
        return removed

    def _write_failed(self, error: OSError, removed: int) -> OSError:
        """``error`` as one line: the directory, what is left, the fix; an `OSError` of the same errno."""
        reason = os.strerror(error.errno) if error.errno else str(error)
        if self._had_plan and (self.directory / MANIFEST).is_file():
            left = "the previous plan there is intact (its manifest.json and epoch files are untouched)"
        else:
            left = "there is no complete plan there (none was before)"
        left += f"; the {removed} epoch file(s) this build wrote are removed" if removed else ""
        fix = "choose another output directory"
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = f"free space on the disk holding {self.directory} or {fix}"
        elif error.errno in _NOT_WRITABLE:
            fix = f"make {self.directory} writable or {fix}"
        failed = OSError(f"{self.directory}: cannot write the plan directory ({reason}); {left}; {fix}")
        failed.errno = error.errno
        return failed


def _usable_directory(directory: Path) -> Path:
    """``directory`` (its target, if a symbolic link), created, holding only a plan's files, writable."""
    if directory.is_symlink():
        directory = Path(os.path.realpath(directory))
    if not directory.parent.is_dir():
        raise ConfigError(f"output directory {directory.parent} does not exist; create it or choose another output")
    if directory.exists() and not directory.is_dir():
        raise ConfigError(
            f"output {directory} is a file; a plan directory needs a directory path (or build a single "
            "file, layout 'file', without only_epochs)"
        )
    try:
        directory.mkdir(exist_ok=True)
    except OSError as error:
        raise _not_writable(directory.parent, error, f"cannot create {directory.name} there") from error
    others = sorted(p.name for p in directory.iterdir() if not _OWN_FILES.fullmatch(p.name))
    if others:
        raise ConfigError(
            f"output directory {directory} holds files that are not a plan's ({', '.join(others[:5])}"
            f"{', ...' if len(others) > 5 else ''}); choose an empty or new directory"
        )
    try:  # fail now, not after planning
        handle, probe = tempfile.mkstemp(dir=directory, prefix=f".write-test.{os.getpid()}.", suffix=".tmp")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise _not_writable(directory, error, "cannot write a file there") from error
    return directory


def _not_writable(directory: Path, error: OSError, what: str) -> ConfigError:
    reason = os.strerror(error.errno) if error.errno else str(error)
    return ConfigError(
        f"output directory {directory} is not writable: {what} ({reason}); make it writable or choose another output"
    )


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on ``directory`` (flock), where the filesystem has one; else none."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # releases the lock
