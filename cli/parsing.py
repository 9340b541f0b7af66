"""The CLI's ``A:B`` option values as the library's numbers.

``--rampup START:TOKENS`` and ``--seqlen-warmup MIN:TOKENS`` become two `PlanConfig` fields;
``--only-epochs START:STOP`` becomes the ``range`` that `build_plan_file` takes. Integers may
use ``_`` separators and a ``k``/``M``/``G``/``T`` suffix (`batchplan.config.parse_count`).
"""

from __future__ import annotations

from batchplan.config import parse_count
from batchplan.errors import ConfigError

__all__ = ["parse_epoch_range", "parse_pair"]


def parse_pair(flag: str, form: str, text: str | None) -> tuple[int, int] | tuple[None, None]:
    """``"A:B"`` -> ``(A, B)`` for an option such as ``--rampup START:TOKENS``; None -> (None, None)."""
    if text is None:
        return None, None
    parts = text.split(":")
    try:
        if len(parts) != 2:
            raise ValueError(text)
        return parse_count(parts[0]), parse_count(parts[1])
    except ValueError:
        raise ConfigError(f"{flag} takes {form} (two integers, e.g. 262144:100M), got {text!r}") from None


def parse_epoch_range(text: str | None, epochs: int) -> range | None:
    """``--only-epochs``: ``"START:STOP"`` (STOP excluded; either may be left out) or ``"E"``
    -> a range of epochs; None -> None."""
    if text is None:
        return None
    parts = text.split(":")
    try:
        if len(parts) == 1:
            start = parse_count(parts[0])
            return range(start, start + 1)
        if len(parts) != 2:
            raise ValueError(text)
        start = parse_count(parts[0]) if parts[0].strip() else 0
        return range(start, parse_count(parts[1]) if parts[1].strip() else epochs)
    except ValueError:
        raise ConfigError(f"--only-epochs takes START:STOP or EPOCH (0:4 = epochs 0 to 3), got {text!r}") from None
