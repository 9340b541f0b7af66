"""Mixture files in (YAML; JSON is valid YAML), and the lengths of every source as one dataset.

`read_mixture` reads a `batchplan.mixture.Mixture`; a source's relative paths are resolved
against the mixture file's directory (``s3://`` and ``gs://`` URIs are kept as they are).
`read_mixture_lengths` reads each source with `batchplan.formats.lengths.read_lengths` and
concatenates them in the file's order: global sample ``i`` of source ``k`` is its row
``i - offsets[k]``, where source ``k`` starts at the sum of the earlier sources' rows.
Memory: the sources' lengths (2 or 4 bytes per sample) twice while they are joined.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from batchplan.config import num_threads
from batchplan.errors import ConfigError, DatasetError
from batchplan.formats.lengths import (
    SampleLengths,
    count_samples,
    find_dataset_files,
    fingerprint_lengths,
    read_lengths,
)
from batchplan.formats.storage import is_uri
from batchplan.mixture import Mixture, MixtureSource

__all__ = ["MixtureLengths", "SourceLengths", "read_mixture", "read_mixture_lengths"]

PathLike = str | os.PathLike


def read_mixture(path: PathLike) -> Mixture:
    """Read a mixture file (YAML or JSON), its relative source paths resolved against its directory.

    Raises:
        ConfigError: a missing or unreadable file, a YAML syntax error (with its line), a
            document that is not a mapping, or a mixture that breaks a rule; the message
            starts with the file's path.
    """
    import yaml  # only mixtures need it

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such mixture file; give the path of a YAML or JSON mixture file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot read the mixture file ({error}); give a readable UTF-8 YAML file") from None
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or type(error).__name__
        raise ConfigError(f"{path}: not valid YAML{where} ({problem}); fix the mixture file") from None
    if not isinstance(values, dict):
        raise ConfigError(
            f"{path}: holds a {type(values).__name__}, expected a mapping with 'sources' (and 'tokens'); "
            "see docs/mixtures.md for the format"
        )
    try:
        mixture = Mixture.from_dict(values)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
    directory = path.parent
    return dataclasses.replace(mixture, sources=tuple(_resolved(source, directory) for source in mixture.sources))


def _resolved(source: MixtureSource, directory: Path) -> MixtureSource:
    """``source`` with each relative local path made relative to ``directory``."""
    paths = tuple(
        path if is_uri(path) or os.path.isabs(path) else os.path.normpath(os.path.join(directory, path))
        for path in source.paths
    )
    return dataclasses.replace(source, paths=paths)


@dataclasses.dataclass(frozen=True)
class SourceLengths:
    """Where one source's samples lie among the mixture's.

    Attributes:
        name: the source's name.
        offset: its first global sample index.
        num_samples: its rows.
        files: the files read, in sample order, with their row counts.
        fingerprint: `batchplan.formats.lengths.fingerprint_lengths` of its lengths (and
            loss tokens, when it has a column of them); None until computed
            (`MixtureLengths.fingerprinted`).
        has_loss_tokens: whether it has a column of loss tokens.
    """

    name: str
    offset: int
    num_samples: int
    files: tuple[tuple[str, int], ...]
    fingerprint: str | None
    has_loss_tokens: bool = False


@dataclasses.dataclass(frozen=True)
class MixtureLengths:
    """Token counts of every sample of a mixture, sources in the mixture's order.

    Attributes:
        lengths: uint16 when every length is below 2^16, else int32.
        loss_tokens: loss tokens per sample when any source has a loss-tokens column
            (others ``length - 1``, at least 0), else None.
        sources: each source's offset, rows, files and fingerprint.
    """

    lengths: NDArray[np.uint16] | NDArray[np.int32]
    loss_tokens: NDArray[np.uint16] | NDArray[np.int32] | None
    sources: tuple[SourceLengths, ...]

    @property
    def num_samples(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def offsets(self) -> NDArray[np.int64]:
        """``num_sources + 1`` bounds: source ``k`` is samples ``offsets[k]:offsets[k + 1]``."""
        starts = [source.offset for source in self.sources] + [self.num_samples]
        return np.asarray(starts, dtype=np.int64)

    def fingerprinted(self) -> MixtureLengths:
        """These lengths with every source's fingerprint computed (hashing releases the GIL:
        a build runs it beside sizing, which reads the same arrays)."""
        sources = []
        for source in self.sources:
            if source.fingerprint is None:
                part = slice(source.offset, source.offset + source.num_samples)
                loss = self.loss_tokens[part] if source.has_loss_tokens and self.loss_tokens is not None else None
                source = dataclasses.replace(source, fingerprint=fingerprint_lengths(self.lengths[part], loss))
            sources.append(source)
        return dataclasses.replace(self, sources=tuple(sources))

    def fingerprint(self) -> str:
        """SHA-256 (hex, 32 chars) of the sources' names, rows and fingerprints, in order."""
        if any(source.fingerprint is None for source in self.sources):
            raise ValueError("the sources' fingerprints are not computed yet: call `fingerprinted` first")
        rows = [[source.name, source.num_samples, source.fingerprint] for source in self.sources]
        return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()[:32]


