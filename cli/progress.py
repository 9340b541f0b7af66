"""Rich progress bars for `batchplan build`, one bar per stage, shown only when stderr is a terminal;
and, while numba compiles kernels (a first run), a line that says so."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

# The README demo's kernels compile in ~10 s on 2 shared cores; a busy machine takes twice that
# or more (docs/benchmarks.md, "First run").
COMPILING = "compiling kernels (first run only, 10-30 s)"


class BuildProgress:
    """Implements `batchplan.operations.build.Progress` on a rich display (stderr)."""

    def __init__(self) -> None:
        from rich.console import Console

        console = Console(stderr=True)
        self._progress = Progress(
            TextColumn("{task.description:<16}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,  # bars only on a terminal; elsewhere they leave an empty line
        )
        self._compiling: TaskID | None = None
        self._exit = ExitStack()

    def __enter__(self) -> BuildProgress:
        from batchplan.kernels.compiling import watch_compilation

        self._exit.enter_context(self._progress)
        self._exit.enter_context(watch_compilation(self._show_compiling))
        return self

    def __exit__(self, *exc) -> None:
        self._exit.__exit__(*exc)

    def stage(self, description: str, total: int | None) -> Callable[[int], None]:
        task = self._progress.add_task(description, total=total)
        return lambda n: self._progress.advance(task, n)

    def _show_compiling(self, compiling: bool) -> None:
        """The compiling line, shown while numba compiles (from the thread that compiles)."""
        if self._compiling is None:
            if not compiling:
                return
            self._compiling = self._progress.add_task(COMPILING, total=None)
        else:
            self._progress.update(self._compiling, visible=compiling)
        self._progress.refresh()
