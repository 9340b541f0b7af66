"""Re-check a mixture's guarantees from its plan file alone (and the mixture's lengths).

Each source's samples are the global indices ``offset..offset + num_samples`` that the
plan's ``mixture`` metadata lists; the source of a micro-batch is found from its samples
(not taken from the ``source`` column, which is checked against it). Checks:
- ``mixture_sources``: every micro-batch holds samples of one source, and its ``source``
  column says which (-1 for an empty one).
- ``mixture_shares``: in every step but an epoch's last, each source's tokens are within
  max(0.5 % of the step's tokens, ``max_tokens``) of what it is due: ``weight x`` the step's
  tokens, the weight of the step's phase, the last phase whose ``from_tokens`` the step's
  ``tokens_before_step`` reaches (a plan without phases has one, its sources' weights); a
  step in which later phases begin is due each phase's weight of its tokens in that phase.
- ``mixture_drift``: after every step, each source's tokens since its stretch began (an
  epoch, and a phase within it) are within one step's tokens (the epoch's mean step, or
  ``max_tokens`` when steps are smaller: a lag comes in whole micro-batches) of what the
  stretch's steps so far are due, plus what the stretch's own tokens of the source miss
  what it is due by (in whole documents, from sizing and the epoch's cut: where the
  source ends whatever the order).
- ``mixture_repetition``: within a source no sample is used a (k+1)-th time in a step before
  the step in which the last of its kept samples is used a k-th time (uses of a split sample
  are counted once, by the piece that starts at token 0). A use ``drop_last`` drops counts
  after its epoch's last step (the plan lists each dropped entry's sample: `dropped_uses`).
- ``mixture_planned``: each source's tokens in the plan and those ``drop_last`` drops add up
  to the metadata's ``planned_tokens`` (a plan built or re-planned; a resharded plan's
  metadata is its parent's). Without the sources' lengths, a plan without spans whose
  epochs drop samples is not checked.

Memory: every use's (step, sample) once, 16 bytes per use; time: a sort of the uses.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from batchplan.formats.bitmap import decode_bitmap
from batchplan.formats.opened_plan import OpenedPlan
from batchplan.operations.epoch_checks import Violation

__all__ = ["check_mixture", "dropped_uses"]

_SHARE_FLOOR = 0.005  # 0.5 percentage points


def check_mixture(plan: OpenedPlan, lengths: NDArray[np.integer] | None = None) -> list[Violation]:
    """Every violated mixture guarantee of ``plan`` (none for a plan without a mixture);
    ``lengths``: every sample's, for the planned tokens that drop_last drops."""
    mixture = plan.metadata.get("mixture")
    if mixture is None:
        return []
    sources = mixture["sources"]
    bounds = np.array([s["offset"] for s in sources] + [sources[-1]["offset"] + sources[-1]["num_samples"]])
    phases = mixture.get("phases") or [{"from_tokens": 0, "weights": [s["weight"] for s in sources]}]
    starts = np.array([phase["from_tokens"] for phase in phases], dtype=np.int64)
    phase_weights = np.array([phase["weights"] for phase in phases], dtype=np.float64)
    found: list[Violation] = []
    uses = _Uses()
    trained = np.zeros(len(sources), dtype=np.int64)
    step_base = int(plan.metadata.get("first_step", 0))
    for epoch in range(plan.num_epochs):
        steps = plan.metadata["steps_per_epoch"][epoch]
        per_step = np.zeros((steps, len(sources)), dtype=np.int64)
        before = np.zeros(steps, dtype=np.int64)
        for rank in range(plan.world_size):
            found += _read_rank(plan, epoch, rank, bounds, step_base, per_step, before, uses)
        step_phase = np.searchsorted(starts, before, side="right") - 1
        due = _due(before, per_step.sum(axis=1), starts, phase_weights)
        found += _check_shares(per_step, due, step_phase, plan.metadata["max_tokens"], epoch, step_base)
        trained += per_step.sum(axis=0)
        step_base += steps
        uses.add_dropped(dropped_uses(plan.metadata, epoch), after_step=step_base - 1)
    if found:
        return found
    dropped = plan.metadata.get("dropped", {})
    never = np.concatenate([np.asarray(dropped.get(reason, []), dtype=np.int64) for reason in ("empty", "oversize")])
    prior = _uses_before(plan, sources)
    if prior is not None:
        prior[never] = 0  # a dropped sample is never used
    found += _check_repetition(*uses.joined(), bounds, sources, never, prior)
    return found + _check_planned(plan, sources, bounds, trained, lengths)


