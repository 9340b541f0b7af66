"""The figure of `batchplan compare`'s plot: each way of batching side by side
(matplotlib through `batchplan.reports.figure`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from batchplan.reports.figure import matplotlib_modules

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from batchplan.reports.compare import Comparison

__all__ = ["plot_comparison"]


def plot_comparison(comparison: Comparison) -> Figure:
    """Bar charts of a `compare_strategies` result: time, padding and fill, imbalance, micro-batches."""
    figure_class, _ = matplotlib_modules()
    rows = comparison.strategies
    names = [f"{i + 1} {_TICK_NAMES.get(r.name, r.name)}" for i, r in enumerate(rows)]
    positions = np.arange(len(rows))
    figure = figure_class(figsize=(15, 8.5), layout="constrained")
    axes = figure.subplots(2, 2).reshape(-1)
    _bars(axes[0], positions, [[r.relative_time for r in rows]], ["relative epoch time"], "x baseline 1")
    axes[0].axhline(1.0, color="grey", linestyle=":", linewidth=0.8)
    axes[0].set_title("predicted epoch time (sum over steps of the slowest rank's cost), x baseline 1")
    _bars(
        axes[1],
        positions,
        [[_percent(r.fill) for r in rows], [100 * r.padding_fraction for r in rows]],
        ["fill (real tokens / micro-batches x max_tokens)", "padding (of count x longest)"],
        "%",
    )
    axes[1].set_title("fill and padding of micro-batches")
    _bars(
        axes[2],
        positions,
        [[_percent(r.token_imbalance) for r in rows], [_percent(r.cost_imbalance) for r in rows]],
        ["tokens", "cost"],
        "%",
    )
    axes[2].set_title("rank imbalance (mean over steps but the last of max / mean - 1)")
    _bars(
        axes[3],
        positions,
        [[r.micro_batches for r in rows], [r.steps for r in rows]],
        ["micro-batches", "steps"],
        "per epoch",
    )
    axes[3].set_title("micro-batches and steps per epoch")
    for ax in axes:
        ax.set_xticks(positions, names, fontsize=9)
        ax.margins(y=0.12)
    figure.suptitle(_comparison_line(comparison), fontsize=12)
    return figure


def _bars(ax: Axes, positions, series: list[list[float | None]], labels: list[str], unit: str) -> None:
    """Grouped bars; a value of None (nothing to average) is an empty bar labelled "n/a"."""
    width = 0.8 / len(series)
    for i, (values, label) in enumerate(zip(series, labels)):
        heights = [0.0 if v is None else v for v in values]
        bars = ax.bar(positions + (i - (len(series) - 1) / 2) * width, heights, width, label=label)
        ax.bar_label(bars, labels=["n/a" if v is None else _short_number(v) for v in values], fontsize=8)
    ax.set_ylabel(unit)
    if len(series) > 1:
        ax.legend(fontsize=8)


_TICK_NAMES = {
    "pytorch": "PyTorch\nrandom, fixed n",
    "hf_grouped": "HF\ngroup_by_length",
    "fairseq": "fairseq\nsorted max-tokens",
    "batchplan_pad": "batchplan\npad",
    "batchplan_pack": "batchplan\npack",
}


def _percent(value: float | None) -> float | None:
    return None if value is None else 100 * value


def _short_number(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _comparison_line(c: Comparison) -> str:
    return (
        f"{c.num_samples:,} samples, max_tokens {c.max_tokens:,} per micro-batch for every strategy, "
        f"world_size {c.world_size}, {c.micro_batches} micro-batch(es) per rank per step, hidden_size "
        f"{c.hidden_size:,}\nbaselines 1-2: n = {c.baseline_batch_size} sample(s) per micro-batch so that the "
        f"longest ({c.longest:,} tokens) fits; oversize {c.oversize} ({c.oversize_samples:,} samples)"
    )
