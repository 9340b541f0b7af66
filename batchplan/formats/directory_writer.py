"""Write a plan directory: one Arrow file per epoch, written as each epoch is planned, and
the manifest, written once every epoch's file is there (by whichever build completes
the set). The layout is in `batchplan.formats.plan_directory` and docs/plan-format.md.

Epoch files depend only on the configuration, the lengths and their epoch, so builds of
disjoint epoch ranges (``--only-epochs``), run anywhere and in any order, make the same
bytes as one build of every epoch.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchplan.errors import ConfigError, PlanFormatError
from batchplan.formats.atomic import atomic_path
from batchplan.formats.plan_directory import MANIFEST, epoch_file_name
from batchplan.formats.plan_file import dump_json, hash_text, metadata_crc, open_arrow, read_metadata
from batchplan.formats.plan_writer import epoch_batches, epoch_metadata, merge_metadata, plan_schema, write_batches

if TYPE_CHECKING:
    from batchplan.plan import Entries, EpochPlan

__all__ = ["complete_directory", "header_fingerprint", "prepare_directory", "write_epoch_file"]

_OWN_FILES = re.compile(r"(epoch-\d+\.arrow|manifest\.json|\..+\.tmp)")


def header_fingerprint(header: dict[str, Any]) -> str:
    """What every epoch file of one plan carries: SHA-256 (16 hex) of the plan's header."""
    return hashlib.sha256(dump_json(header)).hexdigest()[:16]


def prepare_directory(directory: Path) -> None:
    """Make ``directory`` ready for epoch files: created if missing (its parent must exist),
    holding nothing but a plan directory's files, its manifest removed (it is written again
    once every epoch file is there).

    Raises:
        ConfigError: the parent is missing, ``directory`` is a file, or it holds other files.
    """
    if not directory.parent.is_dir():
        raise ConfigError(f"output directory {directory.parent} does not exist; create it or choose another -o")
    if directory.exists() and not directory.is_dir():
        raise ConfigError(
            f"output {directory} is a file; a plan directory needs a directory path (or build a single "
            "file without --layout directory / --only-epochs)"
        )
    directory.mkdir(exist_ok=True)
    others = sorted(p.name for p in directory.iterdir() if not _OWN_FILES.fullmatch(p.name))
    if others:
        raise ConfigError(
            f"output directory {directory} holds files that are not a plan's ({', '.join(others[:5])}"
            f"{', ...' if len(others) > 5 else ''}); choose an empty or new directory"
        )
    (directory / MANIFEST).unlink(missing_ok=True)


def write_epoch_file(
    directory: Path,
    header: dict[str, Any],
    entries: Entries,
    epoch: EpochPlan,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Write one epoch's file atomically; return its metadata.

    Its ``step`` and ``tokens_before_step`` count from the epoch's start (the epochs before
    it may not be planned yet); readers add the epoch's first step and tokens before it,
    from the manifest.
    """
    metadata = {
        "format_version": header["format_version"],
        "layout": "epoch",
        "plan": header_fingerprint(header),
        "world_size": header["world_size"],
        "epochs": header["epochs"],
        **epoch_metadata(entries, epoch),
    }
    schema = plan_schema(
        header["num_samples"], header["has_spans"], has_cost=header["attention_coefficient"] is not None,
        has_padded=header["mode"] == "pad",
    )  # fmt: skip
    batches = epoch_batches(schema, entries, epoch, 0, 0, on_batch)
    return write_batches(directory / epoch_file_name(epoch.epoch), schema, metadata, batches)


def complete_directory(directory: Path, header: dict[str, Any]) -> tuple[dict[str, Any] | None, list[int]]:
    """Write the manifest if every epoch's file is there: ``(manifest, [])``, else
    ``(None, the epochs still missing)``.

    Raises:
        ConfigError: an epoch file there belongs to another plan (other settings, data or
            versions), or is not an epoch file.
    """
    epochs = range(header["epochs"])
    missing = [e for e in epochs if not (directory / epoch_file_name(e)).is_file()]
    if missing:
        return None, missing
    fingerprint = header_fingerprint(header)
    parts, files, foreign = [], [], []
    for epoch in epochs:
        path = directory / epoch_file_name(epoch)
        try:
            metadata = read_metadata(open_arrow(path), path)
        except PlanFormatError:
            foreign.append(path.name)
            continue
        if metadata.get("plan") != fingerprint or metadata.get("epoch") != epoch:
            foreign.append(path.name)
            continue
        parts.append(metadata)
        files.append({"name": path.name, "content_hash": metadata["content_hash"], "tokens": metadata["tokens"]})
    if foreign:
        raise ConfigError(
            f"{directory}: {', '.join(foreign)} belong to another plan (other settings, dataset or "
            "versions) or are damaged; build those epochs again with the same command (--only-epochs)"
        )
    manifest = {**merge_metadata(header, parts), "layout": "directory", "plan": fingerprint, "epoch_files": files}
    manifest["content_hash"] = hash_text(metadata_crc(manifest))
    with atomic_path(directory / MANIFEST) as temporary:
        temporary.write_bytes(dump_json(manifest))
    return manifest, []

