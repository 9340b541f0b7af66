"""`plan_loader`: the ``DataLoader`` that replays a plan, in one call.

It is exactly the assembly the runtime documents::

    sampler = PlanSampler(plan, rank, world_size)
    DataLoader(PlanDataset(dataset), batch_sampler=sampler, collate_fn=PackCollator())  # PadCollator for pad

with the collator picked by the plan's mode, so a loader over a pad plan never packs.
The loader's ``batch_sampler`` is the `PlanSampler` (``finished``, ``state_dict``,
``set_epoch``). The dataset's row count is checked against the plan's before any row
is read (`PlanSampler.check_dataset`). Cost: opening the plan (its metadata, no rows).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torch.utils.data import DataLoader

from batchplan.errors import ConfigError, PlanFormatError
from batchplan.formats.opened_plan import OpenedPlan
from batchplan.runtime.collate import PackCollator, PadCollator
from batchplan.runtime.dataset import PlanDataset
from batchplan.runtime.sampler import PlanSampler

__all__ = ["plan_loader"]

COLLATORS = {"pack": PackCollator, "pad": PadCollator}
# DataLoader options that batch_sampler excludes: the plan decides every batch.
_BATCHING_OPTIONS = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


def plan_loader(
    dataset: Any,
    plan: str | os.PathLike | OpenedPlan,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    collate_kwargs: Mapping[str, Any] | None = None,
    **dataloader_kwargs: Any,
) -> DataLoader:
    """A ``DataLoader`` that replays this rank's micro-batches of ``plan`` over ``dataset``.

    Args:
        dataset: the map-style dataset the plan was built for (rows in the same order).
        plan: a plan file, a plan directory, or a plan opened with `batchplan.open_plan`.
        rank, world_size: as for `PlanSampler` (default: ``torch.distributed``, then the
            ``RANK`` / ``WORLD_SIZE`` environment variables).
        collate_kwargs: keyword arguments of the collator (`PackCollator` for a pack plan,
            `PadCollator` for a pad plan), e.g. ``{"pad_token_id": tokenizer.pad_token_id}``.
            Its ``input_key`` is also the key `PlanDataset` checks items by.
        **dataloader_kwargs: other ``DataLoader`` arguments (``num_workers``,
            ``pin_memory``, ...); ``collate_fn`` replaces the plan's collator.

    Raises:
        ConfigError: a batching option (``batch_size``, ``shuffle``, ``sampler``,
            ``batch_sampler``, ``drop_last``), both ``collate_fn`` and ``collate_kwargs``,
            collator arguments the collator does not take, or a dataset without a length.
        PlanMismatchError: the dataset's row count or the world size is not the plan's.
        PlanFormatError: the plan cannot be read, or its mode has no collator.
    """
    given = sorted(set(_BATCHING_OPTIONS) & set(dataloader_kwargs))
    if given:
        raise ConfigError(
            f"plan_loader got {', '.join(given)}, but the plan decides every micro-batch; "
            "leave them out (pass DataLoader options such as num_workers only)"
        )
    options = dict(collate_kwargs or {})
    if options and "collate_fn" in dataloader_kwargs:
        raise ConfigError(
            "plan_loader got both collate_fn and collate_kwargs; pass collate_kwargs for the plan's collator, "
            "or a collate_fn of your own (e.g. with_record(fn)) and no collate_kwargs"
        )
    sampler = PlanSampler(plan, rank=rank, world_size=world_size)
    sampler.check_dataset(dataset)
    collate_fn = dataloader_kwargs.pop("collate_fn", None) or _collator(sampler, options)
    wrapped = PlanDataset(dataset, input_key=options.get("input_key", "input_ids"))
    return DataLoader(wrapped, batch_sampler=sampler, collate_fn=collate_fn, **dataloader_kwargs)


def _collator(sampler: PlanSampler, options: dict[str, Any]) -> PackCollator | PadCollator:
    """The collator of the plan's mode, built with ``options``."""
    collator = COLLATORS.get(sampler.mode)
    if collator is None:
        raise PlanFormatError(
            f"{sampler.path}: the plan's mode is {sampler.mode!r}, expected one of {sorted(COLLATORS)}; "
            "rebuild it with this version of batchplan"
        )
    try:
        return collator(**options)
    except TypeError as error:
        raise ConfigError(
            f"collate_kwargs {sorted(options)} do not fit {collator.__name__} ({error}); "
            f"pass only {collator.__name__}'s keyword arguments (see batchplan.runtime.collate)"
        ) from error
