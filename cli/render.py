"""Human-readable output: the plan summary as a rich table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def print_summary(summary: dict[str, Any], *, title: str) -> None:
    """Print the `summarize_plan` dict as a two-column table."""
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("", justify="right")
    per_step = summary["tokens_per_step"]
    micro = summary["micro_batches_per_rank_per_step"]
    rows = [
        ("samples", f"{summary['num_samples']:,}"),
        ("mode", summary["mode"]),
        ("max tokens", f"{summary['max_tokens']:,}"),
        ("world size", f"{summary['world_size']}"),
        ("epochs", f"{summary['num_epochs']}"),
        ("steps", f"{summary['num_steps']:,} ({', '.join(f'{s:,}' for s in summary['steps_per_epoch'])} per epoch)"),
        ("micro-batches", f"{summary['micro_batches']:,} ({summary['empty_micro_batches']:,} empty)"),
        ("micro-batches per rank per step", f"{micro['min']}..{micro['max']}"),
        ("tokens", f"{summary['tokens']:,} ({summary['loss_tokens']:,} with a label)"),
        ("tokens per step", f"{per_step['mean']:,.0f} (min {per_step['min']:,}, max {per_step['max']:,})"),
        ("fill", f"{summary['fill']:.3%}"),
        ("padding", f"{summary['padding_fraction']:.3%}"),
        ("token imbalance", f"{summary['token_imbalance']:.3%} mean, {summary['token_imbalance_p99']:.3%} p99"),
        ("dropped samples", _dropped(summary)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def _dropped(summary: dict[str, Any]) -> str:
    if not summary["dropped_samples"]:
        return "0"
    parts = ", ".join(f"{count:,} {reason}" for reason, count in summary["dropped"].items())
    return f"{summary['dropped_samples']:,} ({parts})"
