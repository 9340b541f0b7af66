"""`SourceLosses`: the token-mean loss of each source of a mixture, over all ranks, for logging.

Each micro-batch of a mixture's plan holds one source (``record.source``), so its summed
token loss is entirely that source's and its loss tokens are ``record.loss_tokens_by_source``.
`SourceLosses.add` keeps both per source on this rank (the sums stay on the loss's device:
no host sync per micro-batch); `SourceLosses.reduce` sums them over the ranks with one
``all_reduce`` of ``2 x num_sources`` float64 values and returns each source's mean over the
steps added since the last call. Every rank must call `reduce` at the same point (a
collective), e.g. at the end of every step or every N steps. With tensor or pipeline
parallelism, pass the data-parallel process group (``group=``): ranks that hold the same
micro-batches must not be summed twice.

The loss tokens summed over ranks are checked against the plan: over whole steps, they add
up to the steps' ``step_loss_tokens``, or a rank trained other micro-batches than planned
(`PlanMismatchError`).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from batchplan.errors import ConfigError, PlanMismatchError
from batchplan.formats.opened_plan import OpenedPlan
from batchplan.runtime.mixture import source_names
from batchplan.runtime.records import MicroBatch
from batchplan.runtime.sampler import PlanSampler

__all__ = ["SourceLoss", "SourceLosses"]


class SourceLoss(NamedTuple):
    """One source's loss over the steps reduced: the sum over its loss tokens, on all ranks."""

    loss_sum: float
    loss_tokens: int

    @property
    def mean(self) -> float:
        """The token-mean loss of the source (0.0 when it had no loss tokens)."""
        return self.loss_sum / self.loss_tokens if self.loss_tokens else 0.0


class SourceLosses:
    """Sums each source's token loss and loss tokens, then reduces them over the ranks.

    Args:
        plan: the mixture's plan (a path, an opened plan, or a `PlanSampler`); it gives
            the sources' names.
        device: where the sums live before the first `add` (default: the device of the
            first loss added; CPU when `reduce` comes first, which a NCCL group cannot reduce).
        group: the data-parallel process group to sum over (default: every rank of
            ``torch.distributed``; a run with one rank per plan rank needs no other).

    Raises:
        PlanMismatchError: the plan is not a mixture's.
    """

    # Since the last `reduce` (set by `_reset`): the first and last micro-batch added, and the
    # plan's loss tokens of the steps that ended.
    _first: MicroBatch | None
    _last: MicroBatch | None
    _planned: int

    def __init__(
        self, plan: OpenedPlan | PlanSampler | str | os.PathLike, *, device: Any = None, group: Any = None
    ) -> None:
        self.names = source_names(plan.plan if isinstance(plan, PlanSampler) else plan)
        self._device = device
        self._group = group
        self._sums: torch.Tensor | None = None
        self._reset()

    def add(self, loss_sum: torch.Tensor | float, record: MicroBatch) -> None:
        """Count one micro-batch: its summed token loss (`token_loss_sum`, before any scaling)
        under its source, and its loss tokens. An empty micro-batch counts nothing.

        Raises:
            ConfigError: the record is not of a mixture's plan, or names a source the plan lacks.
        """
        by_source = record.loss_tokens_by_source
        if by_source is None:
            raise ConfigError("this record has no source: SourceLosses needs the records of a mixture's plan")
        if isinstance(loss_sum, torch.Tensor):
            value = loss_sum.detach()
        else:
            value = torch.tensor(float(loss_sum), dtype=torch.float64)
        if self._sums is None:
            self._sums = torch.zeros(len(self.names), dtype=torch.float64, device=self._device or value.device)
        self._follow(record)
        for source, loss_tokens in by_source.items():
            if not 0 <= source < len(self.names):
                raise ConfigError(f"record of source {source}, but the plan has sources 0..{len(self.names) - 1}")
            self._sums[source] += value.to(self._sums.device, torch.float64)
            self._tokens[source] += loss_tokens

    def reduce(self) -> dict[str, SourceLoss]:
        """Each source's loss since the last call, summed over all ranks; then start again.

        A collective when ``torch.distributed`` is initialised: every rank calls it at the
        same point. Sources without loss tokens in that stretch are left out.

        Raises:
            PlanMismatchError: over whole steps, the ranks' loss tokens are not the plan's.
        """
        sums = self._sums
        if sums is None:
            sums = torch.zeros(len(self.names), dtype=torch.float64, device=self._device)
        both = torch.cat([sums, torch.tensor(self._tokens, dtype=torch.float64, device=sums.device)])
        reduced_over = 1
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self._group) > 1:
            dist.all_reduce(both, group=self._group)
            reduced_over = dist.get_world_size(self._group)
        values = both.tolist()
        num_sources = len(self.names)
        losses = {
            name: SourceLoss(values[i], round(values[num_sources + i]))
            for i, name in enumerate(self.names)
            if values[num_sources + i] > 0
        }
        self._check(sum(loss.loss_tokens for loss in losses.values()), reduced_over)
        self._reset()
        return losses

    def _follow(self, record: MicroBatch) -> None:
        """Note which steps were added, and whether whole (for the check in `reduce`)."""
        if self._first is None:
            self._first = record
        if record.is_last:
            self._planned += record.step_loss_tokens
        self._last = record

    def _check(self, loss_tokens: int, reduced_over: int) -> None:
        first, last = self._first, self._last
        if first is None or last is None:
            return
        whole = first.micro == 0 and last.is_last
        if not whole or reduced_over != last.world_size or loss_tokens == self._planned:
            return
        raise PlanMismatchError(
            f"the ranks' micro-batches of steps {first.step}..{last.step} hold {loss_tokens:,} loss tokens but the "
            f"plan counts {self._planned:,}: a rank trained other micro-batches than planned, or the ranks called "
            "SourceLosses.reduce at different steps"
        )

    def _reset(self) -> None:
        if self._sums is not None:
            self._sums.zero_()
        self._tokens = [0] * len(self.names)
        self._first = None
        self._last = None
        self._planned = 0