class _Uses:
    """Every use's sample and when it comes, rank after rank and epoch after epoch: a use in
    step ``s`` at ``2 s``, a use drop_last drops after step ``s`` (its epoch's last) at ``2 s + 1``."""

    def __init__(self) -> None:
        self.when: list[NDArray[np.int64]] = []
        self.samples: list[NDArray[np.int64]] = []

    def add(self, steps: NDArray[np.int64], samples: NDArray[np.int64]) -> None:
        self.when.append(2 * steps.astype(np.int64, copy=False))
        self.samples.append(samples.astype(np.int64, copy=False))

    def add_dropped(self, samples: NDArray[np.int64], after_step: int) -> None:
        self.when.append(np.full(samples.shape[0], 2 * after_step + 1, dtype=np.int64))
        self.samples.append(samples.astype(np.int64, copy=False))

    def joined(self) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        return np.concatenate(self.when), np.concatenate(self.samples)


def dropped_uses(metadata: dict[str, Any], epoch: int) -> NDArray[np.int64]:
    """The samples of the uses drop_last drops in a mixture's ``epoch``, a sample once per use
    (with spans, the dropped pieces that start at token 0)."""
    dropped = metadata.get("dropped", {})
    if metadata.get("has_spans"):
        spans = np.asarray(dropped.get("drop_last_spans", {}).get(str(epoch), []), dtype=np.int64).reshape(-1, 3)
        return spans[spans[:, 1] == 0, 0]
    return np.asarray(dropped.get("drop_last", {}).get(str(epoch), []), dtype=np.int64)


def _check_planned(plan: OpenedPlan, sources, bounds, trained: NDArray[np.int64], lengths) -> list[Violation]:
    """``mixture_planned`` (the module docstring)."""
    meta = plan.metadata
    if "resharded_from" in meta and "replanned" not in meta["mixture"]:
        return []  # a resharded plan keeps its parent's sources' numbers
    dropped = np.zeros(len(sources), dtype=np.int64)
    for epoch in range(plan.num_epochs):
        if meta.get("has_spans"):
            spans = meta.get("dropped", {}).get("drop_last_spans", {}).get(str(epoch), [])
            spans = np.asarray(spans, dtype=np.int64).reshape(-1, 3)
            samples, tokens = spans[:, 0], spans[:, 2]
        else:
            samples = dropped_uses(meta, epoch)
            if samples.size and lengths is None:
                return []  # the dropped samples' tokens are the dataset's
            tokens = np.zeros(0, dtype=np.int64) if not samples.size else np.asarray(lengths)[samples].astype(np.int64)
        np.add.at(dropped, np.searchsorted(bounds, samples, side="right") - 1, tokens)
    for index, source in enumerate(sources):
        if trained[index] + dropped[index] != source["planned_tokens"]:
            return [
                Violation(
                    "mixture_planned",
                    (
                        f"source {source['name']!r}: the plan trains {int(trained[index]):,} of its tokens and "
                        f"drop_last drops {int(dropped[index]):,}, but its planned tokens are "
                        f"{source['planned_tokens']:,}"
                    ),
                )
            ]
    return []


