"""Human-readable output: the plan summary as a rich table, and its warnings on stderr."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from batchplan.reports.statistics import format_share


def print_summary(summary: dict[str, Any], *, title: str) -> None:
    """Print ``title`` on a line of its own (never wrapped: it may be a path to copy), then
    the `summarize_plan` dict as a two-column table."""
    table = Table(show_header=False)
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
        ("micro-batches per rank per step", _range(micro)),
        ("tokens", f"{summary['tokens']:,} ({summary['loss_tokens']:,} with a label)"),
        ("tokens per step", _tokens_per_step(per_step)),
        ("fill", f"{format_share(summary['fill'])} (steps but each epoch's last)"),
        *_packing(summary),
        ("padding", format_share(summary["padding_fraction"])),
        ("token imbalance", f"{_imbalance(summary, 'token_imbalance')} (steps but each epoch's last)"),
        ("cost imbalance", _cost_imbalance(summary)),
        ("epochs' last step", _last_step(summary)),
        ("dropped samples", _dropped(summary)),
        *_rampup(summary),
        *_seqlen_warmup(summary),
        *_lineage(summary),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console = Console()
    console.print(title, highlight=False, soft_wrap=True)
    console.print(table)
    if summary.get("mixture"):
        console.print(_sources_table(summary["mixture"]))
    if summary.get("mixture_phases"):
        console.print(_phases_table(summary["mixture_phases"]))
    print_warnings(summary)


def _sources_table(sources: list[dict[str, Any]]) -> Table:
    """A mixture's sources: weight, tokens asked and planned (and of those, what drop_last
    drops, when it drops any), passes, and each one's share of the steps (mean, and the
    worst miss against the bound of that step)."""
    table = Table(title="sources (share of each step but each epoch's last)")
    dropped = any(source.get("dropped_tokens") for source in sources)  # drop_last's, of the planned
    names = (
        "source",
        "weight",
        "target",
        "planned",
        *(("dropped",) if dropped else ()),
        "passes",
        "mean share",
        "worst miss",
        "its bound",
    )
    for name in names:
        table.add_column(name, justify="left" if name == "source" else "right")
    for source in sources:
        worst, bound = source["worst_miss"], source["worst_miss_bound"]
        gone = source.get("dropped_tokens")
        table.add_row(
            source["name"],
            format_share(source["weight"], 2),
            f"{source['target_tokens']:,}",
            f"{source['planned_tokens']:,}",
            *(("n/a" if gone is None else f"{gone:,}",) if dropped else ()),
            f"{source['passes']:.3f}",
            format_share(source["mean_share"], 2),
            "n/a" if worst is None else f"{100 * worst:.2f} pp",
            "n/a" if bound is None else f"{100 * bound:.2f} pp",
        )
    return table


def _phases_table(phases: list[dict[str, Any]]) -> Table:
    """A mixture's phases: where each begins (tokens, first step), its tokens, its weights."""
    table = Table(title="phases (weights from their first step on)")
    names = list(phases[0]["weights"])
    for name in ("from tokens", "first step", "tokens", *names):
        table.add_column(name, justify="right")
    for phase in phases:
        first = "n/a" if phase["first_step"] is None else f"{phase['first_step']:,}"
        weights = [format_share(phase["weights"][name], 2) for name in names]
        table.add_row(f"{phase['from_tokens']:,}", first, f"{phase['tokens']:,}", *weights)
    return table


def print_warnings(summary: dict[str, Any]) -> None:
    """One ``warning:`` line on stderr per thing in the `summarize_plan` dict a user must see."""
    idle = summary.get("idle_ranks", 0)
    if idle:
        nonempty = summary["micro_batches"] - summary["empty_micro_batches"]
        Console(stderr=True).print(
            f"warning: {idle} of {summary['world_size']} ranks get no sample: they run only empty micro-batches "
            f"({nonempty:,} non-empty micro-batches for {summary['world_size']} ranks); "
            "build for fewer ranks (--world-size) or on more data",
            highlight=False,
            soft_wrap=True,
        )


def _range(spread: dict[str, Any]) -> str:
    """``min..max`` of a `summarize_plan` spread, one number when they are equal."""
    if spread["min"] is None:
        return "n/a"
    return f"{spread['min']}" if spread["min"] == spread["max"] else f"{spread['min']}..{spread['max']}"


