"""The enumerated options of the `batchplan` command, as Typer choices.

Each is a ``str`` enum of the library's allowed values (`batchplan.config`: ``MODES``,
``OVERSIZE_POLICIES``, ``BALANCE_MODES``, ``LAYOUTS``; a test holds them equal), so ``--help``
lists them and a wrong value is refused before any work; the commands pass ``.value`` on, and
the library (`PlanConfig`) keeps taking plain strings. They are written out as classes so that
the type checker sees their members, named in capitals (``Oversize.split`` would hide ``str.split``).
"""

from __future__ import annotations

import enum

__all__ = ["Balance", "Layout", "Mode", "Oversize"]


class Mode(str, enum.Enum):
    PACK = "pack"
    PAD = "pad"


class Oversize(str, enum.Enum):
    ERROR = "error"
    DROP = "drop"
    TRUNCATE = "truncate"
    SPLIT = "split"


class Balance(str, enum.Enum):
    TOKENS = "tokens"
    COMPUTE = "compute"


class Layout(str, enum.Enum):
    FILE = "file"
    DIRECTORY = "directory"
