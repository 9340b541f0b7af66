"""Re-plan the rest of a mixture's run with another mixture from a step ``S`` on, on the same
or another world size (the command line's ``reshard`` given a mixture file).

The new plan holds steps ``S`` on, as a resharded plan does (``first_step``,
``tokens_before_first_step``, ``resharded_from`` and ``consumed``; the parent's steps before
``S`` are what the run trained), so a parent's sampler state saved at ``S`` resumes on it and
``tokens_before_step`` runs on. From ``S`` on:

- **Sources by name.** A sample index keeps meaning the same row of the same source: the
  parent's sources keep their offsets (one the new mixture leaves out stays, with weight 0 and
  no uses), and a source the parent did not have is appended after the parent's samples. A
  kept source must have the rows the parent was built from (its lengths' fingerprint), else
  the re-plan is refused: changed data is a new source, under a new name.
- **Sizing.** The new mixture's ``tokens`` is the whole run's; its weights (the sources' own,
  then its phases, at run tokens as in any mixture) hold from ``S`` on. Each source is asked
  for its weight of the run's tokens from ``S`` to ``tokens``, summed over the phases.
- **Repetition order across the change.** A kept source goes on where the run left it: its
  samples not used yet in the pass under way at ``S`` first, in that pass's seeded order,
  then whole passes on (`batchplan.planning.mixture_sizing.SourceResume`); an added source
  starts at its first pass. So no sample is used a (k+1)-th time before the rest of its
  source has been used k times, counting the parent's uses before ``S``.
- **Epochs.** The rest of the run is the parent's epochs from ``S``'s on, each a part of
  about equal tokens (`batchplan.planning.mixture_epochs`); earlier epochs hold no rows.

The new plan's ``mixture`` metadata describes the new mixture (``spec``, ``fingerprint``,
``phases`` at run tokens) over every source in index order, what the plan holds of each
(``target_tokens``, ``planned_tokens``, ``passes``: of the rest), and ``replanned``: the
step and the parent's mixture fingerprint. ``consumed`` is the parent's uses before ``S``
(`batchplan.operations.reshard_mixture.mixture_consumed`), so `batchplan validate` checks the
repetition order across the change and the shares against the new weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig, num_threads
from batchplan.errors import ConfigError, DatasetError
from batchplan.formats.bitmap import decode_bitmap
from batchplan.formats.opened_plan import OpenedPlan
from batchplan.mixture import Mixture, MixturePhase, MixtureSource
from batchplan.operations.parent_rows import read_epoch
from batchplan.operations.reshard import ReshardedPlan, empty_epoch, locate_step, open_parent, parent_record
from batchplan.operations.reshard_mixture import mixture_consumed
from batchplan.plan import Plan

__all__ = ["SourcesInPlan", "replan_mixture", "replan_mixture_file", "sources_in_plan"]

PathLike = str | os.PathLike


def replan_mixture_file(
    plan_path: PathLike,
    output: PathLike,
    mixture: PathLike | Mixture,
    *,
    from_step: int,
    world_size: int | None = None,
    micro_batches: int | None = None,
    tokens_per_step: int | None = None,
) -> dict[str, Any]:
    """Open and verify a mixture's plan, re-plan it from ``from_step`` with ``mixture`` (a
    mixture file or a `Mixture`), write the result atomically; return its metadata."""
    from batchplan.formats.mixture_file import read_mixture

    parent = open_parent(plan_path, output, "re-planned")
    mixture = mixture if isinstance(mixture, Mixture) else read_mixture(mixture)
    replanned = replan_mixture(
        parent,
        mixture,
        from_step=from_step,
        world_size=world_size,
        micro_batches=micro_batches,
        tokens_per_step=tokens_per_step,
        threads=num_threads(),
    )
    return replanned.write(output)


def replan_mixture(
    plan: OpenedPlan,
    mixture: Mixture,
    *,
    from_step: int,
    world_size: int | None = None,
    micro_batches: int | None = None,
    tokens_per_step: int | None = None,
    threads: int = 1,
) -> ReshardedPlan:
    """The rest of ``plan``'s run from global step ``from_step`` with ``mixture`` (module docstring).

    Args:
        plan: a mixture's plan, the one the run trained on until ``from_step``.
        mixture: the mixture from ``from_step`` on; its ``tokens`` are the whole run's.
        from_step: the first global step of the new plan.
        world_size: ranks from ``from_step`` on (default: the parent's).
        micro_batches, tokens_per_step: the step size (default: the parent's).

    Raises:
        ConfigError: ``plan`` is not a mixture's plan; ``mixture`` is sized by epochs, or its
            tokens do not reach past ``from_step``; ``from_step`` is not a step of the plan, or
            lies inside a sequence-length warmup.
        DatasetError: a kept source's rows differ from the parent's; a source cannot be read.
    """
    described = _parent_mixture(plan, mixture)
    epoch, position, tokens_before = locate_step(plan, from_step)
    config = _config(plan, world_size, micro_batches, tokens_per_step)
    _check_reach(mixture, config, tokens_before, from_step)
    consumed = mixture_consumed(
        plan, _before(plan, epoch, from_step), epoch, from_step, [read_epoch(plan, k) for k in range(epoch)]
    )
    sources = sources_in_plan(described["sources"], mixture, where=f" than when {plan.path} was built")
    resume = _resume(consumed["mixture"], described["sources"], sources, plan.num_samples)
    prepared = _prepare_rest(mixture, sources, config, resume, plan.num_epochs, epoch, tokens_before, threads)
    epochs = _plan_rest(prepared, config, plan.num_epochs, epoch, tokens_before, threads)
    consumed["mixture"]["uses_base"] += [0] * (len(sources.names) - len(described["sources"]))
    lineage = {
        "first_step": from_step,
        "tokens_before_first_step": tokens_before,
        "num_entries": prepared.entries.num_entries,
        "resharded_from": parent_record(plan, from_step, epoch, position),
        "consumed": consumed,
    }
    new_plan = Plan(config=config, num_samples=sources.num_samples, entries=prepared.entries, epochs=tuple(epochs))
    metadata = _mixture_metadata(mixture, described, sources, prepared.selections, from_step, tokens_before)
    return ReshardedPlan(new_plan, lineage, None, sources.fingerprint(), metadata)


def _parent_mixture(plan: OpenedPlan, mixture: Mixture) -> dict[str, Any]:
    """The parent's ``mixture`` metadata, once ``plan`` and ``mixture`` are known to re-plan."""
    described = plan.metadata.get("mixture")
    if described is None:
        raise ConfigError(
            f"{plan.path} was built from one dataset, not a mixture; re-planning with another mixture takes the "
            "plan of a mixture"
        )
    if mixture.tokens is None:  # sized by epochs
        raise ConfigError(
            "re-planning takes a mixture with tokens (the whole run's) and weights; a mixture sized by epochs has "
            "no run to continue"
        )
    return described


def _check_reach(mixture: Mixture, config: PlanConfig, tokens_before: int, from_step: int) -> None:
    """The new mixture reaches past ``from_step``, which lies after a sequence-length warmup."""
    assert mixture.tokens is not None  # `_parent_mixture` refuses a mixture sized by epochs
    if mixture.tokens <= tokens_before:
        raise ConfigError(
            f"the new mixture's tokens ({mixture.tokens:,}) do not reach past the {tokens_before:,} tokens trained "
            f"before step {from_step:,}; give the whole run's tokens"
        )
    warmup = config.seqlen_warmup_tokens
    if warmup is not None and tokens_before < warmup:
        raise ConfigError(
            f"step {from_step:,} lies inside the plan's sequence-length warmup ({tokens_before:,} of its {warmup:,} "
            "tokens trained): re-plan from a step after it, whose tokens before it reach the warmup's"
        )


def _prepare_rest(
    mixture, sources, config: PlanConfig, resume, num_epochs: int, epoch: int, tokens_before: int, threads: int
):
    """The entries of the run from ``tokens_before`` on (epochs ``epoch..num_epochs - 1``;
    the ones before hold nothing), phases at run tokens, and no warmup: the run is past it
    (`_check_reach`)."""
    from batchplan.kernels.startup import start_numba
    from batchplan.planning.mixture_entries import prepare_mixture_entries

    lengths, loss_tokens = sources.lengths()
    rest = _rest_mixture(mixture, sources, tokens_before)
    start_numba()
    rest_config = dataclasses.replace(
        config, epochs=num_epochs - epoch, seqlen_warmup_min=None, seqlen_warmup_tokens=None
    )
    prepared = prepare_mixture_entries(
        rest, lengths, sources.offsets(), rest_config, loss_tokens=loss_tokens, threads=threads, resume=resume
    )
    # Epochs before the resumed one hold nothing; phases at run tokens (the rest's begin at from_step).
    return dataclasses.replace(
        prepared,
        epoch_chunks=np.concatenate([np.zeros(epoch, dtype=np.int64), prepared.epoch_chunks]),
        phase_starts=prepared.phase_starts + tokens_before,
    )


def _plan_rest(prepared, config: PlanConfig, num_epochs: int, epoch: int, tokens_before: int, threads: int):
    """Every epoch of the new plan: empty before ``epoch``, then each planned in order."""
    from batchplan.planning.mixture_epochs import plan_mixture_epoch

    epochs = [empty_epoch(k, config, np.zeros(0, np.int64), mixture=True) for k in range(epoch)]
    done = tokens_before
    for k in range(epoch, num_epochs):
        planned = plan_mixture_epoch(prepared, config, k, tokens_before=done, threads=threads)
        epochs.append(planned)
        done += int(planned.step_tokens.sum())
    return epochs


@dataclasses.dataclass(frozen=True)
class SourcesInPlan:
    """A mixture's sources laid out in a parent plan's sample indices: the parent's sources
    first, at their offsets, then the mixture's new ones.

    Attributes:
        names: every source in index order.
        sizes: each one's rows.
        read: the mixture's lengths as read (`batchplan.formats.mixture_file.MixtureLengths`,
            in the mixture's order; a source the mixture leaves out is not read).
        recorded: the parent's source records (its ``mixture`` metadata) by name.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    read: Any
    recorded: dict[str, dict[str, Any]]

    @property
    def num_samples(self) -> int:
        return int(sum(self.sizes))

    def offsets(self) -> NDArray[np.int64]:
        bounds = np.zeros(len(self.sizes) + 1, dtype=np.int64)
        np.cumsum(self.sizes, out=bounds[1:])
        return bounds

    def lengths(self):
        """``(lengths, loss_tokens)`` over every index (a left-out source's samples: 0)."""
        read, offsets = self.read, self.offsets()
        by_name = {source.name: source for source in read.sources}
        lengths = np.zeros(self.num_samples, dtype=read.lengths.dtype)
        loss = None if read.loss_tokens is None else np.zeros(self.num_samples, dtype=read.loss_tokens.dtype)
        for index, name in enumerate(self.names):
            source = by_name.get(name)
            if source is None:
                continue
            part, mine = (
                slice(int(offsets[index]), int(offsets[index + 1])),
                slice(source.offset, source.offset + source.num_samples),
            )
            lengths[part] = read.lengths[mine]
            if loss is not None:
                loss[part] = read.loss_tokens[mine]
        return lengths, loss

    def fingerprint(self) -> str:
        """As `MixtureLengths.fingerprint`, over every source in index order (a left-out one
        with the parent's record of it)."""
        read = {source.name: source.fingerprint for source in self.read.sources}
        rows = [
            [name, size, read.get(name) or self.recorded[name]["lengths_fingerprint"]]
            for name, size in zip(self.names, self.sizes)
        ]
        return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()[:32]


def sources_in_plan(parent_sources: list[dict[str, Any]], mixture: Mixture, *, where: str = "") -> SourcesInPlan:
    """Read ``mixture``'s sources (a kept one with the parent's columns unless the mixture
    names its own) and lay them out after the parent's (``parent_sources``: its ``mixture``
    metadata's).

    Raises:
        DatasetError: a kept source's rows are not the parent's (rows or lengths fingerprint).
    """
    from batchplan.formats.mixture_file import read_mixture_lengths

    recorded = {source["name"]: source for source in parent_sources}
    reading = tuple(
        dataclasses.replace(
            source,
            length_column=source.length_column or recorded[source.name]["length_column"],
            loss_tokens_column=source.loss_tokens_column or recorded[source.name].get("loss_tokens_column"),
        )
        if source.name in recorded
        else source
        for source in mixture.sources
    )
    read = read_mixture_lengths(dataclasses.replace(mixture, sources=reading))
    by_name = {source.name: source for source in read.sources}
    for name, old in recorded.items():
        source = by_name.get(name)
        if source is not None and (source.num_samples, source.fingerprint) != (
            old["num_samples"],
            old["lengths_fingerprint"],
        ):
            raise DatasetError(
                f"source {name!r} has other rows{where} ({source.num_samples:,} rows, lengths fingerprint "
                f"{source.fingerprint}; the plan's: {old['num_samples']:,}, {old['lengths_fingerprint']}); a "
                "sample index must keep its row, so give the changed data a new name to add it as a new source "
                f"(and leave {name!r} out)"
            )
    added = [source.name for source in read.sources if source.name not in recorded]
    names = [source["name"] for source in parent_sources] + added
    sizes = [int(source["num_samples"]) for source in parent_sources] + [by_name[name].num_samples for name in added]
    return SourcesInPlan(tuple(names), tuple(sizes), read, recorded)


def _config(plan: OpenedPlan, world_size, micro_batches, tokens_per_step) -> PlanConfig:
    values = dict(plan.metadata["config"])
    if world_size is not None:
        values["world_size"] = world_size
    if micro_batches is not None or tokens_per_step is not None:
        values["micro_batches"], values["tokens_per_step"] = micro_batches, tokens_per_step
    return PlanConfig.from_dict(values)


def _before(plan: OpenedPlan, epoch: int, from_step: int):
    rows = read_epoch(plan, epoch)
    return rows.take(np.flatnonzero(rows.step < from_step))


def _rest_mixture(mixture: Mixture, sources: SourcesInPlan, tokens_before: int) -> Mixture:
    """``mixture`` over every source in index order (a left-out one at weight 0) for the
    run's tokens from ``tokens_before`` on: the weights in force there first, later phases
    moved by ``tokens_before``."""
    assert mixture.tokens is not None  # `replan_mixture` refuses a mixture sized by epochs
    in_force = {source.name: source.weight for source in mixture.sources}
    later = []
    for phase in mixture.phases:
        if phase.from_tokens <= tokens_before:
            in_force = dict(phase.weights)
        else:
            later.append(phase)
    given = {source.name: source for source in mixture.sources}
    rows = []
    for name in sources.names:
        source = given.get(name) or MixtureSource(name=name, paths=("(not in the new mixture)",))
        rows.append(dataclasses.replace(source, weight=in_force.get(name, 0.0), epochs=None))
    moved = tuple(
        MixturePhase(
            from_tokens=phase.from_tokens - tokens_before,
            weights={name: phase.weights.get(name, 0.0) for name in sources.names},
        )
        for phase in later
    )
    return Mixture(sources=tuple(rows), tokens=mixture.tokens - tokens_before, phases=moved)


def _resume(record: dict[str, Any], parent_sources, sources: SourcesInPlan, num_samples: int):
    """Where each of the parent's sources goes on from: its pass under way (``uses_base``)
    and the samples that pass has not used (not in ``uses_more``)."""
    from batchplan.planning.mixture_sizing import SourceResume

    more = decode_bitmap(record["uses_more"], num_samples)
    resume = {}
    for source, base in zip(parent_sources, record["uses_base"]):
        part = slice(source["offset"], source["offset"] + source["num_samples"])
        resume[source["name"]] = SourceResume(pass_index=int(base), left=~more[part])
    return resume


def _mixture_metadata(mixture: Mixture, described, sources: SourcesInPlan, selections, from_step, tokens_before):
    """The new plan's ``mixture``: the new mixture over every source in index order."""
    parent = {source["name"]: source for source in described["sources"]}
    read = {source.name: source for source in sources.read.sources}
    given = {source.name: source for source in mixture.sources}
    offsets = sources.offsets()
    rows = []
    for index, (name, selection) in enumerate(zip(sources.names, selections)):
        source, lengths = given.get(name), read.get(name)
        old: dict[str, Any] = parent.get(name) or {}  # the parent's record of the source ({}: one added)
        row = {
            "name": name,
            "paths": list(source.paths) if source is not None else old["paths"],
            "offset": int(offsets[index]),
            "num_samples": int(sources.sizes[index]),
            "files": [[path, count] for path, count in lengths.files] if lengths is not None else old["files"],
            "lengths_fingerprint": lengths.fingerprint if lengths is not None else old["lengths_fingerprint"],
            "length_column": (source.length_column if source is not None else None)
            or old.get("length_column", "length"),
            "loss_tokens_column": (source.loss_tokens_column if source is not None else None)
            or old.get("loss_tokens_column"),
            "weight": selection.weight,
            "target_tokens": selection.target_tokens,
            "planned_tokens": selection.planned_tokens,
            "passes": selection.passes,
        }
        rows.append(row)
    starts, weights = mixture.phase_weights()
    position = {name: index for index, name in enumerate(mixture.names)}
    phases = [
        {"from_tokens": start, "weights": [row[position[n]] if n in position else 0.0 for n in sources.names]}
        for start, row in zip(starts, weights)
    ]
    return {
        "fingerprint": mixture.fingerprint(),
        "spec": mixture.to_dict(),
        "sources": rows,
        "phases": phases,
        "replanned": {"from_step": from_step, "tokens_before": tokens_before, "parent": described["fingerprint"]},
    }
