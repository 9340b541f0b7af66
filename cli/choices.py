"""The enumerated options of the `batchplan` command, as Typer choices.

Each is a ``str`` enum built from the library's tuple of allowed values, so ``--help``
lists them and a wrong value is refused before any work; the commands pass ``.value``
on, and the library (`PlanConfig`) keeps taking plain strings.
"""

from __future__ import annotations

import enum

from batchplan.config import BALANCE_MODES, LAYOUTS, MODES, OVERSIZE_POLICIES

__all__ = ["Balance", "Layout", "Mode", "Oversize"]


def _choices(name: str, values: tuple[str, ...]) -> type[enum.Enum]:
    return enum.Enum(name, {value: value for value in values}, type=str, module=__name__)


Mode = _choices("Mode", MODES)
Oversize = _choices("Oversize", OVERSIZE_POLICIES)
Balance = _choices("Balance", BALANCE_MODES)
Layout = _choices("Layout", LAYOUTS)
