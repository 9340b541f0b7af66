"""How a command fails: a known error (`BatchPlanError`, or the environment's `OSError`) prints
one line, its library parameters written as this command's options (`batchplan_cli.flags`), and
exits 1 (BATCHPLAN_DEBUG=1: the traceback); SIGTERM unwinds as Ctrl-C does."""

from __future__ import annotations

import functools
import os
import signal
import sys

import typer

from batchplan.errors import BatchPlanError

from .flags import to_cli_words

__all__ = ["fail_cleanly", "unwind_on_sigterm"]


def unwind_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so a half-written temporary plan file is removed."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def fail_cleanly(command):
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

            line = Text.assemble(("error: ", "bold red"), to_cli_words(str(error)))
            Console(stderr=True).print(line, highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper
