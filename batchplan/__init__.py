"""batchplan: token-capped, rank-balanced, reproducible batch plans for LLM training.

```python
import batchplan

batchplan.build_plan_file("data.parquet", "plan.arrow", batchplan.PlanConfig(max_tokens=8192, world_size=8))
plan = batchplan.open_plan("plan.arrow")            # memory-mapped; plan.metadata, plan.read_rank(epoch, rank)
assert batchplan.validate_plan(plan, "data.parquet") == []
```

Training replays a plan with `batchplan.runtime` (``PlanSampler``, collators). Importing
this package is light (no numba, torch or typer): the functions above load their
modules when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from batchplan.config import PlanConfig
from batchplan.errors import (
    BatchPlanError,
    ConfigError,
    DatasetError,
    PlanFormatError,
    PlanMismatchError,
)

if TYPE_CHECKING:
    from batchplan.formats.lengths import read_lengths
    from batchplan.formats.plan_file import OpenedPlan, PlanFile
    from batchplan.formats.opening import open_plan
    from batchplan.operations.build import build_plan_file
    from batchplan.operations.reshard import reshard_plan_file
    from batchplan.operations.validate import Violation, validate_plan

__version__ = "0.1.0"

# The top-level API, each name loaded from its module on first use.
_LAZY = {
    "OpenedPlan": "batchplan.formats.plan_file",
    "PlanFile": "batchplan.formats.plan_file",
    "Violation": "batchplan.operations.validate",
    "build_plan_file": "batchplan.operations.build",
    "open_plan": "batchplan.formats.opening",
    "read_lengths": "batchplan.formats.lengths",
    "reshard_plan_file": "batchplan.operations.reshard",
    "validate_plan": "batchplan.operations.validate",
}

__all__ = [
    "BatchPlanError",
    "ConfigError",
    "DatasetError",
    "OpenedPlan",
    "PlanConfig",
    "PlanFile",
    "PlanFormatError",
    "PlanMismatchError",
    "Violation",
    "__version__",
    "build_plan_file",
    "open_plan",
    "read_lengths",
    "reshard_plan_file",
    "validate_plan",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'batchplan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
