"""Learning rate by tokens: warmup and decay measured in tokens, not steps.

When steps are sized by tokens (or micro-batches hold varying token counts), a
step-based schedule warms up and decays over an unpredictable amount of data.
The plan knows every step's tokens up front, so the schedule is exact: step ``k``
uses the factor at ``t_k = tokens_before_step[k] + step_tokens[k]``, the tokens
seen once step ``k`` is done. So the first step already has a non-zero learning
rate and the last step ends the decay exactly (with equal steps this is the usual
``(k + 1) / warmup_steps`` warmup). Reading the step table touches rank 0's rows
of each epoch, two int64 columns: ~16 bytes per step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Literal

import numpy as np
import torch
from numpy.typing import NDArray

from batchplan.errors import ConfigError, PlanFormatError
from batchplan.formats.opened_plan import OpenedPlan
from batchplan.formats.opening import open_plan

__all__ = ["DECAYS", "read_step_tokens", "token_lr_factor", "token_lr_lambda", "token_lr_scheduler"]

DECAYS = ("cosine", "linear", "constant")
PlanLike = str | os.PathLike | OpenedPlan


def read_step_tokens(plan: PlanLike | object) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """``(tokens_before_step, step_tokens)`` for every global step of the plan.

    Args:
        plan: a plan path (file or directory), an opened plan, or anything with a ``.plan``
            (a `PlanSampler`).
    """
    plan_file = _plan_file(plan)
    before, tokens = [], []
    for epoch in range(plan_file.num_epochs):
        rows = plan_file.rank_rows(epoch, 0)
        first = rows.numbers("micro") == 0  # one row per step on every rank
        before.append(rows.numbers("tokens_before_step")[first])
        tokens.append(rows.numbers("step_tokens")[first])
    before_all, tokens_all = np.concatenate(before), np.concatenate(tokens)
    if before_all.shape[0] != plan_file.num_steps:
        raise PlanFormatError(
            f"{plan_file.path}: found {before_all.shape[0]} steps but the metadata says "
            f"{plan_file.num_steps}; the file is corrupt, rebuild it"
        )
    return before_all, tokens_all


def token_lr_factor(
    tokens: float,
    *,
    warmup_tokens: int,
    total_tokens: int,
    decay: Literal["cosine", "linear", "constant"] = "cosine",
    min_lr_ratio: float = 0.0,
) -> float:
    """Learning-rate multiplier after ``tokens`` tokens: linear warmup, then decay.

    Warmup rises linearly from 0 to 1 over ``warmup_tokens``; decay goes from 1 to
    ``min_lr_ratio`` between ``warmup_tokens`` and ``total_tokens``, then stays.
    """
    if tokens < warmup_tokens:
        return tokens / warmup_tokens
    if decay == "constant":
        return 1.0
    progress = min(1.0, (tokens - warmup_tokens) / max(total_tokens - warmup_tokens, 1))
    if decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def token_lr_lambda(
    plan: PlanLike | object,
    *,
    warmup_tokens: int = 0,
    decay: Literal["cosine", "linear", "constant"] = "cosine",
    min_lr_ratio: float = 0.0,
    total_tokens: int | None = None,
) -> Callable[[int], float]:
    """A ``LambdaLR`` function: global step -> learning-rate multiplier, by tokens.

    Args:
        plan: a plan path (file or directory), an opened plan, or a `PlanSampler`.
        warmup_tokens: tokens of linear warmup.
        decay: ``"cosine"``, ``"linear"`` or ``"constant"`` after warmup.
        min_lr_ratio: multiplier at the end of the decay.
        total_tokens: where the decay ends; default: every token of the plan.

    Returns:
        ``f(step)``; steps past the plan's last (``LambdaLR`` asks for one after the
        final ``scheduler.step()``) get the last step's factor. A plain function,
        so ``LambdaLR.state_dict()`` stays small.
    """
    before, tokens = read_step_tokens(plan)
    seen = before + tokens  # shape (num_steps,): tokens done at the end of each step
    total = int(seen[-1]) if total_tokens is None else total_tokens
    _check_schedule(warmup_tokens, decay, min_lr_ratio, total)
    last = seen.shape[0] - 1
    first = int(_plan_file(plan).metadata.get("first_step", 0))  # a resharded plan starts later

    def lr_lambda(step: int) -> float:
        at = int(seen[min(max(step - first, 0), last)])
        return token_lr_factor(
            at, warmup_tokens=warmup_tokens, total_tokens=total, decay=decay, min_lr_ratio=min_lr_ratio
        )

    return lr_lambda


def token_lr_scheduler(
    optimizer: torch.optim.Optimizer, plan: PlanLike | object, **options
) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR(optimizer, token_lr_lambda(plan, **options))``; call ``.step()`` after each optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, token_lr_lambda(plan, **options))


def _plan_file(plan: PlanLike | object) -> OpenedPlan:
    if isinstance(plan, OpenedPlan):
        return plan
    inner = getattr(plan, "plan", None)
    if isinstance(inner, OpenedPlan):
        return inner
    if isinstance(plan, (str, os.PathLike)):
        return open_plan(plan)
    raise ConfigError(f"plan must be a plan path, an opened plan or a PlanSampler, got {type(plan).__name__}")


def _check_schedule(warmup_tokens: int, decay: str, min_lr_ratio: float, total_tokens: int) -> None:
    if isinstance(warmup_tokens, bool) or not isinstance(warmup_tokens, int) or warmup_tokens < 0:
        raise ConfigError(f"warmup_tokens must be an integer >= 0, got {warmup_tokens!r}")
    if decay not in DECAYS:
        raise ConfigError(f"decay must be one of {', '.join(DECAYS)}; got {decay!r}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ConfigError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}")
    if total_tokens < 1:
        raise ConfigError(f"total_tokens must be >= 1, got {total_tokens!r}")