def _tokens_per_step(spread: dict[str, Any]) -> str:
    if spread["mean"] is None:
        return "n/a"
    return f"{spread['mean']:,.0f} (min {spread['min']:,}, max {spread['max']:,})"


def _imbalance(summary: dict[str, Any], name: str) -> str:
    """``mean, p99, max`` of an imbalance, or "n/a" when no step has one."""
    if summary[name] is None:
        return "n/a"
    mean, p99, top = (format_share(summary[key]) for key in (name, f"{name}_p99", f"{name}_max"))
    return f"{mean} mean, {p99} p99, {top} max"


def _packing(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Pack plans: the micro-batches as packed, and the fewest any packing of the same entries needs."""
    packing = summary.get("packing")
    if packing is None:
        return []
    bound = f"the {packing['kind']} bound: >= {packing['bound']:,}, at most {format_share(packing['bound_fill'])} fill"
    if packing["micro_batches"] <= packing["bound"]:
        return [("packing", f"{packing['micro_batches']:,} micro-batches, the fewest possible ({bound})")]
    extra = packing["micro_batches"] - packing["bound"]
    return [("packing", f"{packing['micro_batches']:,} micro-batches, {extra:,} above {bound}")]


def _last_step(summary: dict[str, Any]) -> str:
    """The end-of-epoch step on its own line: completed by splitting, imbalanced by design."""
    text = f"token imbalance {format_share(summary['token_imbalance_last_step'])}"
    if summary.get("cost_imbalance_last_step") is not None:
        text += f", cost {format_share(summary['cost_imbalance_last_step'])}"
    return text + " (mean over epochs; completed by split and empty micro-batches)"


def _cost_imbalance(summary: dict[str, Any]) -> str:
    if summary.get("attention_coefficient") is None:  # no cost column
        return "- (build with --hidden-size for the compute cost)"
    model = (
        f"hidden size {summary['hidden_size']:,}"
        if summary.get("hidden_size")
        else f"attention coefficient {summary['attention_coefficient']:.3g}"
    )
    return f"{_imbalance(summary, 'cost_imbalance')} ({model}, balanced by {summary['balance']})"


def _rampup(summary: dict[str, Any]) -> list[tuple[str, str]]:
    ramp = summary.get("rampup")
    if not ramp:
        return []
    target = (
        f"{ramp['target']:,} tokens"
        if ramp.get("target") is not None
        else f"{ramp.get('micro_batches')} micro-batch(es) per rank"
    )
    end = "lasts beyond the plan" if ramp["end_step"] is None else f"ends at step {ramp['end_step']:,}"
    last = "-" if ramp["last_ramp_step_tokens"] is None else f"{ramp['last_ramp_step_tokens']:,}"
    after = "" if ramp["tokens_per_step_after"] is None else f", then {ramp['tokens_per_step_after']:,.0f} mean"
    rows = [
        (
            "ramp-up",
            f"steps grow from {ramp['start_tokens']:,} tokens to {target} over the run's first "
            f"{ramp['ramp_tokens']:,} tokens",
        ),
        (
            "ramp-up steps",
            f"{ramp['steps_in_ramp']:,} steps of {ramp['first_step_tokens']:,} .. {last} tokens; the ramp {end}{after}",
        ),
    ]
    if ramp["first_step_tokens"] < ramp["start_tokens"]:
        rows.append(
            (
                "first step",
                f"{ramp['first_step_tokens']:,} tokens, below {ramp['start_tokens']:,}: a step "
                "holds whole chunks (one micro-batch per rank), as many as bring its tokens "
                "nearest its target, so it may fall short by up to half a chunk",
            )
        )
    return rows


def _seqlen_warmup(summary: dict[str, Any]) -> list[tuple[str, str]]:
    warmup = summary.get("seqlen_warmup")
    if not warmup:
        return []
    end = "beyond the plan" if warmup["end_step"] is None else f"at step {warmup['end_step']:,}"
    first = "" if warmup["first_step_longest"] is None else f"; longest in step 0: {warmup['first_step_longest']:,}"
    return [
        (
            "sequence-length warmup",
            f"cap {warmup['min_tokens']:,} -> {warmup['max_tokens']:,} over "
            f"{warmup['warmup_tokens']:,} tokens, ends {end}{first}",
        )
    ]


def _lineage(summary: dict[str, Any]) -> list[tuple[str, str]]:
    parent = summary.get("resharded_from")
    if not parent:
        return []
    return [("resharded from", f"step {summary.get('first_step', 0):,} of a {parent.get('world_size')}-rank plan")]


def _dropped(summary: dict[str, Any]) -> str:
    if not summary["dropped_samples"]:
        return "0"
    parts = ", ".join(f"{count:,} {reason}" for reason, count in summary["dropped"].items())
    return f"{summary['dropped_samples']:,} ({parts})"


def print_comparison(comparison: dict[str, Any], *, hidden_size_given: bool) -> None:
    """Print a `Comparison.to_dict()` as one table, the settings in its caption."""
    from rich import box

    table = Table(
        title=f"{comparison['num_samples']:,} samples, one epoch per strategy",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    table.add_column("strategy", no_wrap=True)
    for name in ("micro-\nbatches", "steps", "padding", "fill", "token\nimbal.", "cost\nimbal.", "rel.\ntime"):
        table.add_column(name, justify="right", no_wrap=True)
    for i, row in enumerate(comparison["strategies"]):
        table.add_row(
            f"{i + 1} {_SHORT_NAMES.get(row['name'], row['name'])}",
            f"{row['micro_batches']:,}",
            f"{row['steps']:,}",
            format_share(row["padding_fraction"], 2),
            format_share(row["fill"], 2),
            format_share(row["token_imbalance"], 2),
            format_share(row["cost_imbalance"], 2),
            f"{row['relative_time']:.2f}",
        )
    console = Console()
    console.print(table)
    console.print(_comparison_notes(comparison, hidden_size_given), highlight=False)


_SHORT_NAMES = {
    "pytorch": "PyTorch",
    "hf_grouped": "HF grouped",
    "fairseq": "fairseq",
    "batchplan_pad": "batchplan pad",
    "batchplan_pack": "batchplan pack",
}


def _comparison_notes(c: dict[str, Any], hidden_size_given: bool) -> str:
    hidden = f"{c['hidden_size']:,}" + ("" if hidden_size_given else " (default; set --hidden-size)")
    dropped = f", {c['dropped_samples']:,} dropped" if c["dropped_samples"] else ""
    n = c["baseline_batch_size"]
    return "\n".join(
        [
            f"Same memory: every micro-batch fits max_tokens {c['max_tokens']:,} tokens.",
            f"1 PyTorch DataLoader(shuffle=True): random order, n = max_tokens // longest = {n} sample(s), padded.",
            f"2 HF group_by_length: random megabatches of up to 50 x {n}, sorted by length, cut every {n}, padded.",
            "3 fairseq --max-tokens: sorted by length, greedy count x longest <= max_tokens, batches shuffled.",
            "4 batchplan --mode pad (count x longest <= max_tokens); 5 --mode pack (sum <= max_tokens).",
            f"Steps: {c['world_size']} rank(s) x {c['micro_batches']} micro-batch(es); 1-3 deal micro-batches to "
            "ranks round-robin (DistributedSampler), 4-5 as planned.",
            "Fill and imbalance (mean over steps of max / mean over ranks - 1): every step but the epoch's last.",
            "Epoch time: sum over steps of the slowest rank's cost (computed tokens + L^2 / (12 h) per sequence, "
            f"h = {hidden}), relative to 1.",
            f"Oversize: {c['oversize_samples']:,} sample(s) above max_tokens, --oversize {c['oversize']}{dropped}.",
            *_bound_note(c.get("packing_bound")),
        ]
    )


def _bound_note(bound: dict[str, Any] | None) -> list[str]:
    if bound is None:
        return []
    return [
        f"Packing bound ({bound['kind']}): any packing of these entries needs >= {bound['micro_batches']:,} "
        f"micro-batches, at most {bound['fill']:.3%} fill."
    ]


def print_built(output: Path, written: dict) -> None:
    """The summary of the plan written, or which epochs a plan directory still misses."""
    if "missing_epochs" in written:
        missing = written["missing_epochs"]
        print(
            f"wrote part of the plan directory {output}; epochs {', '.join(map(str, missing))} are still missing: "
            "build them with the same command and --only-epochs (the last build writes the manifest)"
        )
        return
    from batchplan.formats.opening import open_plan
    from batchplan.reports.summary import summarize_plan

    print_summary(summarize_plan(open_plan(output)), title=f"wrote {output}")
