"""End to end: dataset files -> plan file, what the CLI's ``build`` does, as a library call."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from batchplan.config import PlanConfig, num_threads
from batchplan.errors import ConfigError
from batchplan.formats.dataset_files import DatasetFiles, count_samples, find_dataset_files
from batchplan.formats.lengths import read_lengths
from batchplan.formats.storage import is_uri
from batchplan.planning.memory import check_build_memory, estimate_build_memory

__all__ = ["Progress", "build_plan_file", "check_layout", "check_output", "stage", "write_directory"]

PathLike = str | os.PathLike


class Progress(Protocol):
    """Receives progress: ``stage`` starts a stage and returns its ``advance(n)``."""

    def stage(self, description: str, total: int | None) -> Callable[[int], None]: ...


def build_plan_file(
    dataset: PathLike | Sequence[PathLike],
    output: PathLike,
    config: PlanConfig,
    *,
    length_column: str = "length",
    tokens_column: str = "input_ids",
    loss_tokens_column: str | None = None,
    progress: Progress | None = None,
    layout: str | None = None,
    only_epochs: range | None = None,
) -> dict[str, Any]:
    """Read lengths, plan every epoch, write the plan atomically; return its metadata.

    Args:
        layout: ``"file"`` (default): one plan file, written once every epoch is planned;
            ``"directory"`` (default with ``only_epochs``): a plan directory
            (`batchplan.formats.plan_directory`), each epoch's file written as soon as it
            is planned, so memory holds the epochs being planned, not the plan.
        only_epochs: plan and write these epochs only, into a plan directory; builds of
            the other epochs (other processes or machines, any order) complete it, and the
            build that writes the last epoch file writes the manifest.

    Returns:
        The plan's metadata (a directory's manifest); for a directory still missing epochs,
        ``{"missing_epochs": [...]}``.

    Raises:
        ConfigError: bad options, an unusable output path, or a build whose estimated
            peak memory exceeds what is available (`batchplan.planning.memory`), checked before
            reading the lengths and again before planning.
        DatasetError: the dataset cannot be read or breaks a rule.
    """
    layout, epochs = check_layout(layout, only_epochs, config)
    output = Path(output)
    files = find_dataset_files(dataset)
    check_output(output, files.paths, layout)
    threads = num_threads()
    held = None if layout == "file" else min(len(epochs), threads)  # a directory holds the epochs in planning
    num_samples = count_samples(files)
    if num_samples is not None:  # before reading: a lower bound from the sample count
        check_build_memory(_held(estimate_build_memory(num_samples, config, num_threads=threads), held, threads))
    advance = stage(progress, "reading lengths", len(files.paths))
    columns = {"length_column": length_column, "tokens_column": tokens_column, "loss_tokens_column": loss_tokens_column}
    with ThreadPoolExecutor(max_workers=1) as reader:
        # Reading the lengths and estimating the build's memory from them release the GIL:
        # they run while numba is imported and started, which is Python (~0.3 s of every build).
        reading = reader.submit(_read_and_estimate, files, columns, config, threads, advance)
        from batchplan.kernels.startup import start_numba

        start_numba()
        lengths, estimate = reading.result()
        # The fingerprint is written with the plan: the lengths are hashed (BLAKE2b releases
        # the GIL; ~5 s of CPU at 10^9 samples) while the first epoch is planned.
        hashing = reader.submit(lengths.fingerprint)
        # before planning: micro-batches and spans estimated from the lengths
        check_build_memory(_held(estimate, held, threads))
        source = {
            "files": [[path, rows] for path, rows in lengths.files],
            "length_column": lengths.column,
            "loss_tokens_column": loss_tokens_column,
        }
        if layout == "directory":
            return _build_directory(output, config, lengths, source, hashing.result, epochs, progress)
        return _build_file(output, config, lengths, source, hashing.result, progress)


def _read_and_estimate(
    files: DatasetFiles, columns: dict[str, Any], config: PlanConfig, threads: int, advance: Callable[[int], None]
):
    """The lengths (``advance(1)`` as each file is read) and the build's memory estimate from them."""
    lengths = read_lengths(files, **columns, on_file=lambda _: advance(1))
    estimate = estimate_build_memory(lengths.num_samples, config, num_threads=threads, lengths=lengths.lengths)
    return lengths, estimate


