"""One exception family: every error batchplan raises on purpose is a `BatchPlanError`.

Messages say what was expected, what was found, and how to fix it, so the CLI can
print them as one line and exit 1.
"""

from __future__ import annotations

__all__ = [
    "BatchPlanError",
    "ConfigError",
    "DatasetError",
    "PlanFormatError",
    "PlanMismatchError",
    "one_line",
]


class BatchPlanError(Exception):
    """Base class of every error batchplan raises deliberately."""


class ConfigError(BatchPlanError, ValueError):
    """An option is out of range or options contradict each other."""


class DatasetError(BatchPlanError):
    """The dataset cannot be read or its lengths break a rule (nulls, oversize, ...)."""


class PlanFormatError(BatchPlanError):
    """A plan file is unreadable, corrupt, or of an unsupported format version."""


class PlanMismatchError(BatchPlanError):
    """A plan is used with a dataset, rank or world size it was not built for."""


def one_line(error: BaseException) -> str:
    """A library's error text as one line (pyarrow's messages may span lines of C++ context),
    to be quoted inside one of ours."""
    return " ".join(str(error).split())
