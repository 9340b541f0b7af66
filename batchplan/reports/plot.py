"""The figure of a plan, for `batchplan inspect`'s plot (a comparison's: `plot_compare`; the
canvas and saving: `figure`).

`plot_plan` draws six panels from the plan file alone (plus the dataset's lengths
when given): sample lengths, micro-batch fill, tokens per step, rank imbalance per
step (tokens, and cost when the plan has a ``cost`` column), micro-batches per step,
and the summary numbers. Series over steps longer than 2,000 points are drawn as
the mean per bin of steps with a min-max band (`figure.draw_series`), so a 16 M-sample plan plots in seconds.
The histograms of per-micro-batch values are drawn from counts of each integer
0..max_tokens (`scan_plan`'s ``histograms``), with the bins the values themselves would
get: memory is O(max_tokens) plus one record batch, whatever the plan's size (plus the
lengths drawn, when given).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from batchplan.errors import PlanMismatchError
from batchplan.formats.opened_plan import OpenedPlan
from batchplan.reports.figure import draw_epoch_lines, draw_series, matplotlib_modules
from batchplan.reports.mixture import step_source_tokens, step_weights
from batchplan.reports.statistics import format_share, last_steps_of, regular_steps
from batchplan.reports.summary import PlanScan, scan_plan, summarize_plan

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


__all__ = ["PLAN_PANELS", "plan_lengths", "plot_plan"]

PLAN_PANELS = (
    "lengths",
    "micro-batch fill",
    "tokens per step",
    "rank imbalance per step",
    "micro-batches per step",  # a mixture's plan: each source's share of the steps
    "summary",
)


def plan_lengths(
    plan: OpenedPlan, dataset: str | os.PathLike | Sequence[str | os.PathLike] | None = None
) -> tuple[NDArray[np.int64] | None, str]:
    """Lengths to draw for ``plan`` and what they are.

    With ``dataset``: every sample's length, checked against the plan's fingerprint.
    Without it: the entry lengths of epoch 0 when the plan stores them (truncated or
    split samples), else ``None`` (the plan alone does not know sample lengths).

    Raises:
        PlanMismatchError: the dataset is not the one the plan was built for.
    """
    if dataset:
        from batchplan.formats.lengths import fingerprint_lengths, read_lengths

        source = plan.metadata.get("dataset") or {}
        column = source.get("length_column", "length")
        read = read_lengths(
            dataset, length_column=column, tokens_column=column, loss_tokens_column=source.get("loss_tokens_column")
        )
        recorded = plan.metadata.get("lengths_fingerprint")
        if recorded and fingerprint_lengths(read.lengths, read.loss_tokens) != recorded:
            raise PlanMismatchError(
                f"{plan.path}: the dataset's lengths ({read.num_samples:,} samples) are not the ones the "
                f"plan was built for ({plan.num_samples:,} samples); pass the plan's own dataset"
            )
        return read.lengths.astype(np.int64), "sample lengths (from the dataset)"
    if "lengths" in plan.schema.names:
        values = plan.epoch_rows(0).entries("lengths")
        policy = plan.metadata.get("config", {}).get("oversize", "split")
        return values.astype(np.int64), f"entry lengths (oversize samples: {policy})"
    return None, ""


def plot_plan(plan: OpenedPlan, lengths: NDArray[np.integer] | None = None, lengths_label: str = "") -> Figure:
    """One figure of six panels (`PLAN_PANELS`) describing ``plan``.

    Args:
        plan: the opened plan.
        lengths: lengths to histogram (`plan_lengths`); None draws the tokens of each
            micro-batch (pack) or its longest sample (pad) instead, and says so.
        lengths_label: the title of the lengths panel when ``lengths`` is given.
    """
    figure_class, _ = matplotlib_modules()
    scan = scan_plan(plan, histograms=True)  # one pass over the plan, one record batch at a time
    data = _plan_arrays(plan, scan)
    summary = summarize_plan(plan, scan=scan, source_tokens=data["source_tokens"])  # the rows read once more at most
    figure = figure_class(figsize=(16, 9), layout="constrained")
    axes = figure.subplots(2, 3).reshape(-1)
    _lengths_panel(axes[0], data, lengths, lengths_label)
    _fill_panel(axes[1], data, summary)
    _tokens_per_step_panel(axes[2], data, summary)
    _imbalance_panel(axes[3], data, summary)
    if data.get("source_tokens") is not None:  # a mixture: each source's share of the steps instead
        _shares_panel(axes[4], data, summary)
    else:
        _micro_per_step_panel(axes[4], data, summary)
    _summary_panel(axes[5], summary)
    figure.suptitle(_settings_line(plan), fontsize=13)
    return figure


def _plan_arrays(plan: OpenedPlan, scan: PlanScan) -> dict[str, Any]:
    data = {
        "mode": plan.metadata["mode"],
        "max_tokens": int(plan.metadata["max_tokens"]),
        "world_size": plan.world_size,
        "histograms": scan.histograms,  # counts of each value 0..max_tokens, then above
        "step_tokens": scan.step_tokens,
        "token_imbalance": scan.token_imbalance,
        "micro_per_step": scan.step_micro_batches // plan.world_size,
        "epoch_starts": np.cumsum(plan.metadata["steps_per_epoch"])[:-1],
        "last_steps": last_steps_of(plan.metadata["steps_per_epoch"]),
    }
    if scan.cost_imbalance is not None:
        data["cost_imbalance"] = scan.cost_imbalance
    data["source_tokens"] = step_source_tokens(plan)
    if data["source_tokens"] is not None:
        data["source_weights"] = step_weights(plan, data["source_tokens"])
    return data


def _lengths_panel(ax: Axes, data, lengths, label: str) -> None:
    cap = data["max_tokens"]
    if lengths is None:
        if data["mode"] == "pad":
            counts = data["histograms"]["longest"]
            label = "longest sample per micro-batch (no dataset given)"
        else:
            counts = data["histograms"]["nonempty_tokens"]
            label = "tokens per micro-batch (no dataset given)"
        unit = "micro-batches"
        values, weights = _counted_values(counts)
        number, over = int(counts.sum()), int(counts[cap + 1])
    else:
        values, weights = np.asarray(lengths), None
        unit = "samples" if label.startswith("sample") else "entries"
        number, over = values.shape[0], int((values > cap).sum())
    note = f"{number:,} {unit}\n" + (f"{over:,} > max_tokens" if over else "all <= max_tokens")
    positive = values > 0
    values, weights = values[positive], None if weights is None else weights[positive]
    bins: int | list[float]  # matplotlib's types take a list of edges, not an array
    if values.size and values.max() > 20 * max(1.0, _median(values, weights)):
        ax.set_xscale("log")
        bins = np.geomspace(max(1, values.min()), values.max() + 1, 60).tolist()
    else:
        bins = 60  # over values.min()..values.max(): the same with weights, as values are the ones counted
    ax.hist(values, bins=bins, weights=weights, color="tab:blue")
    if values.size and cap > 1.5 * values.max():
        note += f" ({cap:,}, off the axis)"
    else:
        ax.axvline(cap, color="tab:red", linestyle="--", label=f"max_tokens {cap:,}")
        ax.legend(loc="upper right", fontsize=8)
    ax.text(
        0.5,
        0.97,
        note,
        transform=ax.transAxes,
        ha="center",
        va="top",
        fontsize=8,
        bbox={"facecolor": "white", "alpha": 0.8, "linewidth": 0},
    )
    ax.set_yscale("log")
    bottom, top = ax.get_ylim()
    ax.set_ylim(bottom, top * 10)  # headroom for the note
    ax.set_xlabel("tokens")
    ax.set_ylabel(unit)
    ax.set_title(label, fontsize=10)


def _fill_panel(ax: Axes, data, summary: dict[str, Any]) -> None:
    cap = data["max_tokens"]
    tokens, weights = _counted_values(data["histograms"]["tokens"])
    bins = np.linspace(0, 100, 51).tolist()  # above max_tokens (a corrupt plan): off the bins, not drawn
    ax.hist(100.0 * tokens / cap, bins=bins, weights=weights, color="tab:green", alpha=0.7, label="real tokens")
    title = f"micro-batch fill: {format_share(summary['fill'])} of max_tokens (steps but each epoch's last)"
    if data["mode"] == "pad":
        padded, weights = _counted_values(data["histograms"]["padded"])
        ax.hist(
            100.0 * padded / cap,
            bins=bins,
            weights=weights,
            histtype="step",
            color="black",
            label="with padding (count x longest)",
        )
        title += f", padding {format_share(summary['padding_fraction'])}"
    ax.set_yscale("log")
    ax.set_xlabel(f"% of max_tokens ({cap:,})")
    ax.set_ylabel("micro-batches")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", fontsize=8)


def _counted_values(counts: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """The values a histogram of counts (`PlanScan.histograms`) counts, ascending, and how often
    each: a histogram of ``values`` weighted by ``weights`` has the counts, in any bins, of one
    over the values themselves (the last, above max_tokens, counted at max_tokens + 1)."""
    values = np.flatnonzero(counts)
    return values.astype(np.int64), counts[values]


def _median(values: NDArray, weights: NDArray[np.int64] | None) -> float:
    """`np.median` of ``values`` each repeated ``weights`` times (ascending values with weights)."""
    if weights is None:
        return float(np.median(values))
    total = np.cumsum(weights)
    middle = values[np.searchsorted(total, [(total[-1] - 1) // 2, total[-1] // 2], side="right")]
    return (int(middle[0]) + int(middle[1])) / 2


def _tokens_per_step_panel(ax: Axes, data, summary: dict[str, Any]) -> None:
    draw_series(ax, data["step_tokens"], "tab:blue", "tokens")
    draw_epoch_lines(ax, data["epoch_starts"])
    ax.set_xlabel("step")
    ax.set_ylabel("tokens per step (all ranks)")
    ax.set_title(f"tokens per step: mean {summary['tokens_per_step']['mean']:,.0f}", fontsize=10)
    ax.set_ylim(bottom=0)


def _imbalance_panel(ax: Axes, data, summary: dict[str, Any]) -> None:
    # Legends quote the summary (one definition: batchplan.reports.statistics), not the series drawn.
    # Each epoch's last step is completed by split and empty micro-batches: it is marked, not
    # drawn into the series, so its spike does not flatten every other step.
    regular = regular_steps(data["step_tokens"].shape[0], data["last_steps"])
    tokens = 100.0 * np.nan_to_num(data["token_imbalance"])
    title = "rank imbalance per step (max / mean - 1)"
    top = float(tokens[regular].max()) if regular.any() else 0.0
    if "cost_imbalance" in data:
        cost = 100.0 * np.nan_to_num(data["cost_imbalance"])
        draw_series(
            ax,
            np.where(regular, cost, np.nan),
            "tab:orange",
            f"cost (mean {format_share(summary['cost_imbalance'])}, p99 {format_share(summary['cost_imbalance_p99'])})",
        )
        top = max(top, float(cost[regular].max()) if regular.any() else 0.0)
        title += ": tokens and cost"
    else:
        title += ": tokens (no cost column)"
    draw_series(
        ax,
        np.where(regular, tokens, np.nan),
        "tab:blue",
        f"tokens (mean {format_share(summary['token_imbalance'])}, p99 {format_share(summary['token_imbalance_p99'])})",
        zorder=3,
    )
    last = f"each epoch's last step: tokens {format_share(summary['token_imbalance_last_step'])}"
    if summary.get("cost_imbalance_last_step") is not None:
        last += f", cost {format_share(summary['cost_imbalance_last_step'])}"
    for step in data["last_steps"]:
        ax.axvline(step, color="tab:red", linestyle="--", linewidth=0.8)
    ax.plot([], [], color="tab:red", linestyle="--", linewidth=0.8, label=last)
    draw_epoch_lines(ax, data["epoch_starts"])
    ax.set_xlabel("step")
    ax.set_ylabel("imbalance (%)")
    ax.set_ylim(bottom=0, top=max(top * 1.25, 0.01))
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper right", fontsize=8)


def _micro_per_step_panel(ax: Axes, data, summary: dict[str, Any]) -> None:
    per_step = data["micro_per_step"]
    low, high = (int(per_step.min()), int(per_step.max())) if per_step.size else (0, 0)
    if low == high:  # one count for every step: the panel shows the tokens seen instead
        seen = np.cumsum(data["step_tokens"])
        draw_series(ax, seen.astype(np.float64), "tab:purple", "tokens seen")
        _schedule_ends(ax, summary)
        draw_epoch_lines(ax, data["epoch_starts"])
        ax.set_xlabel("step")
        ax.set_ylabel("tokens seen (all ranks)")
        ax.set_ylim(bottom=0)
        ax.set_title(
            f"tokens seen; micro-batches per step: always {low} per rank, "
            f"{per_step.sum() * data['world_size']:,} in all",
            fontsize=10,
        )
        return
    draw_series(ax, per_step.astype(np.float64), "tab:purple", "micro-batches")
    _schedule_ends(ax, summary)
    draw_epoch_lines(ax, data["epoch_starts"])
    ax.set_xlabel("step")
    ax.set_ylabel("micro-batches per rank")
    ax.set_ylim(bottom=0, top=max(1, high) * 1.15 + 0.5)
    ax.set_title(
        f"micro-batches per step: {low}..{high} per rank, {per_step.sum() * data['world_size']:,} in all", fontsize=10
    )


def _shares_panel(ax: Axes, data, summary: dict[str, Any]) -> None:
    """Each source's share of every step's tokens (each epoch's last step left out), and its
    weight as a dashed line of the same colour (with phases, the weight each step is held
    to, and a dotted line where each phase begins)."""
    per_step = data["source_tokens"].astype(np.float64)
    totals = per_step.sum(axis=1)
    shares = np.full(per_step.shape, np.nan)
    held = totals > 0
    shares[held] = per_step[held] / totals[held, None]
    shares[data["last_steps"]] = np.nan
    colors = [f"C{index % 10}" for index in range(per_step.shape[1])]
    phases = summary.get("mixture_phases")
    for index, source in enumerate(summary["mixture"]):
        draw_series(ax, 100 * shares[:, index], colors[index], source["name"])
        if phases:
            ax.plot(100 * data["source_weights"][:, index], color=colors[index], linestyle="--", linewidth=0.8)
        else:
            ax.axhline(100 * source["weight"], color=colors[index], linestyle="--", linewidth=0.8)
    for phase in (phases or [])[1:]:
        if phase["first_step"] is not None:
            ax.axvline(phase["first_step"] - summary.get("first_step", 0), color="black", linestyle=":", linewidth=1.0)
    draw_epoch_lines(ax, data["epoch_starts"])
    ax.set_xlabel("step")
    ax.set_ylabel("% of the step's tokens")
    ax.set_ylim(bottom=0)
    if per_step.shape[1] <= 10:
        ax.legend(loc="upper right", fontsize=7)
    ax.set_title("share of each step, per source (dashed: its weight; epochs' last steps left out)", fontsize=10)


def _schedule_ends(ax: Axes, summary: dict[str, Any]) -> None:
    """Vertical lines where the batch-size ramp-up and the sequence-length warmup end."""
    first = summary.get("first_step", 0)
    for key, color, label in (("rampup", "tab:green", "ramp-up ends"), ("seqlen_warmup", "tab:brown", "warmup ends")):
        end = (summary.get(key) or {}).get("end_step")
        if end is not None:
            ax.axvline(end - first, color=color, linestyle="-.", linewidth=1.0, label=f"{label} (step {end:,})")
    if any((summary.get(key) or {}).get("end_step") is not None for key in ("rampup", "seqlen_warmup")):
        ax.legend(loc="lower right", fontsize=8)


def _summary_panel(ax: Axes, summary: dict[str, Any]) -> None:
    lines = [
        f"samples            {summary['num_samples']:,}",
        f"steps              {summary['num_steps']:,}",
        f"micro-batches      {summary['micro_batches']:,} ({summary['empty_micro_batches']:,} empty)",
        f"tokens             {summary['tokens']:,}",
        f"fill               {format_share(summary['fill'])}",
        f"padding            {format_share(summary['padding_fraction'])}",
        f"token imbalance    {format_share(summary['token_imbalance'])} "
        f"(p99 {format_share(summary['token_imbalance_p99'])}, max {format_share(summary['token_imbalance_max'])})",
    ]
    if summary.get("cost_imbalance") is not None:
        lines.append(
            f"cost imbalance     {format_share(summary['cost_imbalance'])} "
            f"(p99 {format_share(summary['cost_imbalance_p99'])}, "
            f"max {format_share(summary['cost_imbalance_max'])})"
        )
    last = f"epochs' last step  tokens {format_share(summary['token_imbalance_last_step'])}"
    if summary.get("cost_imbalance_last_step") is not None:
        last += f", cost {format_share(summary['cost_imbalance_last_step'])}"
    lines.append(last)
    lines.append(f"dropped samples    {summary['dropped_samples']:,}")
    ax.axis("off")
    ax.text(0.02, 0.95, "\n".join(lines), family="monospace", fontsize=10, va="top", transform=ax.transAxes)
    ax.set_title("summary", fontsize=10)


def _settings_line(plan: OpenedPlan) -> str:
    meta = plan.metadata
    config = meta.get("config", {})
    if config.get("tokens_per_step"):
        steps = f"{config['tokens_per_step']:,} tokens per step"
    else:
        steps = f"{config.get('micro_batches') or 1} micro-batch(es) per rank per step"
    parts = [
        f"{plan.path.name}: {meta['mode']}",
        f"max_tokens {meta['max_tokens']:,}",
        f"world_size {meta['world_size']}",
        steps,
        f"{meta['epochs']} epoch(s)",
        f"seed {meta['seed']}",
        f"oversize {config.get('oversize', '?')}",
    ]
    if meta.get("hidden_size"):
        parts.append(f"hidden_size {meta['hidden_size']:,}")
    elif meta.get("attention_coefficient") is not None:
        parts.append(f"attention coefficient {meta['attention_coefficient']:.3g}")
    return ", ".join(parts)
