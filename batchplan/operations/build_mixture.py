"""End to end for a mixture: mixture file -> sources' lengths -> plan file, what the CLI's
``build`` does with a mixture file, as a library call."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from batchplan.config import PlanConfig, num_threads
from batchplan.errors import ConfigError
from batchplan.mixture import Mixture

__all__ = ["build_mixture_plan_file", "mixture_metadata"]

PathLike = str | os.PathLike


def build_mixture_plan_file(
    mixture: PathLike | Mixture,
    output: PathLike,
    config: PlanConfig,
    *,
    length_column: str = "length",
    tokens_column: str = "input_ids",
    loss_tokens_column: str | None = None,
    progress=None,
    layout: str | None = None,
    only_epochs: range | None = None,
) -> dict[str, Any]:
    """Read a mixture's sources, size them, plan every epoch, write the plan atomically;
    return its metadata. An epoch of a mixture's plan is a part of the run
    (`batchplan.planning.mixture_epochs`).

    Args:
        mixture: a mixture file (YAML or JSON, `batchplan.formats.mixture_file`) or a `Mixture`.
        length_column, tokens_column, loss_tokens_column: the columns of sources that do
            not name their own.
        progress, layout, only_epochs: as for `batchplan.operations.build.build_plan_file`.

    Raises:
        ConfigError: a bad mixture or option, or an unusable output path.
        DatasetError: a source cannot be read or breaks a rule.
    """
    from batchplan.formats.mixture_file import read_mixture
    from batchplan.operations.build import check_layout, check_output, write_directory
    from batchplan.planning.epochs import PreparedEntries

    if not isinstance(mixture, Mixture):
        mixture = read_mixture(mixture)
    layout, wanted = check_layout(layout, only_epochs, config)
    output = Path(output)
    check_output(output, [path for source in mixture.sources for path in source.paths], layout)
    columns = {"length_column": length_column, "tokens_column": tokens_column, "loss_tokens_column": loss_tokens_column}
    prepared, num_samples, fingerprint, described = _prepare(mixture, config, columns, progress)
    prepared_epochs = PreparedEntries.of_mixture(num_samples, prepared)
    if layout == "directory":
        from batchplan.formats.plan_writer import header_metadata

        header = header_metadata(config, num_samples, prepared.entries, None, fingerprint, described)
        return write_directory(output, config, prepared_epochs, header, wanted, progress)
    return _write_file(output, config, prepared_epochs, fingerprint, described, progress)


def _prepare(mixture: Mixture, config: PlanConfig, columns: dict[str, Any], progress):
    """Read every source's lengths and lay out the run's entries (memory checked): ``(the
    entries, the mixture's samples, its lengths' fingerprint, the plan's mixture metadata)``."""
    from batchplan.formats.mixture_file import read_mixture_lengths
    from batchplan.kernels.startup import start_numba
    from batchplan.operations.build import stage
    from batchplan.planning.memory import check_build_memory, estimate_build_memory
    from batchplan.planning.mixture_entries import prepare_mixture_entries

    advance = stage(progress, "reading sources", len(mixture.sources))
    with ThreadPoolExecutor(max_workers=1) as reader:
        # Reading releases the GIL: it runs while numba is imported and started (Python, ~0.3 s).
        reading = reader.submit(read_mixture_lengths, mixture, **columns, fingerprints=False)
        start_numba()
        lengths = reading.result()
        advance(len(mixture.sources))
        # The sources' fingerprints are hashed (BLAKE2b releases the GIL) while they are sized.
        hashing = reader.submit(lengths.fingerprinted)
        threads = num_threads()
        prepared = prepare_mixture_entries(
            mixture, lengths.lengths, lengths.offsets, config, loss_tokens=lengths.loss_tokens, threads=threads
        )
        lengths = hashing.result()
    # The sources' lengths are in the entries now: only what describes them is kept.
    num_samples, fingerprint, sources = lengths.num_samples, lengths.fingerprint(), lengths.sources
    del lengths
    used = prepared.entries.length
    check_build_memory(estimate_build_memory(used.shape[0], config, num_threads=threads, lengths=used))
    return prepared, num_samples, fingerprint, mixture_metadata(mixture, sources, prepared.selections, columns)


def _write_file(output: Path, config: PlanConfig, prepared, fingerprint: str, described, progress) -> dict[str, Any]:
    """Plan every epoch of ``prepared`` (`batchplan.planning.epochs.PreparedEntries`) and write
    the plan file; return its metadata."""
    from batchplan.formats.plan_writer import write_plan
    from batchplan.operations.build import stage
    from batchplan.plan import Plan
    from batchplan.planning.epochs import plan_epochs

    advance = stage(progress, "planning epochs", config.epochs)
    epochs = []
    for epoch in plan_epochs(prepared, config):
        epochs.append(epoch)
        advance(1)
    plan = Plan(config=config, num_samples=prepared.num_samples, entries=prepared.entries, epochs=tuple(epochs))
    advance = stage(progress, "writing plan", config.epochs * config.world_size)
    return write_plan(plan, output, lengths_fingerprint=fingerprint, mixture=described, on_batch=lambda _: advance(1))


def mixture_metadata(mixture: Mixture, read_sources, selections, columns: dict[str, Any]) -> dict[str, Any]:
    """The plan's ``mixture`` metadata: the file as given, and per source (in order) where its
    samples lie (``read_sources``: `batchplan.formats.mixture_file.SourceLengths`), what was
    asked of it and what the plan uses; with phases, ``phases``: each phase's ``from_tokens``
    (0 first: the sources' own weights) and ``weights``, normalised, in the sources' order."""
    sources = []
    for source, read, selection in zip(mixture.sources, read_sources, selections):
        if (read.name, selection.name) != (source.name, source.name):
            raise ConfigError(f"sources out of order: {source.name!r}, {read.name!r}, {selection.name!r}")
        sources.append(
            {
                "name": source.name,
                "paths": list(source.paths),
                "offset": read.offset,
                "num_samples": read.num_samples,
                "files": [[path, rows] for path, rows in read.files],
                "lengths_fingerprint": read.fingerprint,
                "length_column": source.length_column or columns["length_column"],
                "loss_tokens_column": source.loss_tokens_column or columns["loss_tokens_column"],
                "weight": selection.weight,
                "target_tokens": selection.target_tokens,
                "planned_tokens": selection.planned_tokens,
                "passes": selection.passes,
            }
        )
    described = {"fingerprint": mixture.fingerprint(), "spec": mixture.to_dict(), "sources": sources}
    if mixture.phases:
        starts, weights = mixture.phase_weights()
        described["phases"] = [{"from_tokens": start, "weights": row} for start, row in zip(starts, weights)]
    return described