def _build_file(output: Path, config: PlanConfig, lengths, source, fingerprint: Callable[[], str], progress):
    """Plan every epoch of one dataset, then write them into one plan file."""
    from batchplan.formats.plan_writer import write_plan
    from batchplan.planning.epochs import build_plan

    advance = stage(progress, "planning epochs", config.epochs)
    plan = build_plan(lengths.lengths, config, loss_tokens=lengths.loss_tokens, on_epoch=lambda _: advance(1))
    advance = stage(progress, "writing plan", config.epochs * config.world_size)
    return write_plan(plan, output, dataset=source, lengths_fingerprint=fingerprint(), on_batch=lambda _: advance(1))


def _build_directory(
    output: Path, config: PlanConfig, lengths, source, fingerprint: Callable[[], str], epochs: range, progress
):
    """Plan ``epochs`` of one dataset into a plan directory (`write_directory`); ``fingerprint``
    gives the lengths' fingerprint when the first epoch is written."""
    from batchplan.formats.plan_writer import header_metadata
    from batchplan.planning.epochs import prepare_entries

    prepared = prepare_entries(lengths.lengths, config, loss_tokens=lengths.loss_tokens)

    def header() -> dict[str, Any]:
        return header_metadata(config, prepared.num_samples, prepared.entries, source, fingerprint())

    return write_directory(output, config, prepared, header, epochs, progress)


def write_directory(
    output: Path,
    config: PlanConfig,
    prepared,
    header: dict[str, Any] | Callable[[], dict[str, Any]],
    epochs: range,
    progress,
):
    """Plan ``epochs`` of ``prepared`` (`batchplan.planning.epochs.PreparedEntries`) and write
    each one's file as soon as it is planned; then the manifest, if every epoch's file is
    there (`batchplan.formats.directory_writer`: the plan already there stays whole until
    then). Returns the manifest, or ``{"missing_epochs": [...]}``."""
    from batchplan.formats.directory_writer import DirectoryWriter
    from batchplan.planning.epochs import plan_epochs

    with DirectoryWriter(output, header) as writer:
        advance = stage(progress, "planning and writing epochs", len(epochs) * config.world_size)
        for epoch in plan_epochs(prepared, config, epochs):
            writer.write_epoch(prepared.entries, epoch, on_batch=lambda _: advance(1))
        manifest, missing = writer.complete()
    return manifest if manifest is not None else {"missing_epochs": missing}


def check_layout(layout: str | None, only_epochs: range | None, config: PlanConfig) -> tuple[str, range]:
    """The layout to write and the epochs to plan."""
    if layout is None:
        layout = "file" if only_epochs is None else "directory"
    if layout not in ("file", "directory"):
        raise ConfigError(f"`layout` must be 'file' or 'directory', got {layout!r}")
    if only_epochs is None:
        return layout, range(config.epochs)
    if layout == "file":
        raise ConfigError('`only_epochs` writes part of a plan directory; use `layout="directory"` (or leave it out)')
    if only_epochs.step != 1 or not 0 <= only_epochs.start < only_epochs.stop <= config.epochs:
        raise ConfigError(
            f"`only_epochs` {only_epochs.start}:{only_epochs.stop} is not a range START:STOP of the plan's "
            f"epochs 0..{config.epochs - 1} (STOP excluded, at most `epochs` {config.epochs})"
        )
    return layout, only_epochs


def _held(estimate, held: int | None, threads: int):
    """The estimate for a build holding ``held`` epochs at a time (None: every epoch)."""
    return estimate if held is None else estimate.with_epochs(held, threads)


def check_output(output: Path, inputs: Sequence[str], layout: str) -> None:
    if not output.parent.is_dir():
        raise ConfigError(f"output directory {output.parent} does not exist; create it or choose another -o")
    if layout == "file" and output.is_dir():
        raise ConfigError(
            f"output {output} is a directory; give a file path such as {output / 'plan.arrow'} "
            '(or write a plan directory with `layout="directory"`)'
        )
    resolved = output.resolve()
    for path in inputs:
        if not is_uri(path) and Path(path).resolve() == resolved:
            raise ConfigError(f"output {output} is also an input file; choose another -o")


def stage(progress: Progress | None, description: str, total: int | None) -> Callable[[int], None]:
    if progress is None:
        return lambda _n: None
    return progress.stage(description, total)
