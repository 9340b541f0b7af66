"""Where a sampler's rank and world size come from, and the check against the plan.

Order: explicit arguments, then an initialised ``torch.distributed`` process group,
then the ``RANK`` / ``WORLD_SIZE`` environment variables (set by ``torchrun``),
then a single process (rank 0 of 1). The source is kept for error messages.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from batchplan.errors import ConfigError, PlanMismatchError

__all__ = ["Placement", "check_world_size", "resolve_placement"]


class Placement(NamedTuple):
    """This process's data-parallel position and where it was read from."""

    rank: int
    world_size: int
    source: str


def resolve_placement(rank: int | None = None, world_size: int | None = None) -> Placement:
    """Fill a missing ``rank``/``world_size`` from torch.distributed, then the environment.

    Raises:
        ConfigError: a value is not an integer, or ``rank`` is outside ``0..world_size-1``.
    """
    source = "arguments"
    if rank is None or world_size is None:
        found = _from_torch_distributed() or _from_environment()
        if found is None:
            found = Placement(0, 1, "default (no torch.distributed, no RANK/WORLD_SIZE)")
        rank = found.rank if rank is None else rank
        world_size = found.world_size if world_size is None else world_size
        source = found.source
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an integer, got {value!r} (from {source})")
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size} (from {source})")
    if not 0 <= rank < world_size:
        raise ConfigError(
            f"rank must be in 0..{world_size - 1} for world_size {world_size}, got {rank} (from {source})"
        )
    return Placement(rank, world_size, source)


def check_world_size(placement: Placement, plan_world_size: int, path: object) -> None:
    """Raise `PlanMismatchError` unless the run's world size is the plan's."""
    if placement.world_size != plan_world_size:
        world_size = placement.world_size
        raise PlanMismatchError(
            f"{path}: the plan was built for world_size {plan_world_size} but this run has "
            f"world_size {world_size} (from {placement.source}); launch {plan_world_size} ranks, or "
            f"rebuild the plan with `world_size={world_size}`, or, to resume a checkpoint on {world_size} "
            f"ranks, re-plan the steps left with `batchplan.reshard_plan_file({str(path)!r}, 'NEW.arrow', "
            f"world_size={world_size}, from_step=STEP)` (STEP: optimizer steps done at the checkpoint; "
            "the command `batchplan reshard` does the same)"
        )


def _from_torch_distributed() -> Placement | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return Placement(dist.get_rank(), dist.get_world_size(), "torch.distributed")
    return None


def _from_environment() -> Placement | None:
    raw_rank, raw_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if raw_rank is None and raw_world is None:
        return None
    if raw_rank is None or raw_world is None:
        missing = "RANK" if raw_rank is None else "WORLD_SIZE"
        raise ConfigError(f"{missing} is not set but the other one is; set both or pass rank= and world_size=")
    try:
        return Placement(int(raw_rank), int(raw_world), "RANK/WORLD_SIZE environment")
    except ValueError as error:
        raise ConfigError(
            f"RANK={raw_rank!r} / WORLD_SIZE={raw_world!r} are not integers; fix the environment "
            "or pass rank= and world_size="
        ) from error
