"""The `batchplan` command: thin typed commands over the library.

Known errors (`BatchPlanError`) print one line and exit 1, the library's parameters in it
written as this command's options (`batchplan_cli.failing`); set BATCHPLAN_DEBUG=1 for
the traceback. Heavy modules (numba, the planner) are imported inside the commands
so that ``batchplan --help`` stays instant.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from batchplan.config import DEFAULT_BALANCE_WINDOW
from batchplan.errors import ConfigError

from .choices import Balance, Layout, Mode, Oversize
from .failing import fail_cleanly, unwind_on_sigterm
from .flags import to_cli_words

app = typer.Typer(
    name="batchplan",
    help="Precompile token-capped, rank-balanced, reproducible batch plans for LLM training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Click's plain help: options and their values on one line, help text in a column
    # beside them; rich's boxed tables cut long option names at 80 columns.
    rich_markup_mode=None,
)

_DATASET_HELP = (
    "Parquet file(s) or directories of them, s3:// or gs:// URIs of objects or prefixes, "
    "or one folder written by datasets' save_to_disk."
)


@app.command()
@fail_cleanly
def build(
    dataset: Annotated[list[str] | None, typer.Argument(help=_DATASET_HELP + " Or none, with --mixture.")] = None,
    *,  # the required options follow an argument with a default
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Plan to write: a file (.arrow), or a directory (--layout).")
    ],
    max_tokens: Annotated[int, typer.Option(help="Token cap per micro-batch (pad: count x longest).")],
    mixture: Annotated[
        Path | None,
        typer.Option(help="A mixture file (YAML or JSON: sources with weights or epochs) instead of DATASET."),
    ] = None,
    mode: Annotated[Mode, typer.Option(help="pack (concatenate samples) or pad (pad to the longest).")] = Mode.PACK,
    world_size: Annotated[int, typer.Option(help="Data-parallel ranks.")] = 1,
    epochs: Annotated[int, typer.Option(help="Epochs to plan.")] = 1,
    seed: Annotated[int, typer.Option(help="Seed of every shuffle.")] = 0,
    micro_batches: Annotated[int | None, typer.Option(help="Micro-batches per rank per step (default: 1).")] = None,
    tokens_per_step: Annotated[int | None, typer.Option(help="Global token target per step.")] = None,
    oversize: Annotated[
        Oversize, typer.Option(help="Samples above max_tokens: stop with an error, drop, truncate or split them.")
    ] = Oversize.ERROR,
    drop_empty: Annotated[bool, typer.Option("--drop-empty", help="Drop samples of length 0 or null.")] = False,
    drop_last: Annotated[bool, typer.Option("--drop-last", help="Drop each epoch's incomplete final step.")] = False,
    shuffle_window: Annotated[
        int | None, typer.Option(help="Pad mode: samples sorted within windows of this size.")
    ] = None,
    batch_multiple: Annotated[int, typer.Option(help="Pad mode: samples per micro-batch a multiple of this.")] = 1,
    hidden_size: Annotated[int | None, typer.Option(help="Model width: adds the attention term to the cost.")] = None,
    attention_coefficient: Annotated[
        float | None, typer.Option(help="The attention term's coefficient, instead of --hidden-size.")
    ] = None,
    balance: Annotated[
        Balance | None,
        typer.Option(help="Balance ranks by tokens or compute (default: compute with --hidden-size)."),
    ] = None,
    balance_window: Annotated[
        int,
        typer.Option(
            help="Rounds (one micro-batch per rank) of similar cost, formed within this many rounds; 1 = random."
        ),
    ] = DEFAULT_BALANCE_WINDOW,
    rampup: Annotated[
        str | None,
        typer.Option(help="START:TOKENS: global tokens per step grow from START to the full step over TOKENS."),
    ] = None,
    seqlen_warmup: Annotated[
        str | None,
        typer.Option(help="MIN:TOKENS: samples split to a cap growing from MIN to max_tokens over TOKENS tokens."),
    ] = None,
    length_column: Annotated[str, typer.Option(help="Integer column of token counts.")] = "length",
    tokens_column: Annotated[str, typer.Option(help="List column of token ids (when no length column).")] = "input_ids",
    loss_tokens_column: Annotated[str | None, typer.Option(help="Integer column: tokens carrying a label.")] = None,
    layout: Annotated[
        Layout | None,
        typer.Option(help="file: one plan file; directory: a file per epoch, written once planned, and a manifest."),
    ] = None,
    only_epochs: Annotated[
        str | None,
        typer.Option(
            help="START:STOP: plan only these epochs (STOP excluded) into a plan directory; builds of the "
            "other ranges, anywhere, complete it."
        ),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or summary.")] = False,
) -> None:
    """Read sample lengths and write a plan for every epoch."""
    unwind_on_sigterm()
    from batchplan.config import DEFAULT_SHUFFLE_WINDOW, PlanConfig
    from batchplan.operations.build import build_plan_file

    from .parsing import parse_epoch_range, parse_pair

    rampup_start, rampup_tokens = parse_pair("--rampup", "START:TOKENS", rampup)
    warmup_min, warmup_tokens = parse_pair("--seqlen-warmup", "MIN:TOKENS", seqlen_warmup)
    config = PlanConfig(
        max_tokens=max_tokens,
        mode=mode.value,
        world_size=world_size,
        epochs=epochs,
        seed=seed,
        micro_batches=micro_batches,
        tokens_per_step=tokens_per_step,
        oversize=oversize.value,
        drop_empty=drop_empty,
        drop_last=drop_last,
        batch_multiple=batch_multiple,
        hidden_size=hidden_size,
        attention_coefficient=attention_coefficient,
        balance=None if balance is None else balance.value,
        balance_window=balance_window,
        rampup_start=rampup_start,
        rampup_tokens=rampup_tokens,
        seqlen_warmup_min=warmup_min,
        seqlen_warmup_tokens=warmup_tokens,
        shuffle_window=DEFAULT_SHUFFLE_WINDOW if shuffle_window is None else shuffle_window,
    )
    options: dict[str, Any] = {
        "length_column": length_column,
        "tokens_column": tokens_column,
        "loss_tokens_column": loss_tokens_column,
        "layout": None if layout is None else layout.value,
        "only_epochs": parse_epoch_range(only_epochs, epochs),
    }
    if dataset and mixture is None:
        build_file = functools.partial(build_plan_file, dataset)
    elif mixture is not None and not dataset:
        from batchplan.operations.build_mixture import build_mixture_plan_file

        build_file = functools.partial(build_mixture_plan_file, mixture)
    else:
        raise ConfigError("give either DATASET or --mixture (a mixture file names its sources' datasets)")
    if quiet:
        build_file(output, config, **options)
        return
    from .progress import BuildProgress
    from .render import print_built

    with BuildProgress() as progress:
        written = build_file(output, config, progress=progress, **options)
    print_built(output, written)


@app.command(short_help="Summarise a plan; --plot draws it.")
@fail_cleanly
def inspect(
    plan: Annotated[Path, typer.Argument(help="Plan file.")],
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    plot: Annotated[Path | None, typer.Option(help="Also draw the plan into this image (.png/.svg/.pdf).")] = None,
    dataset: Annotated[
        list[str] | None, typer.Option("--dataset", "-d", help="With --plot: draw the dataset's sample lengths.")
    ] = None,
) -> None:
    """Summarise a plan: steps, fill, padding, rank imbalance, drops; --plot draws it."""
    from batchplan.formats.opening import open_plan
    from batchplan.reports.summary import summarize_plan

    opened = open_plan(plan)
    opened.verify()  # inspect reads every row anyway: never summarise a damaged file
    figure = None
    if plot is not None:  # drawn first: a missing matplotlib or a wrong dataset fails before any output
        from batchplan.reports.plot import plan_lengths, plot_plan

        figure = plot_plan(opened, *plan_lengths(opened, dataset))
    summary = summarize_plan(opened)
    if json_output:
        import json

        from .render import print_warnings

        typer.echo(json.dumps(summary, indent=2))
        print_warnings(summary)  # on stderr: the JSON stays clean
    else:
        from .render import print_summary

        print_summary(summary, title=str(plan))
    if figure is not None:
        from batchplan.reports.figure import save_figure

        assert plot is not None  # the figure is drawn only for --plot
        save_figure(figure, plot)
        typer.echo(f"wrote {plot}", err=json_output)


@app.command(short_help="Compare with PyTorch, Hugging Face and fairseq batching.")
@fail_cleanly
def compare(
    dataset: Annotated[list[str], typer.Argument(help=_DATASET_HELP)],
    max_tokens: Annotated[int, typer.Option(help="Memory budget of one micro-batch, in tokens, for every strategy.")],
    world_size: Annotated[int, typer.Option(help="Data-parallel ranks.")],
    micro_batches: Annotated[int, typer.Option(help="Micro-batches per rank per step.")] = 1,
    hidden_size: Annotated[int | None, typer.Option(help="Model width for the attention cost (default: 4096).")] = None,
    oversize: Annotated[
        Oversize, typer.Option(help="Samples above max_tokens: stop with an error, drop, truncate or split them.")
    ] = Oversize.TRUNCATE,
    drop_empty: Annotated[bool, typer.Option("--drop-empty", help="Drop samples of length 0 or null.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of every shuffle.")] = 0,
    length_column: Annotated[str, typer.Option(help="Integer column of token counts.")] = "length",
    tokens_column: Annotated[str, typer.Option(help="List column of token ids (when no length column).")] = "input_ids",
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    plot: Annotated[Path | None, typer.Option(help="Also draw the comparison into this image.")] = None,
) -> None:
    """Compare batchplan pad/pack with PyTorch, Hugging Face and fairseq batching on the same lengths."""
    from batchplan.formats.lengths import read_lengths
    from batchplan.reports.compare import DEFAULT_HIDDEN_SIZE, compare_strategies

    if plot is not None:
        from batchplan.reports.figure import require_matplotlib

        require_matplotlib()
    lengths = read_lengths(dataset, length_column=length_column, tokens_column=tokens_column).lengths
    result = compare_strategies(
        lengths,
        max_tokens=max_tokens,
        world_size=world_size,
        micro_batches=micro_batches,
        hidden_size=DEFAULT_HIDDEN_SIZE if hidden_size is None else hidden_size,
        oversize=oversize.value,
        drop_empty=drop_empty,
        seed=seed,
    )
    if json_output:
        import json

        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        from .render import print_comparison

        print_comparison(result.to_dict(), hidden_size_given=hidden_size is not None)
    if plot is not None:
        from batchplan.reports.figure import save_figure
        from batchplan.reports.plot_compare import plot_comparison

        save_figure(plot_comparison(result), plot)
        typer.echo(f"wrote {plot}", err=json_output)


@app.command()
@fail_cleanly
def validate(
    plan: Annotated[Path, typer.Argument(help="Plan file.")],
    dataset: Annotated[
        list[str] | None, typer.Option("--dataset", "-d", help="The dataset the plan was built for.")
    ] = None,
    mixture: Annotated[
        Path | None, typer.Option(help="The mixture file a mixture's plan was built from, instead of --dataset.")
    ] = None,
) -> None:
    """Re-check every guarantee of a plan; exit 1 on any violation."""
    from batchplan.formats.opening import open_plan
    from batchplan.operations.validate import validate_plan

    if dataset and mixture is not None:
        raise ConfigError("give either --dataset or --mixture")
    opened = open_plan(plan)
    violations = validate_plan(opened, dataset, mixture=mixture)
    checked = f"{opened.num_epochs} epoch(s), {opened.world_size} rank(s)"
    checked += f", {opened.num_samples:,} samples" if dataset or mixture is not None else ""
    if violations:
        for violation in violations:
            typer.echo(f"FAIL {to_cli_words(str(violation))}", err=True)
        typer.echo(f"{plan}: {len(violations)} guarantee(s) violated", err=True)
        raise typer.Exit(1)
    if mixture is not None:
        against = "against the mixture's sources"
    elif dataset:
        against = "against the dataset"
    else:
        against = "without the dataset (pass --dataset or --mixture for the full check)"
    typer.echo(f"{plan}: OK, every guarantee holds ({checked}, {against})")


@app.command(short_help="Re-plan the remaining steps for another world size or another mixture.")
@fail_cleanly
def reshard(
    plan: Annotated[Path, typer.Argument(help="The plan the run trained on (the parent).")],
    from_step: Annotated[int, typer.Option(help="First step of the new plan: optimizer steps done at the checkpoint.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="New plan file to write (.arrow).")],
    world_size: Annotated[
        int | None, typer.Option(help="Data-parallel ranks of the continued run (default: the plan's).")
    ] = None,
    mixture: Annotated[
        Path | None,
        typer.Option(help="Re-plan a mixture's run from --from-step with this mixture file (the whole run's tokens)."),
    ] = None,
    micro_batches: Annotated[
        int | None, typer.Option(help="Micro-batches per rank per step (default: the old step re-divided).")
    ] = None,
    tokens_per_step: Annotated[int | None, typer.Option(help="Global token target per step instead.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No summary.")] = False,
) -> None:
    """Re-plan the steps from --from-step on for another world size (resume with fewer or more
    machines), or, with --mixture, with another mixture (weights changed, sources added or left out)."""
    unwind_on_sigterm()
    if mixture is not None:
        from batchplan.operations.replan_mixture import replan_mixture_file

        metadata = replan_mixture_file(
            plan,
            output,
            mixture,
            from_step=from_step,
            world_size=world_size,
            micro_batches=micro_batches,
            tokens_per_step=tokens_per_step,
        )
    else:
        from batchplan.operations.reshard import reshard_plan_file

        if world_size is None:
            raise ConfigError("give --world-size (ranks of the continued run), --mixture (another mixture), or both")
        metadata = reshard_plan_file(
            plan,
            output,
            world_size=world_size,
            from_step=from_step,
            micro_batches=micro_batches,
            tokens_per_step=tokens_per_step,
        )
    if quiet:
        return
    from batchplan.formats.opening import open_plan
    from batchplan.reports.summary import summarize_plan

    from .render import print_summary

    parent, new = summarize_plan(open_plan(plan)), summarize_plan(open_plan(output))
    print_summary(new, title=f"wrote {output}")
    config = metadata["config"]
    step = (
        f"{config['micro_batches']} micro-batch(es) per rank"
        if config["tokens_per_step"] is None
        else f"a target of {config['tokens_per_step']:,} tokens"
    )
    mean_tokens = new["tokens_per_step"]["mean"], parent["tokens_per_step"]["mean"]
    typer.echo(
        f"steps {from_step:,}.. on {config['world_size']} ranks (was {parent['world_size']}): {step} per step, "
        "{:,.0f} tokens per step on average (was {:,.0f})".format(*mean_tokens)
    )


def main() -> None:
    """Console-script entry point.

    Ends the process with ``os._exit`` once the output is flushed: the interpreter's
    teardown after a build (numba's exit handlers, collecting its type registries) takes
    ~0.2 s and has nothing to do; every file is closed inside its command (a plan is
    written, synced and renamed before the command returns).
    """
    code: str | int | None
    try:
        app(prog_name="batchplan")
        code = 0
    except SystemExit as exit:
        code = exit.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # the reader went away (e.g. `| head`): nothing left to tell it
        pass
    os._exit(code or 0)


if __name__ == "__main__":
    main()