def _uses_before(plan: OpenedPlan, sources) -> NDArray[np.int64] | None:
    """Each kept sample's uses before the plan's first step: a resharded plan's ``consumed``
    ``mixture`` record (``uses_base`` per source, one more for ``uses_more``); None without one."""
    record = (plan.metadata.get("consumed") or {}).get("mixture")
    if record is None:
        return None
    uses = decode_bitmap(record["uses_more"], plan.num_samples).astype(np.int64)
    for source, base in zip(sources, record["uses_base"]):
        uses[source["offset"] : source["offset"] + source["num_samples"]] += int(base)
    return uses


def _read_rank(plan, epoch, rank, bounds, step_base, per_step, before, uses: _Uses) -> list[Violation]:
    """Adds the rank's tokens per (step, source) to ``per_step`` and its uses to ``uses``;
    sets ``before`` to each step's ``tokens_before_step``."""
    rows = plan.rank_rows(epoch, rank, checked=False)  # validate checks the whole plan's checksum
    offsets, samples = rows.offsets("samples"), rows.entries("samples").astype(np.int64)
    tokens, step = rows.numbers("tokens"), rows.numbers("step") - step_base
    recorded = rows.numbers("source") if "source" in rows else None
    sample_source = np.searchsorted(bounds, samples, side="right") - 1
    counts = np.diff(offsets)
    row = np.repeat(np.arange(counts.shape[0]), counts)
    first = np.full(counts.shape[0], -1, dtype=np.int64)
    first[counts > 0] = sample_source[offsets[:-1][counts > 0]]
    where = f"epoch {epoch}, rank {rank}"
    if (sample_source != first[row]).any():
        return [Violation("mixture_sources", f"{where}: a micro-batch holds samples of two sources")]
    if recorded is None or (recorded != first).any():
        return [Violation("mixture_sources", f"{where}: the source column disagrees with the micro-batches' samples")]
    held = counts > 0
    np.add.at(per_step, (step[held], first[held]), tokens[held])
    before[step] = rows.numbers("tokens_before_step")
    starts = rows.entries("starts") if rows.has_spans else None
    use = np.ones(samples.shape[0], dtype=bool) if starts is None else starts == 0
    uses.add((step[row] + step_base)[use], samples[use])
    return []


def _due(before: NDArray[np.int64], totals: NDArray[np.int64], starts: NDArray[np.int64], phase_weights):
    """Shape (steps, sources): the tokens each source is due in each step: each phase's
    weights times the step's tokens that lie in the phase (the run's tokens
    ``before..before + totals``)."""
    due = np.zeros((before.shape[0], phase_weights.shape[1]), dtype=np.float64)
    ends = np.append(starts[1:], np.iinfo(np.int64).max)
    for start, end, weights in zip(starts, ends, phase_weights):
        inside = np.minimum(before + totals, end) - np.maximum(before, start)
        due += np.maximum(inside, 0)[:, None].astype(np.float64) * weights[None, :]
    return due


