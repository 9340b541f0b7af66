"""`MixtureDataset`: a mixture's global sample index as (source, row), over one dataset per source.

A mixture's plan numbers samples over its sources in the mixture's order: source ``k``'s rows
start at its ``offset`` (the plan's ``mixture`` metadata). Training passes one map-style
dataset per source name; ``dataset[i]`` is row ``i - offset`` of the source that holds ``i``.
Wrap it in `batchplan.runtime.PlanDataset` as any dataset (spans, checks and records work
the same). A micro-batch holds one source (its record's ``source``), so `__getitems__` asks
that source's dataset for all its rows at once.

Opening checks that every source of the plan has a dataset, of the rows the plan was built
for: a `PlanMismatchError` names the source otherwise. `PlanSampler.check_dataset(dataset,
lengths)` on a mixture's plan compares each source's part of the lengths (global sample
order) with the fingerprint its build recorded (`check_mixture_lengths`).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from torch.utils.data import Dataset

from batchplan.errors import ConfigError, PlanFormatError, PlanMismatchError
from batchplan.formats.opened_plan import OpenedPlan
from batchplan.formats.opening import open_plan

__all__ = ["MixtureDataset", "check_mixture_lengths", "source_names"]


def source_names(plan: OpenedPlan | str | os.PathLike) -> list[str]:
    """The names of a mixture plan's sources, in order: ``names[record.source]`` is a
    micro-batch's source."""
    plan = plan if isinstance(plan, OpenedPlan) else open_plan(plan)
    return [source["name"] for source in _sources(plan)]


