"""Accelerate custom loops: device placement for a plan loader, without re-sharding it.

``accelerator.prepare(loader)`` wraps a batch sampler in ``BatchSamplerShard``, which
hands each rank every ``num_processes``-th of *its own* planned micro-batches; a
`PlanSampler` refuses that (reading its ``batch_size`` raises). Use instead::

    loader = prepare_plan_loader(accelerator, DataLoader(PlanDataset(ds), batch_sampler=sampler,
                                                         collate_fn=PackCollator()))
    accelerator.register_for_checkpointing(loader)   # save_state/load_state resume exactly

`PreparedPlanLoader` yields the loader's batches on ``accelerator.device`` (each
`PlanBatch` keeps its record), checks that they arrive in plan order, and its
``state_dict`` is taken right after the last batch it yielded, whatever the
loader's workers prefetched.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from batchplan.errors import ConfigError
from batchplan.integrations import require

accelerate_utils = require("accelerate.utils")

from batchplan.runtime import PlanBatch, PlanSampler  # noqa: E402
from batchplan.runtime.batch import record_of  # noqa: E402
from batchplan.runtime.plan_steps import check_follows  # noqa: E402
from batchplan.runtime.records import MicroBatch  # noqa: E402

__all__ = ["PreparedPlanLoader", "prepare_plan_loader"]


def prepare_plan_loader(accelerator: Any, loader: Any) -> PreparedPlanLoader:
    """The plan loader with Accelerate's device placement and no re-sharding.

    Args:
        accelerator: the run's ``accelerate.Accelerator``.
        loader: a ``DataLoader`` whose ``batch_sampler`` is a `PlanSampler`.

    Raises:
        ConfigError: the loader's batch sampler is not a `PlanSampler`.
    """
    sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(sampler, PlanSampler):
        raise ConfigError(
            f"prepare_plan_loader needs a DataLoader with batch_sampler=PlanSampler(...), got batch sampler "
            f"{type(sampler).__name__}; use accelerator.prepare for other loaders"
        )
    device = accelerator.device if accelerator.device_placement else None
    return PreparedPlanLoader(loader, sampler, device, non_blocking=accelerator.non_blocking)


class PreparedPlanLoader:
    """Iterates a plan loader on a device, in plan order, and checkpoints exactly.

    Attributes:
        loader: the wrapped ``DataLoader``.
        sampler: its `PlanSampler`.
    """

    def __init__(self, loader: Any, sampler: PlanSampler, device: Any = None, *, non_blocking: bool = False) -> None:
        self.loader = loader
        self.sampler = sampler
        self.device = device
        self.non_blocking = non_blocking
        self._last: MicroBatch | None = None  # the record of the last batch yielded

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[PlanBatch]:
        previous = None
        for batch in self.loader:
            record = record_of(batch)
            check_follows(previous, record)
            previous = record
            if self.device is not None:
                batch = accelerate_utils.send_to_device(batch, self.device, non_blocking=self.non_blocking)
            self._last = record
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Every rank's sampler state right after the last batch it yielded (exact under prefetching).

        ``accelerator.save_state`` calls this on every rank but writes rank 0's result
        only, so the ranks' states are gathered into it (a collective: every rank calls it).
        """
        own = self.sampler.state_dict(after=self._last) if self._last is not None else self.sampler.state_dict()
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return {"ranks": [own]}
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, own)
        return {"ranks": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume this rank's sampler from its entry of a `state_dict` (checked strictly)."""
        ranks = state.get("ranks") if isinstance(state, dict) else None
        if not isinstance(ranks, list) or len(ranks) != self.sampler.world_size:
            found = len(ranks) if isinstance(ranks, list) else type(state).__name__
            raise ConfigError(
                f"expected the state of a PreparedPlanLoader with {self.sampler.world_size} ranks' states, "
                f"found {found}; resume with the world size the run started with (or reshard the plan)"
            )
        self.sampler.load_state_dict(ranks[self.sampler.rank])
        self._last = None
