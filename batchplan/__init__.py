"""batchplan: token-capped, rank-balanced, reproducible batch plans for LLM training.

```python
import batchplan

batchplan.build_plan_file("data.parquet", "plan.arrow", batchplan.PlanConfig(max_tokens=8192, world_size=8))
plan = batchplan.open_plan("plan.arrow")            # memory-mapped; plan.metadata, plan.read_rank(epoch, rank)
assert batchplan.validate_plan(plan, "data.parquet") == []
```

With lengths already in memory (a numpy array), plan and write in two calls. The
fingerprint (of ``lengths``, and of ``loss_tokens`` when the plan was built with them)
lets ``PlanSampler.check_dataset(dataset, lengths)`` tell these lengths from others later:

```python
plan = batchplan.build_plan(lengths, batchplan.PlanConfig(max_tokens=8192, world_size=8))
batchplan.write_plan(plan, "plan.arrow", lengths_fingerprint=batchplan.fingerprint_lengths(lengths))
```

Inside a training loop whose lengths exist only at run time (RL rollouts, dynamic
batching), ``batchplan.plan_batch(lengths, world_size, max_tokens)`` splits one batch into
each rank's micro-batches with the same guarantees (docs/online.md).

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
    from batchplan.formats.lengths import fingerprint_lengths, read_lengths
    from batchplan.formats.mixture_file import read_mixture
    from batchplan.formats.opened_plan import OpenedPlan
    from batchplan.formats.opening import open_plan
    from batchplan.formats.plan_directory import PlanDirectory
    from batchplan.formats.plan_file import PlanFile
    from batchplan.formats.plan_writer import write_plan
    from batchplan.mixture import Mixture, MixtureSource
    from batchplan.operations.build import build_plan_file
    from batchplan.operations.build_mixture import build_mixture_plan_file
    from batchplan.operations.reshard import reshard_plan_file
    from batchplan.operations.validate import Violation, validate_plan
    from batchplan.planning.batch import BatchPlan, plan_batch
    from batchplan.planning.epochs import build_plan

__version__ = "0.1.0"

# The top-level API, each name loaded from its module on first use.
_LAZY = {
    "BatchPlan": "batchplan.planning.batch",
    "Mixture": "batchplan.mixture",
    "MixtureSource": "batchplan.mixture",
    "OpenedPlan": "batchplan.formats.opened_plan",
    "PlanDirectory": "batchplan.formats.plan_directory",
    "PlanFile": "batchplan.formats.plan_file",
    "Violation": "batchplan.operations.validate",
    "build_mixture_plan_file": "batchplan.operations.build_mixture",
    "build_plan": "batchplan.planning.epochs",
    "build_plan_file": "batchplan.operations.build",
    "fingerprint_lengths": "batchplan.formats.lengths",
    "open_plan": "batchplan.formats.opening",
    "plan_batch": "batchplan.planning.batch",
    "read_lengths": "batchplan.formats.lengths",
    "read_mixture": "batchplan.formats.mixture_file",
    "reshard_plan_file": "batchplan.operations.reshard",
    "validate_plan": "batchplan.operations.validate",
    "write_plan": "batchplan.formats.plan_writer",
}

__all__ = [
    "BatchPlan",
    "BatchPlanError",
    "ConfigError",
    "DatasetError",
    "Mixture",
    "MixtureSource",
    "OpenedPlan",
    "PlanConfig",
    "PlanDirectory",
    "PlanFile",
    "PlanFormatError",
    "PlanMismatchError",
    "Violation",
    "__version__",
    "build_mixture_plan_file",
    "build_plan",
    "build_plan_file",
    "fingerprint_lengths",
    "open_plan",
    "plan_batch",
    "read_lengths",
    "read_mixture",
    "reshard_plan_file",
    "validate_plan",
    "write_plan",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'batchplan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
