"""One definition of each statistic a plan is judged by.

`batchplan.reports.summary` (build summary, ``inspect`` table and JSON), the plot's
legends and ``compare`` all take their numbers from here:

- **step imbalance**: in one step, the busiest rank's tokens (or cost) over the
  ranks' mean, minus 1. A step where every rank is idle has none.
- **regular steps**: every step but each epoch's last. The last step is completed
  by the end-of-epoch policy (split and empty micro-batches, so every rank runs the
  same number of forwards) and is imbalanced by design: it is reported on its own,
  as ``last_step`` (the mean over the epochs' last steps).
- **imbalance** ``mean``, ``p99`` and ``max``: over the regular steps that have work
  (a mean above the p99 means under 1 % of the steps hold most of the imbalance;
  ``max`` shows how much).
- **fill**: real tokens / (micro-batches x max_tokens), over the regular steps.
- **padding**: padded-away tokens / computed tokens (count x longest in pad mode),
  over all micro-batches.

A statistic with nothing to average (a plan whose only step is its epoch's last has no
regular step) is None, shown as "n/a" (`format_share`), never 0 %.

Arrays in, floats out; no files.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "Imbalance",
    "format_share",
    "imbalance_over_steps",
    "last_steps_of",
    "rank_imbalance",
    "regular_steps",
    "step_imbalance",
]


@dataclasses.dataclass(frozen=True)
class Imbalance:
    """Rank imbalance of a plan: ``mean``, ``p99``, ``max`` over regular steps, ``last_step`` on its own;
    None where there is no step to average over."""

    mean: float | None
    p99: float | None
    max: float | None
    last_step: float | None


def step_imbalance(per_rank: NDArray) -> NDArray[np.float64]:
    """(num_steps,) max / mean - 1 of each step (row) of ``per_rank``; NaN where every rank is idle."""
    mean = per_rank.mean(axis=1)
    out = np.full(per_rank.shape[0], np.nan)
    busy = mean > 0
    out[busy] = per_rank[busy].max(axis=1) / mean[busy] - 1.0
    return out


def last_steps_of(steps_per_epoch: NDArray | list[int]) -> NDArray[np.int64]:
    """Indices (from the plan's first step) of each non-empty epoch's last step."""
    steps = np.asarray(steps_per_epoch, dtype=np.int64)
    return (np.cumsum(steps) - 1)[steps > 0]


def regular_steps(num_steps: int, last_steps: NDArray[np.int64]) -> NDArray[np.bool_]:
    """(num_steps,) True for every step but the epochs' last ones."""
    regular = np.ones(num_steps, dtype=bool)
    regular[last_steps] = False
    return regular


def rank_imbalance(per_rank: NDArray, last_steps: NDArray[np.int64]) -> Imbalance:
    """`Imbalance` of ``per_rank`` (shape (num_steps, world_size)) whose epochs end at ``last_steps``."""
    return imbalance_over_steps(step_imbalance(per_rank), last_steps)


def imbalance_over_steps(per_step: NDArray[np.float64], last_steps: NDArray[np.int64]) -> Imbalance:
    """`Imbalance` of the steps' `step_imbalance` values (shape (num_steps,), NaN where idle)
    whose epochs end at ``last_steps``: a plan read an epoch at a time keeps only these."""
    regular = regular_steps(per_step.shape[0], last_steps)
    values = per_step[regular & ~np.isnan(per_step)]
    ends = per_step[~regular & ~np.isnan(per_step)]
    return Imbalance(
        mean=float(values.mean()) if values.size else None,
        p99=float(np.percentile(values, 99)) if values.size else None,
        max=float(values.max()) if values.size else None,
        last_step=float(ends.mean()) if ends.size else None,
    )


def format_share(value: float | None, digits: int = 3) -> str:
    """``value`` as a percentage with ``digits`` decimals, or "n/a" for None (nothing to average)."""
    return "n/a" if value is None else f"{value:.{digits}%}"
