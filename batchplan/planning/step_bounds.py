"""Step boundaries: a fixed number of rounds per step, the rounds that bring a step
closest to a token target, or a target that grows with a ramp-up."""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig
from batchplan.kernels.steps import ramp_steps, ramp_target, steps_by_tokens
from batchplan.planning.epoch_batches import EpochBatches

__all__ = ["StepSizing", "cut_steps"]


@dataclasses.dataclass(frozen=True)
class StepSizing:
    """What a ramp-up needs to size an epoch's steps."""

    tokens_before: int  # tokens of the run before the epoch
    full_step: float  # tokens per step once the ramp is over (0.0 without a ramp)

    @classmethod
    def of(cls, config: PlanConfig, tokens_before: int, batches: EpochBatches) -> StepSizing:
        """The target is ``tokens_per_step``; with ``micro_batches`` M, the mean tokens of a
        step of M micro-batches per rank, from the micro-batches as formed (before the last
        round is completed or dropped, so the drop decision sees the same steps)."""
        full = 0.0
        if config.has_rampup:
            if config.tokens_per_step is not None:
                full = float(config.tokens_per_step)
            else:
                per_step = config.micro_batches_per_step
                assert per_step is not None  # steps are sized by micro-batches when not by tokens
                mean = float(batches.tokens().sum()) / max(batches.count, 1)
                full = mean * config.world_size * per_step
        return cls(int(tokens_before), full)

    def target(self, config: PlanConfig, done: int) -> float:
        """Tokens wanted for a step that begins after ``done`` tokens of the run (under a ramp-up)."""
        start, ramp_tokens = config.rampup_start, config.rampup_tokens
        assert start is not None and ramp_tokens is not None  # the config has a ramp-up
        return float(ramp_target(done, float(start), self.full_step, ramp_tokens))


def cut_steps(tokens: NDArray[np.integer], config: PlanConfig, sizing: StepSizing) -> NDArray[np.int64]:
    """Step boundaries over the (shuffled) micro-batches; each step a whole number of rounds."""
    world_size = config.world_size
    num_rounds = tokens.shape[0] // world_size
    per_step = config.micro_batches_per_step
    if per_step is not None and not config.has_rampup:
        round_offsets = np.append(np.arange(0, num_rounds, per_step), num_rounds)
        if num_rounds == 0:
            round_offsets = np.zeros(1, dtype=np.int64)
    else:
        # shape (num_rounds, world_size): one micro-batch per rank in each round
        round_tokens = tokens.reshape(num_rounds, world_size).sum(axis=1)
        start, ramp_tokens = config.rampup_start, config.rampup_tokens
        if start is not None and ramp_tokens is not None:  # a ramp-up (`has_rampup`)
            round_offsets = ramp_steps(
                round_tokens,
                sizing.tokens_before,
                float(start),
                sizing.full_step,
                ramp_tokens,
                per_step or 0,
            )
        else:
            round_offsets = steps_by_tokens(round_tokens, config.tokens_per_step)
    return round_offsets.astype(np.int64) * world_size