def read_mixture_lengths(
    mixture: Mixture,
    *,
    length_column: str = "length",
    tokens_column: str = "input_ids",
    loss_tokens_column: str | None = None,
    fingerprints: bool = True,
) -> MixtureLengths:
    """Read every source's lengths (a source's own columns override these) and join them.
    Sources are read and fingerprinted side by side on the cores (`batchplan.config.num_threads`);
    an error names the first source, in the mixture's order, that has one. ``fingerprints``
    False: none is computed yet (`MixtureLengths.fingerprinted` computes them).

    Raises:
        DatasetError: naming the source: a missing path, a column missing, an unreadable
            file, a source with no samples whose weight (or epochs) is positive.
    """

    def read(source: MixtureSource) -> tuple[SampleLengths | None, str | None]:
        columns = {
            "length_column": source.length_column or length_column,
            "tokens_column": source.tokens_column or tokens_column,
            "loss_tokens_column": source.loss_tokens_column or loss_tokens_column,
        }
        part = _read_source(source, columns)
        if not fingerprints:
            return part, None
        return part, fingerprint_lengths(np.zeros(0, np.uint16)) if part is None else part.fingerprint()

    with ThreadPoolExecutor(max_workers=max(1, min(num_threads(), len(mixture.sources)))) as pool:
        read_parts = list(pool.map(read, mixture.sources))  # results (and errors) in order
    parts = [part for part, _ in read_parts]
    offset = 0
    described = []
    for source, (part, fingerprint) in zip(mixture.sources, read_parts):
        rows = 0 if part is None else part.num_samples
        files = () if part is None else part.files
        has_loss = part is not None and part.loss_tokens is not None
        described.append(SourceLengths(source.name, offset, rows, files, fingerprint, has_loss))
        offset += rows
    present = [part for part in parts if part is not None]
    lengths = np.concatenate([part.lengths for part in present])
    loss = None
    if any(part.loss_tokens is not None for part in present):
        loss = np.concatenate([_loss_of(part) for part in present])
    return MixtureLengths(lengths=lengths, loss_tokens=loss, sources=tuple(described))


def _read_source(source: MixtureSource, columns: dict[str, Any]) -> SampleLengths | None:
    """One source's lengths (``columns``: `read_lengths`' column keywords); None for a source with
    no rows that contributes nothing."""
    try:
        files = find_dataset_files(source.paths)
    except DatasetError as error:
        raise DatasetError(f"source {source.name!r}: {error}") from None
    try:
        return read_lengths(files, **columns)
    except DatasetError as error:
        if count_samples(files) != 0:
            raise DatasetError(f"source {source.name!r}: {error}") from None
    if _contributes(source):
        size = "weight" if source.weight is not None else "epochs"
        raise DatasetError(
            f"source {source.name!r}: has no samples but {size} {getattr(source, size):g}; give its "
            f"paths some rows, or set its {size} to 0"
        )
    return None


def _contributes(source: MixtureSource) -> bool:
    return bool(source.weight if source.weight is not None else source.epochs)


def _loss_of(part: SampleLengths) -> NDArray:
    """The source's loss tokens, or its default ``length - 1`` (at least 0)."""
    if part.loss_tokens is not None:
        return part.loss_tokens
    lengths = part.lengths
    return np.where(lengths > 0, lengths - lengths.dtype.type(1), lengths.dtype.type(0))