class MixtureDataset(Dataset):
    """One map-style dataset per source of a mixture's plan, read by global sample index.

    Args:
        plan: the mixture's plan (a path, or an opened plan).
        datasets: source name -> a dataset with ``__getitem__(int)`` and ``__len__``, of the
            rows the plan was built for (a source of weight 0 that the plan never uses may be
            left out).

    Raises:
        PlanMismatchError: the plan is not a mixture's, a source it uses has no dataset, or a
            dataset's length is not its source's.
    """

    def __init__(self, plan: OpenedPlan | str | os.PathLike, datasets: Mapping[str, Any]) -> None:
        plan = plan if isinstance(plan, OpenedPlan) else open_plan(plan)
        sources = _sources(plan)
        unknown = sorted(set(datasets) - {source["name"] for source in sources})
        if unknown:
            raise PlanMismatchError(
                f"{plan.path}: the plan has no source named {', '.join(map(repr, unknown))}; its sources are "
                f"{', '.join(repr(source['name']) for source in sources)}"
            )
        self.names = [source["name"] for source in sources]
        self.offsets = [int(source["offset"]) for source in sources]
        self.num_samples = plan.num_samples
        self.datasets: list[Any | None] = []  # None: a source the plan never uses, given no dataset
        for source in sources:
            dataset = datasets.get(source["name"])
            if dataset is None and source["planned_tokens"] > 0:
                raise PlanMismatchError(
                    f"{plan.path}: source {source['name']!r} has no dataset; pass datasets={{..., "
                    f"{source['name']!r}: <its {source['num_samples']:,} rows>}}"
                )
            if dataset is not None and len(dataset) != source["num_samples"]:
                raise PlanMismatchError(
                    f"{plan.path}: source {source['name']!r} was planned for {source['num_samples']:,} rows but its "
                    f"dataset has {len(dataset):,}; pass the dataset the plan was built from, or rebuild the plan"
                )
            self.datasets.append(dataset)

    def __len__(self) -> int:
        return self.num_samples

    def locate(self, index: int) -> tuple[int, int]:
        """``(source, row)`` of a global sample index."""
        index = int(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index:,} is outside the mixture's 0..{self.num_samples - 1:,}")
        source = bisect.bisect_right(self.offsets, index) - 1
        return source, index - self.offsets[source]

    def __getitem__(self, index: int) -> Any:
        source, row = self.locate(index)
        return self._dataset(source, index)[row]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The items of ``indices``; rows of one source (a micro-batch's) in one call of its
        dataset's ``__getitems__`` when it has one."""
        located = [self.locate(index) for index in indices]
        sources = {source for source, _ in located}
        if len(sources) == 1:
            dataset = self._dataset(located[0][0], indices[0])
            many = getattr(dataset, "__getitems__", None)
            rows = [row for _, row in located]
            return list(many(rows)) if many is not None else [dataset[row] for row in rows]
        return [self._dataset(source, index)[row] for (source, row), index in zip(located, indices)]

    def _dataset(self, source: int, index: int) -> Any:
        """The dataset of ``source``, which holds sample ``index``.

        Raises:
            PlanMismatchError: the source was given no dataset (the plan never uses it).
        """
        dataset = self.datasets[source]
        if dataset is None:
            raise PlanMismatchError(
                f"sample {index:,} is in source {self.names[source]!r}, which has no dataset (the plan never "
                f"uses it); pass datasets={{..., {self.names[source]!r}: <its rows>}} to read it"
            )
        return dataset


def check_mixture_lengths(plan: OpenedPlan, lengths: ArrayLike, loss_tokens: ArrayLike | None = None) -> None:
    """Raise unless ``lengths`` (and ``loss_tokens``), one per global sample, are the sources'
    the plan was built for: each source's part against the fingerprint its build recorded (a
    mixture's plan records no fingerprint of all the lengths as one array).

    Args:
        plan: the mixture's plan.
        lengths: every sample's tokens, sources in the plan's order (their datasets' rows, concatenated).
        loss_tokens: every sample's loss tokens, when a source was planned with a loss-tokens
            column (a source without one is compared on its lengths only).

    Raises:
        PlanMismatchError: a source's lengths differ; the message names it.
        ConfigError: ``loss_tokens`` is missing (or given, but no source has the column), or
            ``lengths`` is not one per sample.
        PlanFormatError: a source records no fingerprint.
    """
    from batchplan.formats.lengths import fingerprint_lengths  # only when lengths are given

    sources = _sources(plan)
    columns = {source["name"]: source.get("loss_tokens_column") for source in sources}
    with_column = [name for name, column in columns.items() if column is not None]
    if with_column and loss_tokens is None:
        raise ConfigError(
            f"{plan.path}: source {with_column[0]!r} was planned with loss-tokens column "
            f"{columns[with_column[0]]!r}; pass loss_tokens= (every sample's, sources in order) with the lengths"
        )
    if loss_tokens is not None and not with_column:
        raise ConfigError(f"{plan.path}: no source of the mixture has a loss-tokens column; drop loss_tokens=")
    lengths = np.asarray(lengths)
    loss = None if loss_tokens is None else np.asarray(loss_tokens)
    for name, values in (("lengths", lengths), ("loss_tokens", loss)):
        if values is not None and values.shape != (plan.num_samples,):
            raise ConfigError(
                f"{name} has shape {values.shape}, expected ({plan.num_samples:,},): one per sample of the "
                "mixture, its sources' rows in the plan's order"
            )
    for source in sources:
        recorded = source.get("lengths_fingerprint")
        if recorded is None:
            raise PlanFormatError(f"{plan.path}: source {source['name']!r} records no lengths fingerprint; rebuild it")
        part = slice(source["offset"], source["offset"] + source["num_samples"])
        own_loss = loss[part] if loss is not None and columns[source["name"]] is not None else None
        found = fingerprint_lengths(lengths[part], own_loss)
        if found != recorded:
            raise PlanMismatchError(
                f"{plan.path}: source {source['name']!r} (samples {part.start:,}..{part.stop - 1:,}) has lengths of "
                f"fingerprint {found} but the plan was built for {recorded}; same row count, other data (or "
                "another row order): pass that source's dataset as it was when the plan was built, or rebuild the plan"
            )


def _sources(plan: OpenedPlan) -> list[dict[str, Any]]:
    mixture = plan.metadata.get("mixture")
    if mixture is None:
        raise PlanMismatchError(
            f"{plan.path}: the plan was built from one dataset, not a mixture; wrap that dataset in PlanDataset "
            "directly"
        )
    return mixture["sources"]
