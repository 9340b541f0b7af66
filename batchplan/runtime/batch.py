"""`PlanBatch`: a collated micro-batch (a ``dict``) that carries its plan record.

``model(**batch)`` works as with any dict of tensors, and ``batch.record`` is the
`MicroBatch` it was planned as (step, micro, is_last, step_loss_tokens, ...), so
``for batch in loader`` is the whole training loop. The record survives every path
a batch takes to the training step:

- ``DataLoader`` workers: pickled with the batch (`__reduce__`);
- ``pin_memory=True``: torch calls `PlanBatch.pin_memory`;
- device placement by Accelerate (``send_to_device``) and Lightning
  (``move_data_to_device``): both call `PlanBatch.to`;
- ``copy.copy``: keeps the record.

A path that rebuilds the mapping as ``type(batch)({...})`` (Hugging Face
``Trainer._prepare_input``) loses it; reading ``batch.record`` then raises
instead of returning nothing (`batchplan.integrations.transformers` reads the
record before that step).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from batchplan.errors import ConfigError
from batchplan.runtime.records import MicroBatch

__all__ = ["PlanBatch", "record_of"]


class PlanBatch(dict):
    """A dict of model inputs with the `MicroBatch` record of the micro-batch it holds.

    Args:
        data: the model inputs (``input_ids``, ``labels``, ...).
        record: the micro-batch's plan record, or None when the collator was given
            items that carry none (a dataset not wrapped in `PlanDataset`).
    """

    def __init__(
        self, data: Mapping[str, Any] | Iterable[tuple[str, Any]] = (), record: MicroBatch | None = None
    ) -> None:
        super().__init__(data)
        self._record = record

    @property
    def record(self) -> MicroBatch:
        """The plan record of this micro-batch.

        Raises:
            ConfigError: the batch was collated without one.
        """
        if self._record is None:
            raise ConfigError(
                "this batch carries no plan record: wrap the dataset in PlanDataset(dataset) and pass the "
                "PlanSampler as the DataLoader's batch_sampler, so each micro-batch's record reaches the collator"
            )
        return self._record

    @property
    def has_record(self) -> bool:
        return self._record is not None

    def to(self, *args: Any, **kwargs: Any) -> PlanBatch:
        """A copy with every tensor moved by ``tensor.to(*args, **kwargs)``; same record."""
        return PlanBatch({k: _map_tensor(v, lambda t: t.to(*args, **kwargs)) for k, v in self.items()}, self._record)

    def pin_memory(self, device: Any = None) -> PlanBatch:
        """A copy with every tensor in pinned memory (what ``DataLoader(pin_memory=True)`` calls)."""
        return PlanBatch({k: _map_tensor(v, lambda t: t.pin_memory()) for k, v in self.items()}, self._record)

    def __copy__(self) -> PlanBatch:
        return PlanBatch(self, self._record)

    def __reduce__(self) -> tuple[Any, ...]:
        return (PlanBatch, (dict(self), self._record))

    def __repr__(self) -> str:
        where = "no record" if self._record is None else f"step {self._record.step}, micro {self._record.micro}"
        return f"PlanBatch({where}, keys={list(self)})"


def record_of(batch: Any) -> MicroBatch:
    """The plan record of a collated batch: ``batch.record``, with a clear error when it has none.

    Raises:
        ConfigError: ``batch`` is not a `PlanBatch` with a record (a collator
            other than `PackCollator`/`PadCollator`, or a step that rebuilt it).
    """
    if isinstance(batch, PlanBatch):
        return batch.record
    raise ConfigError(
        f"expected a PlanBatch (what PackCollator/PadCollator return) but got {type(batch).__name__}; "
        "a custom collate_fn must be wrapped as with_record(collate_fn) to keep each batch's plan record"
    )


def _map_tensor(value: Any, move: Any) -> Any:
    return move(value) if isinstance(value, torch.Tensor) else value
