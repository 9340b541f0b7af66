"""batchplan: token-capped, rank-balanced, reproducible batch plans for LLM training.

Importing this package is light (no numba, torch or typer); heavy modules are
imported where they are used.
"""

from batchplan.config import PlanConfig
from batchplan.errors import (
    BatchPlanError,
    ConfigError,
    DatasetError,
    PlanFormatError,
    PlanMismatchError,
)

__version__ = "0.1.0"

__all__ = [
    "BatchPlanError",
    "ConfigError",
    "DatasetError",
    "PlanConfig",
    "PlanFormatError",
    "PlanMismatchError",
    "__version__",
]
