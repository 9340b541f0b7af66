"""Adapters for the training stacks people already use; each proven exact against the plain loop.

- `batchplan.integrations.transformers`: `PlanTrainer` / `PlanTrainerMixin` (Hugging Face
  ``Trainer``, TRL's ``SFTTrainer``).
- `batchplan.integrations.lightning`: `PlanDataModule`, `plan_loss`, `plan_backward` (Lightning).
- `batchplan.integrations.accelerate`: `prepare_plan_loader` (Accelerate custom loops).

Each module imports its library when it is imported, and says how to install it when
it is missing; ``import batchplan.runtime`` imports none of them. See docs/integrations.md.
"""

from __future__ import annotations

import importlib

from batchplan.errors import ConfigError

__all__ = ["require"]


def require(module: str, extra: str = "integrations"):
    """Import ``module`` or raise a `ConfigError` that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = module.split(".")[0]
        raise ConfigError(
            f"this batchplan integration needs {package!r}, which is not installed ({error}); "
            f"from the batchplan checkout, pip install -e '.[{extra}]' torch==2.13.0 (or pip install {package})"
        ) from error
