"""Rich progress bars for `batchplan build`, one bar per stage, shown only when stderr is a terminal."""

from __future__ import annotations

from collections.abc import Callable

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


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

    def __enter__(self) -> BuildProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)

    def stage(self, description: str, total: int | None) -> Callable[[int], None]:
        task = self._progress.add_task(description, total=total)
        return lambda n: self._progress.advance(task, n)