def _check_shares(
    per_step: NDArray[np.int64], due, step_phase, max_tokens: int, epoch: int, step_base: int
) -> list[Violation]:
    found = []
    totals = per_step.sum(axis=1)
    target = due
    allowed = np.maximum(_SHARE_FLOOR * totals, max_tokens)
    off = np.abs(per_step - target)[:-1] > allowed[:-1, None]  # an epoch's last step may be short
    if off.any():
        step, source = np.argwhere(off)[0]
        share = per_step[step, source] / max(totals[step], 1)
        found.append(
            Violation(
                "mixture_shares",
                (
                    f"{int(off.sum()):,} (step, source) pairs off their share; first: step {step_base + step:,}, "
                    f"source {source}: {share:.2%} of {totals[step]:,} tokens against a weight of "
                    f"{due[step, source] / max(totals[step], 1):.2%}"
                ),
            )
        )
    step_tokens = max(totals.mean() if totals.shape[0] else 0, max_tokens)
    # A stretch: the epoch's steps of one phase. What its own tokens of each source miss its
    # weight by (whole documents: sizing and the epoch's cut) is where the source ends whatever
    # the order; the steps add one step at most.
    edges = np.flatnonzero(np.diff(step_phase)) + 1
    for first, last in zip(np.concatenate([[0], edges]), np.concatenate([edges, [totals.shape[0]]])):
        part, owed = per_step[first:last], due[first:last]
        drift = np.abs(np.cumsum(part, axis=0) - np.cumsum(owed, axis=0))
        own_miss = np.abs(part.sum(axis=0) - owed.sum(axis=0))
        allowed_drift = step_tokens + own_miss[None, :] + 1e-6
        if (drift > allowed_drift).any():
            step, source = np.argwhere(drift > allowed_drift)[0]
            found.append(
                Violation(
                    "mixture_drift",
                    (
                        f"after step {step_base + first + step:,}, source {source} is {drift[step, source]:,.0f} "
                        f"tokens off its weight in epoch {epoch} since step {step_base + first:,} (allowed: one step, "
                        f"{step_tokens:,.0f}, and the {own_miss[source]:,.0f} the stretch's own tokens of it miss its "
                        "weight by)"
                    ),
                )
            )
            break
    return found


def _check_repetition(steps, samples, bounds, sources, never: NDArray[np.int64], prior) -> list[Violation]:
    """Per source: the last step of every kept sample's k-th use comes before the first of any
    (k+1)-th use (the same step is allowed: its micro-batches run side by side); ``steps``:
    when each use comes (`_Uses`); ``never``: the samples the plan drops (empty, oversize);
    ``prior``: each sample's uses before the plan's first step (None: none)."""
    order = np.lexsort((samples, steps))  # by step, then sample: uses in plan order
    steps, samples = steps[order], samples[order]
    found = []
    for index, source in enumerate(sources):
        mine = (samples >= bounds[index]) & (samples < bounds[index + 1])
        used_steps, used = steps[mine], samples[mine] - bounds[index]
        if used.shape[0] == 0:
            continue
        # The k-th use of each sample (0-based), in plan order: rank within equal samples.
        by_sample = np.argsort(used, kind="stable")
        first_of = np.searchsorted(used[by_sample], used[by_sample], side="left")
        nth = np.empty(used.shape[0], dtype=np.int64)
        # uses before the plan's first step
        before = (
            np.zeros(source["num_samples"], np.int64) if prior is None else prior[bounds[index] : bounds[index + 1]]
        )
        nth[by_sample] = np.arange(used.shape[0]) - first_of
        nth += before[used]
        uses = np.bincount(used, minlength=source["num_samples"]) + before
        kept = np.ones(source["num_samples"], dtype=bool)
        kept[never[(never >= bounds[index]) & (never < bounds[index + 1])] - bounds[index]] = False
        if uses[kept].max() - uses[kept].min() > 1:
            found.append(
                Violation(
                    "mixture_repetition",
                    f"source {source['name']!r}: samples are used from {uses[kept].min()} to {uses[kept].max()} times",
                )
            )
            continue
        if uses[~kept].any():
            found.append(Violation("mixture_repetition", f"source {source['name']!r}: a dropped sample is used"))
            continue
        for k in range(int(nth.min()), int(nth.max())):
            if not (nth == k).any() or not (nth == k + 1).any():  # k-th uses before the plan's first step
                continue
            last_kth = used_steps[nth == k].max()
            first_next = used_steps[nth == k + 1].min()
            if first_next < last_kth:
                found.append(
                    Violation(
                        "mixture_repetition",
                        (
                            f"source {source['name']!r}: a sample is used a {k + 2}th time {_when(first_next)}, "
                            f"before every sample was used {k + 1} times (the last {_when(last_kth)})"
                        ),
                    )
                )
                break
    return found


def _when(at: int) -> str:
    """A use's time (`_Uses`) in words."""
    return f"in step {at // 2:,}" if at % 2 == 0 else f"in the step drop_last drops after step {at // 2:,}"
