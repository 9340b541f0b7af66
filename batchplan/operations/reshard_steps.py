"""The step size of a resharded plan (`batchplan.operations.reshard`): how many micro-batches
per rank, or which token target, ``W2`` ranks get.

Explicit ``micro_batches`` or ``tokens_per_step``; by default as close to
the parent's global step as ``W2`` ranks allow. A token target is kept (it does not
depend on ranks; ``M2 = 1`` if one micro-batch per rank already exceeds it). ``M``
micro-batches per rank become ``M2 = max(1, round(W * M / W2))``: the same global
step when ``W2`` divides ``W * M``, else the nearest whole number of micro-batches per
rank (4 ranks x 1 -> 3 ranks x 1 is 25 % fewer tokens per step). A token target equal
to the parent's mean step would not do better: a step is a whole number of rounds of
``W2`` micro-batches, and the target picks that same nearest number, only with more
variation between steps.

A mixture's plan keeps its parent's steps: its config records the parent's token target, or
``ceil(W * M / W2)`` micro-batches per rank, and a size cannot be chosen.
"""

from __future__ import annotations

from batchplan.errors import ConfigError, PlanFormatError
from batchplan.formats.opened_plan import OpenedPlan

__all__ = ["default_step_sizing", "step_sizing"]


def step_sizing(
    plan: OpenedPlan, world_size: int, micro_batches: int | None, tokens_per_step: int | None
) -> dict[str, int | None]:
    """``{"micro_batches": M2, "tokens_per_step": T2}`` for ``world_size`` ranks: the sizes asked
    for, or by default `default_step_sizing`; a mixture's plan's own (`_mixture_step_sizing`)."""
    asked = {"micro_batches": micro_batches, "tokens_per_step": tokens_per_step}
    if plan.metadata.get("mixture") is not None:
        return _mixture_step_sizing(plan, world_size, asked)
    if micro_batches is None and tokens_per_step is None:
        return default_step_sizing(plan, world_size)
    return asked


def default_step_sizing(plan: OpenedPlan, world_size: int) -> dict[str, int | None]:
    """``{"micro_batches": M2, "tokens_per_step": T2}`` (one of them None) that keeps the
    parent's global step for ``world_size`` ranks (rules in the module docstring)."""
    config = plan.metadata["config"]
    smallest = world_size * int(config["max_tokens"])  # one micro-batch per rank
    if config.get("tokens_per_step") is not None:
        target = int(config["tokens_per_step"])
        return {"micro_batches": None, "tokens_per_step": target} if target >= smallest else _fixed(1)
    count = plan.world_size * int(config.get("micro_batches") or 1)
    return _fixed(max(1, (2 * count + world_size) // (2 * world_size)))  # round half up


def _fixed(per_rank: int) -> dict[str, int | None]:
    return {"micro_batches": per_rank, "tokens_per_step": None}


def _mixture_step_sizing(plan: OpenedPlan, world_size: int, asked: dict[str, int | None]) -> dict[str, int | None]:
    """The config's step size for a mixture's plan, whose steps stay the parent's: its token
    target (as `default_step_sizing`), or ``ceil(W * M / world_size)`` micro-batches per rank.
    Refuses a size ``asked`` for, and a mixture's plan without its ``source`` column."""
    if asked["micro_batches"] is not None or asked["tokens_per_step"] is not None:
        raise ConfigError(
            f"{plan.path} is a mixture's plan, which keeps its steps (each holds the sources' shares) when resharded; "
            "leave `micro_batches` and `tokens_per_step` out"
        )
    if "source" not in plan.schema.names:
        raise PlanFormatError(f"{plan.path}: a mixture's plan without its `source` column; rebuild it")
    config = plan.metadata["config"]
    if config.get("tokens_per_step") is not None:
        return default_step_sizing(plan, world_size)
    count = plan.world_size * int(config.get("micro_batches") or 1)
    return _fixed(-(-count // world_size))
