"""Step 3 of an epoch (`batchplan.planning.epochs`): the scheduled micro-batches, each with
what the later stages need of it, gathered once in schedule order while rounds of similar
cost are formed (`batchplan.kernels.assemble.take_scheduled`)."""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig
from batchplan.kernels.assemble import take_scheduled
from batchplan.plan import index_dtype
from batchplan.planning.buffers import new_buffer
from batchplan.planning.epoch_batches import EpochBatches
from batchplan.planning.randomness import STREAM_ROUND_ORDER, epoch_rng
from batchplan.planning.threads import run_in_parts

__all__ = ["Scheduled"]


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """Micro-batches in schedule order, each with what the later stages need of it."""

    batch: NDArray[np.integer]  # micro-batch id (int32 when ids, tokens and entries fit, as the next two)
    tokens: NDArray[np.integer]
    sizes: NDArray[np.integer]  # entries
    compute: NDArray[np.float64] | None  # predicted compute, with a cost coefficient
    by_compute: bool  # balance ranks by compute, else by tokens

    @classmethod
    def take(
        cls,
        schedule,
        batches: EpochBatches,
        compute,
        config: PlanConfig,
        begin: int,
        end: int,
        epoch: int,
        threads: int,
    ) -> Scheduled:
        """What each micro-batch of ``schedule`` needs, gathered once, with step 3 of the
        module docstring applied to positions ``begin:end`` (whole rounds): rounds of
        ``world_size`` micro-batches of similar cost within windows of ``balance_window``
        rounds, the rounds shuffled; ``balance_window`` 1 keeps the (already random) order,
        and LPT balances inside each step."""
        by_compute = config.balance == "compute"
        values = np.zeros(0, dtype=np.float64) if compute is None else compute
        window = 0 if config.balance_window == 1 else config.balance_window * config.world_size
        num_rounds = (end - begin) // config.world_size if window else 0
        round_order = epoch_rng(config.seed, epoch, STREAM_ROUND_ORDER).permutation(num_rounds)
        table = batches.token_table()
        # Ids, tokens and entries: int32 when they fit (half the memory at the planner's peak).
        most = max(batches.count, int(table.max(initial=0)))
        out = new_buffer((3, schedule.shape[0]), index_dtype(most + 1))
        out_values = np.empty(schedule.shape[0] if compute is not None else 0, dtype=np.float64)
        run_in_parts(
            take_scheduled,
            threads,
            schedule,
            begin,
            end,
            window,
            round_order,
            config.world_size,
            table,
            values,
            by_compute,
            config.max_tokens,
            out,
            out_values,
        )
        return cls(out[0], out[1], out[2], None if compute is None else out_values, by_compute)

    @property
    def costs(self) -> NDArray:
        """What ranks are balanced by (integer tokens sort and add up as their float values)."""
        if self.by_compute:
            assert self.compute is not None  # balance="compute" needs the cost model (PlanConfig checks it)
            return self.compute
        return self.tokens

    def head(self, count: int) -> Scheduled:
        """The first ``count`` positions."""
        compute = None if self.compute is None else self.compute[:count]
        return Scheduled(self.batch[:count], self.tokens[:count], self.sizes[:count], compute, self.by_compute)
