"""The `batchplan` command: thin typed commands over the library.

Known errors (`BatchPlanError`) print one line and exit 1; set BATCHPLAN_DEBUG=1 for
the traceback. Heavy modules (numba, the planner) are imported inside the commands
so that ``batchplan --help`` stays instant.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from batchplan.errors import BatchPlanError

app = typer.Typer(
    name="batchplan",
    help="Precompile token-capped, rank-balanced, reproducible batch plans for LLM training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _fail_cleanly(command):
    """Turn BatchPlanError into one line on stderr and exit code 1."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (BatchPlanError, OSError) as error:
            # OSError: the environment (permissions, a full disk), not a bug; one line too.
            if os.environ.get("BATCHPLAN_DEBUG"):
                raise
            from rich.console import Console
            from rich.text import Text

            line = Text.assemble(("error: ", "bold red"), str(error))
            Console(stderr=True).print(line, highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper


@app.command()
@_fail_cleanly
def build(
    dataset: Annotated[list[Path], typer.Argument(help="Parquet file(s) or directories of them.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Plan file to write (.arrow).")],
    max_tokens: Annotated[int, typer.Option(help="Token cap per micro-batch (pad: count x longest).")],
    mode: Annotated[str, typer.Option(help="pack (concatenate samples) or pad (pad to the longest).")] = "pack",
    world_size: Annotated[int, typer.Option(help="Data-parallel ranks.")] = 1,
    epochs: Annotated[int, typer.Option(help="Epochs to plan.")] = 1,
    seed: Annotated[int, typer.Option(help="Seed of every shuffle.")] = 0,
    micro_batches: Annotated[Optional[int], typer.Option(help="Micro-batches per rank per step [default: 1].")] = None,
    tokens_per_step: Annotated[Optional[int], typer.Option(help="Global token target per step.")] = None,
    oversize: Annotated[str, typer.Option(help="Samples above max_tokens: error, drop, truncate or split.")] = "error",
    drop_empty: Annotated[bool, typer.Option(help="Drop samples of length 0 or null.")] = False,
    drop_last: Annotated[bool, typer.Option(help="Drop each epoch's incomplete final step.")] = False,
    shuffle_window: Annotated[Optional[int], typer.Option(help="Pad mode: samples sorted within windows of this size.")] = None,
    batch_multiple: Annotated[int, typer.Option(help="Pad mode: samples per micro-batch a multiple of this.")] = 1,
    length_column: Annotated[str, typer.Option(help="Integer column of token counts.")] = "length",
    tokens_column: Annotated[str, typer.Option(help="List column of token ids (when no length column).")] = "input_ids",
    loss_tokens_column: Annotated[Optional[str], typer.Option(help="Integer column: tokens carrying a label.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or summary.")] = False,
) -> None:
    """Read sample lengths and write a plan for every epoch."""
    # SIGTERM unwinds like Ctrl-C, so the half-written temporary file is removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from batchplan.build import build_plan_file
    from batchplan.config import DEFAULT_SHUFFLE_WINDOW, PlanConfig

    config = PlanConfig(
        max_tokens=max_tokens, mode=mode, world_size=world_size, epochs=epochs, seed=seed,
        micro_batches=micro_batches, tokens_per_step=tokens_per_step, oversize=oversize,
        drop_empty=drop_empty, drop_last=drop_last, batch_multiple=batch_multiple,
        shuffle_window=DEFAULT_SHUFFLE_WINDOW if shuffle_window is None else shuffle_window,
    )  # fmt: skip
    columns = {"length_column": length_column, "tokens_column": tokens_column,
               "loss_tokens_column": loss_tokens_column}  # fmt: skip
    if quiet:
        build_plan_file(dataset, output, config, **columns)
        return
    from batchplan_cli.progress import BuildProgress
    from batchplan_cli.render import print_summary

    with BuildProgress() as progress:
        build_plan_file(dataset, output, config, progress=progress, **columns)
    from batchplan.plan_file import open_plan
    from batchplan.summary import summarize_plan

    print_summary(summarize_plan(open_plan(output)), title=f"wrote {output}")


@app.command()
@_fail_cleanly
def inspect(
    plan: Annotated[Path, typer.Argument(help="Plan file.")],
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Summarise a plan: steps, fill, padding, rank imbalance, drops."""
    from batchplan.plan_file import open_plan
    from batchplan.summary import summarize_plan

    summary = summarize_plan(open_plan(plan))
    if json_output:
        import json

        typer.echo(json.dumps(summary, indent=2))
        return
    from batchplan_cli.render import print_summary

    print_summary(summary, title=str(plan))


@app.command()
@_fail_cleanly
def validate(
    plan: Annotated[Path, typer.Argument(help="Plan file.")],
    dataset: Annotated[
        Optional[list[Path]], typer.Option("--dataset", "-d", help="The dataset the plan was built for.")
    ] = None,
) -> None:
    """Re-check every guarantee of a plan; exit 1 on any violation."""
    from batchplan.build import validate_plan_file

    violations, checked = validate_plan_file(plan, dataset)
    if violations:
        for violation in violations:
            typer.echo(f"FAIL {violation}", err=True)
        typer.echo(f"{plan}: {len(violations)} guarantee(s) violated", err=True)
        raise typer.Exit(1)
    against = "against the dataset" if dataset else "without the dataset (pass --dataset for the full check)"
    typer.echo(f"{plan}: OK, every guarantee holds ({checked}, {against})")


def main() -> None:
    """Console-script entry point."""
    app(prog_name="batchplan")


if __name__ == "__main__":
    sys.exit(main())
