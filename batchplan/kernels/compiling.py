"""Tells a caller while numba compiles, so that it can say why a first run pauses.

A kernel that numba's cache does not hold (a fresh install, a new numba or Python, a kernel
or a type specialisation no build used before) compiles on its first call: 10–30 s for a
build's kernels on a first run, none once they are cached. This module does not import
numba: a caller adds its watcher before numba is loaded, and `batchplan.kernels.startup`
(which every build imports before planning) forwards numba's ``numba:compile`` events here.
numba compiles under one lock, one kernel at a time (a kernel's callees inside it), so the
watchers see one compilation at a time, on the thread that compiles.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["compilation_ended", "compilation_started", "watch_compilation"]

_watchers: list[Callable[[bool], None]] = []
_depth = 0  # compilations in progress: a kernel's callees compile inside it


@contextmanager
def watch_compilation(on_change: Callable[[bool], None]) -> Iterator[None]:
    """Within the block, ``on_change(True)`` when numba starts compiling and
    ``on_change(False)`` when it is done (a kernel's callees included); nothing while every
    kernel comes from numba's cache."""
    _watchers.append(on_change)
    try:
        yield
    finally:
        _watchers.remove(on_change)


def compilation_started() -> None:
    """numba starts compiling a function (called by `batchplan.kernels.startup`)."""
    global _depth
    _depth += 1
    if _depth == 1:
        for watcher in list(_watchers):
            watcher(True)


def compilation_ended() -> None:
    """numba is done compiling a function, or failed to (called by `batchplan.kernels.startup`)."""
    global _depth
    _depth = max(_depth - 1, 0)
    if _depth == 0:
        for watcher in list(_watchers):
            watcher(False)
