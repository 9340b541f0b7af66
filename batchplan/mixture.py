"""A mixture: several named sources planned as one run, each with a weight or its own epochs.

Two ways to size the sources, one per mixture:

- ``tokens`` (the run's total tokens) with a ``weight`` per source: source ``s`` gets
  ``weight_s / sum(weights) x tokens`` tokens (weights need not sum to 1; a weight of 0
  contributes nothing);
- no ``tokens``, an ``epochs`` per source (2.5 = two passes and half of a third): the shares
  follow from the sizes.

Weights may change during the run (``tokens`` only): each of ``phases`` gives every source
a weight from the first step whose tokens before it reach the phase's ``from_tokens`` on;
the sources' own weights hold before the first phase. A source's target is then its weight
of each phase over the phase's tokens, summed.

`Mixture`, `MixtureSource` and `MixturePhase` are frozen, keyword-only dataclasses that check themselves
(every error a one-line `ConfigError` naming the source and the key) and fingerprint
themselves (canonical JSON, SHA-256), like `batchplan.config.PlanConfig`. A mixture file is
read by `batchplan.formats.mixture_file.read_mixture`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from typing import Any

from batchplan.config import parse_count
from batchplan.errors import ConfigError

__all__ = ["MIXTURE_KEYS", "PHASE_KEYS", "SOURCE_KEYS", "Mixture", "MixturePhase", "MixtureSource"]

MIXTURE_KEYS = ("sources", "tokens", "phases")
PHASE_KEYS = ("from_tokens", "weights")
SOURCE_KEYS = ("name", "paths", "weight", "epochs", "length_column", "tokens_column", "loss_tokens_column")
_COLUMN_KEYS = ("length_column", "tokens_column", "loss_tokens_column")
# Names appear in plan metadata, reports and log keys: plain words only.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtureSource:
    """One named dataset of a mixture.

    Attributes:
        name: unique within the mixture: letters, digits, ``_``, ``-`` and ``.``, starting
            with a letter or digit. Sources are matched by name across re-plans.
        paths: what a single-dataset build takes: Parquet files or directories, one
            ``datasets`` folder, ``s3://`` or ``gs://`` URIs (a single string is one path).
        weight: share of the run's tokens (with the mixture's ``tokens``), >= 0.
        epochs: passes over the source (without ``tokens``), >= 0; may be fractional.
        length_column, tokens_column, loss_tokens_column: the source's own columns, or None
            for the build's.
    """

    name: str
    paths: tuple[str, ...]
    weight: float | None = None
    epochs: float | None = None
    length_column: str | None = None
    tokens_column: str | None = None
    loss_tokens_column: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigError(
                f"source name {self.name!r} is not a name; expected letters, digits, '_', '-' or '.', "
                "starting with a letter or digit (e.g. web, code-v2); rename the source"
            )
        object.__setattr__(self, "paths", self._checked_paths())
        for key in ("weight", "epochs"):
            value = getattr(self, key)
            if value is not None:
                object.__setattr__(self, key, _non_negative(self.name, key, value))
        for key in _COLUMN_KEYS:
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(
                    f"source {self.name!r}: {key} must be a column name, got {value!r}; fix it or leave it out"
                )

    def _checked_paths(self) -> tuple[str, ...]:
        paths = (self.paths,) if isinstance(self.paths, str) else self.paths
        if not isinstance(paths, (list, tuple)) or not paths:
            raise ConfigError(
                f"source {self.name!r}: paths must be a non-empty list of dataset paths, got {self.paths!r}; "
                "list its Parquet files or directories, a datasets folder, or s3:// / gs:// URIs"
            )
        for path in paths:
            if not isinstance(path, str) or not path.strip():
                raise ConfigError(f"source {self.name!r}: paths holds {path!r}; expected a path or URI string")
        return tuple(paths)

    def to_dict(self) -> dict[str, Any]:
        """The source as plain JSON-able values; keys left unset (None) are left out."""
        values = {"name": self.name, "paths": list(self.paths)}
        for key in SOURCE_KEYS[2:]:
            if getattr(self, key) is not None:
                values[key] = getattr(self, key)
        return values

    @classmethod
    def from_dict(cls, values: object, *, position: int = 0) -> MixtureSource:
        """A source from a mapping (a mixture file's entry); unknown keys are an error."""
        if not isinstance(values, dict):
            raise ConfigError(
                f"sources[{position}] is {type(values).__name__} {values!r}; expected a mapping with name, paths "
                "and weight or epochs"
            )
        label = repr(values["name"]) if isinstance(values.get("name"), str) else f"at position {position}"
        unknown = sorted(str(key) for key in values if key not in SOURCE_KEYS)
        if unknown:
            raise ConfigError(f"source {label}: unknown keys {unknown}; the known keys are {list(SOURCE_KEYS)}")
        for key in ("name", "paths"):
            if key not in values:
                raise ConfigError(f"source {label}: key {key!r} is missing; every source needs name and paths")
        return cls(**values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixturePhase:
    """Weights of every source from a point of the run on.

    Attributes:
        from_tokens: the phase begins with the first step whose tokens before it reach this
            many (>= 1; numbers or strings with a k/M/G/T suffix, as ``tokens``).
        weights: ``{source name: weight >= 0}``; a mixture checks that it names each of its
            sources once.
    """

    from_tokens: int
    weights: dict[str, float]

    def __post_init__(self) -> None:
        object.__setattr__(self, "from_tokens", parse_tokens(self.from_tokens, key="from_tokens"))
        if not isinstance(self.weights, dict) or not self.weights:
            raise ConfigError(
                f"phase from {self.from_tokens:,} tokens: weights must map each source's name to its weight, got "
                f"{self.weights!r}"
            )
        weights = {}
        for name, weight in self.weights.items():
            weights[str(name)] = _non_negative(
                str(name), f"weight in the phase from {self.from_tokens:,} tokens", weight
            )
        object.__setattr__(self, "weights", weights)

    def to_dict(self) -> dict[str, Any]:
        return {"from_tokens": self.from_tokens, "weights": dict(self.weights)}

    @classmethod
    def from_dict(cls, values: object, *, position: int = 0) -> MixturePhase:
        """A phase from a mapping (a mixture file's entry); unknown keys are an error."""
        if not isinstance(values, dict):
            raise ConfigError(
                f"phases[{position}] is {type(values).__name__} {values!r}; expected a mapping with from_tokens "
                "and weights"
            )
        unknown = sorted(str(key) for key in values if key not in PHASE_KEYS)
        if unknown:
            raise ConfigError(f"phases[{position}]: unknown keys {unknown}; the known keys are {list(PHASE_KEYS)}")
        for key in PHASE_KEYS:
            if key not in values:
                raise ConfigError(
                    f"phases[{position}]: key {key!r} is missing; every phase needs from_tokens and weights"
                )
        return cls(**values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mixture:
    """Sources in order (global sample indices follow it), sized by ``tokens`` or by each source's ``epochs``.

    Attributes:
        sources: the sources; source ``k``'s samples come after those of sources ``0..k-1``.
        tokens: the run's total tokens (with a ``weight`` per source), or None (each source
            has ``epochs``). Numbers (``2.0e9``) and strings with a k/M/G/T suffix (``"2G"``)
            are read as whole token counts.
        phases: weights that change during the run (`MixturePhase`, in increasing
            ``from_tokens``, each below ``tokens``); only with ``tokens``.
    """

    sources: tuple[MixtureSource, ...]
    tokens: int | None = None
    phases: tuple[MixturePhase, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.sources, (list, tuple)) or not self.sources:
            raise ConfigError(
                f"a mixture needs at least one source, got sources={self.sources!r}; list them under sources:"
            )
        object.__setattr__(self, "sources", tuple(self.sources))
        if self.tokens is not None:
            object.__setattr__(self, "tokens", parse_tokens(self.tokens))
        seen: set[str] = set()
        for source in self.sources:
            if not isinstance(source, MixtureSource):
                raise ConfigError(f"sources holds {source!r}; expected MixtureSource values")
            if source.name in seen:
                raise ConfigError(f"source {source.name!r} is named twice; every source needs its own name")
            seen.add(source.name)
        if self.tokens is None:
            self._check_sized_by("epochs", "weight", "without tokens")
        else:
            self._check_sized_by("weight", "epochs", f"with tokens ({self.tokens:,})")
        self._check_phases()

    def _check_phases(self) -> None:
        """Phases only with tokens, in increasing ``from_tokens`` below it, each naming every source once."""
        if not isinstance(self.phases, (list, tuple)) or any(not isinstance(p, MixturePhase) for p in self.phases):
            raise ConfigError(f"phases holds {self.phases!r}; expected a list of MixturePhase values")
        object.__setattr__(self, "phases", tuple(self.phases))
        if not self.phases:
            return
        if self.tokens is None:
            raise ConfigError(
                "phases change weights at token counts of the run, so they need the mixture's tokens; give the "
                "mixture tokens and each source a weight, or leave phases out"
            )
        before = 0
        for phase in self.phases:
            where = f"phase from {phase.from_tokens:,} tokens"
            if phase.from_tokens <= before or phase.from_tokens >= self.tokens:
                raise ConfigError(
                    f"{where}: from_tokens must lie between the previous phase's ({before:,}) and the run's "
                    f"tokens ({self.tokens:,}), exclusive; list phases in increasing from_tokens within the run"
                )
            before = phase.from_tokens
            unknown = sorted(set(phase.weights) - set(self.names))
            if unknown:
                raise ConfigError(
                    f"{where}: weights name unknown sources {unknown}; the sources are {list(self.names)}"
                )
            missing = [name for name in self.names if name not in phase.weights]
            if missing:
                raise ConfigError(
                    f"{where}: weights leave out sources {missing}; give every source a weight (0 leaves it out "
                    "of the phase)"
                )
            if not any(phase.weights.values()):
                raise ConfigError(
                    f"{where}: every weight is 0, so the phase plans nothing; give a source a weight above 0"
                )

    def _check_sized_by(self, key: str, other: str, mode: str) -> None:
        """Every source has ``key`` and none has ``other``; not every ``key`` is 0."""
        fix = "give the mixture tokens and each source a weight, or each source epochs and no tokens"
        for source in self.sources:
            if getattr(source, other) is not None:
                raise ConfigError(f"source {source.name!r}: {other} is given in a mixture {mode}; {fix}")
            if getattr(source, key) is None:
                raise ConfigError(f"source {source.name!r}: {key} is missing in a mixture {mode}; {fix}")
        if all(getattr(source, key) == 0 for source in self.sources):
            raise ConfigError(
                f"every source has {key} 0, so the mixture plans nothing; give at least one source {key} above 0"
            )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(source.name for source in self.sources)

    @property
    def by_epochs(self) -> bool:
        """Whether sources are sized by their own epochs (no ``tokens``)."""
        return self.tokens is None

    def phase_weights(self) -> tuple[list[int], list[list[float]]]:
        """``(from_tokens, weights)``: where each phase begins (0 for the sources' own weights,
        then ``phases``) and its weights normalised to sum to 1, in the sources' order; for a
        mixture with ``tokens`` (one sized by epochs has no weights)."""
        if self.by_epochs:
            raise ValueError("a mixture sized by epochs has no weights; its shares follow from the planned tokens")
        first = [source.weight or 0.0 for source in self.sources]
        rows = [first] + [[phase.weights[name] for name in self.names] for phase in self.phases]
        starts = [0] + [phase.from_tokens for phase in self.phases]
        return starts, [[weight / sum(row) for weight in row] for row in rows]

    def to_dict(self) -> dict[str, Any]:
        """The mixture as plain JSON-able values (what a plan stores)."""
        values: dict[str, Any] = {"sources": [source.to_dict() for source in self.sources]}
        if self.tokens is not None:
            values["tokens"] = self.tokens
        if self.phases:
            values["phases"] = [phase.to_dict() for phase in self.phases]
        return values

    @classmethod
    def from_dict(cls, values: object) -> Mixture:
        """Inverse of `to_dict`, and what a mixture file holds; unknown keys are an error."""
        if not isinstance(values, dict):
            raise ConfigError(f"a mixture is a mapping with keys {list(MIXTURE_KEYS)}, got {type(values).__name__}")
        unknown = sorted(str(key) for key in values if key not in MIXTURE_KEYS)
        if unknown:
            raise ConfigError(f"unknown mixture keys {unknown}; the known keys are {list(MIXTURE_KEYS)}")
        sources = values.get("sources")
        if not isinstance(sources, list) or not sources:
            raise ConfigError(
                f"a mixture needs a non-empty list under sources, got {sources!r}; list each source's name, "
                "paths and weight or epochs"
            )
        phases = values.get("phases", [])
        if not isinstance(phases, list):
            raise ConfigError(
                f"phases must be a list of phases (each from_tokens and weights), got {type(phases).__name__}"
            )
        return cls(
            sources=tuple(MixtureSource.from_dict(entry, position=index) for index, entry in enumerate(sources)),
            tokens=values.get("tokens"),
            phases=tuple(MixturePhase.from_dict(entry, position=index) for index, entry in enumerate(phases)),
        )

    def fingerprint(self) -> str:
        """SHA-256 (hex, 16 chars) of the canonical JSON of `to_dict`."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def parse_tokens(value: object, *, key: str = "tokens") -> int:
    """A token count: an integer, a whole float (``2.0e9``), or a string of either or with a
    k/M/G/T suffix (``"2G"``, ``"2_000M"``); at least 1."""
    count: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        count = value
    elif isinstance(value, float) and math.isfinite(value) and value == int(value):
        count = int(value)
    elif isinstance(value, str):
        try:
            count = parse_count(value)
        except ValueError:
            try:
                number = float(value)  # YAML 1.1 reads 2e9 (no dot) as a string
            except ValueError:
                number = math.nan
            count = int(number) if math.isfinite(number) and number == int(number) else None
    if count is None or count < 1:
        raise ConfigError(
            f'{key} must be a whole number of tokens >= 1 (e.g. 2000000000, 2.0e9, "2G" or "2_000M"), '
            f"got {value!r}; fix the mixture's {key}"
        )
    return count


def _non_negative(name: str, key: str, value: object) -> float:
    """A weight or epochs value: a finite number >= 0 (numeric strings such as YAML's ``1e-3`` too)."""
    number = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if not math.isfinite(number) or number < 0:
        raise ConfigError(f"source {name!r}: {key} must be a finite number >= 0, got {value!r}; fix its {key}")
    return number
