"""End to end: dataset files -> plan file, what the CLI's ``build`` does, as a library call."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from batchplan.config import PlanConfig, num_threads
from batchplan.errors import ConfigError
from batchplan.formats.lengths import DatasetFiles, count_samples, find_dataset_files, read_lengths
from batchplan.formats.storage import is_uri
from batchplan.planning.memory import check_build_memory, estimate_build_memory

__all__ = ["Progress", "build_plan_file"]

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
) -> dict[str, Any]:
    """Read lengths, plan every epoch, write the plan atomically; return its metadata.

    Raises:
        ConfigError: bad options, an unusable output path, or a build whose estimated
            peak memory exceeds what is available (`batchplan.planning.memory`), checked before
            reading the lengths and again before planning.
        DatasetError: the dataset cannot be read or breaks a rule.
    """
    from batchplan.formats.plan_writer import write_plan

    output = Path(output)
    files = find_dataset_files(dataset)
    _check_output(output, files.paths)
    threads = num_threads()
    num_samples = count_samples(files)
    if num_samples is not None:  # before reading: a lower bound from the sample count
        check_build_memory(estimate_build_memory(num_samples, config, num_threads=threads))
    advance = _stage(progress, "reading lengths", len(files.paths))
    columns = {"length_column": length_column, "tokens_column": tokens_column, "loss_tokens_column": loss_tokens_column}
    with ThreadPoolExecutor(max_workers=1) as reader:
        # Reading and hashing the lengths and estimating the build's memory from them
        # release the GIL: they run while numba is imported and started, which is
        # Python (~0.3 s of every build).
        reading = reader.submit(_read_and_estimate, files, columns, config, threads, advance)
        from batchplan.kernels.startup import start_numba
        from batchplan.planning.epochs import build_plan

        start_numba()
        lengths, fingerprint, estimate = reading.result()
    check_build_memory(estimate)  # before planning: micro-batches and spans estimated from the lengths
    advance = _stage(progress, "planning epochs", config.epochs)
    plan = build_plan(lengths.lengths, config, loss_tokens=lengths.loss_tokens, on_epoch=lambda _: advance(1))
    advance = _stage(progress, "writing plan", config.epochs * config.world_size)
    source = {
        "files": [[path, rows] for path, rows in lengths.files],
        "length_column": lengths.column,
        "loss_tokens_column": loss_tokens_column,
    }
    return write_plan(
        plan, output, dataset=source, lengths_fingerprint=fingerprint, on_batch=lambda _: advance(1)
    )


def _read_and_estimate(
    files: DatasetFiles, columns: dict[str, Any], config: PlanConfig, threads: int, advance: Callable[[int], None]
):
    """The lengths (``advance(1)`` as each file is read), their fingerprint, and the build's
    memory estimate from them."""
    lengths = read_lengths(files, **columns, on_file=lambda _: advance(1))
    estimate = estimate_build_memory(lengths.num_samples, config, num_threads=threads, lengths=lengths.lengths)
    return lengths, lengths.fingerprint(), estimate


def _check_output(output: Path, inputs: Sequence[str]) -> None:
    if not output.parent.is_dir():
        raise ConfigError(f"output directory {output.parent} does not exist; create it or choose another -o")
    if output.is_dir():
        raise ConfigError(f"output {output} is a directory; give a file path such as {output / 'plan.arrow'}")
    resolved = output.resolve()
    for path in inputs:
        if not is_uri(path) and Path(path).resolve() == resolved:
            raise ConfigError(f"output {output} is also an input file; choose another -o")


def _stage(progress: Progress | None, description: str, total: int | None) -> Callable[[int], None]:
    if progress is None:
        return lambda _n: None
    return progress.stage(description, total)
