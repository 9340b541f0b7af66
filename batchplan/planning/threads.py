"""How planning uses cores: epochs side by side, and kernels split into parts
(`batchplan.kernels.split`) on threads. Results never depend on the number of threads."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["THREADED_FROM", "epoch_threads", "run_in_parts", "threads_for"]


# Work on fewer items than this runs on one thread (~2^18: a few milliseconds, where starting
# threads costs about as much; a mixture's many small passes and parts).
THREADED_FROM = 1 << 18


def threads_for(items: int, threads: int) -> int:
    """``threads`` for work on ``items`` items, or 1 below `THREADED_FROM`."""
    return threads if items >= THREADED_FROM else 1


def run_in_parts(kernel: Callable[..., Any], threads: int, *args: Any) -> list[Any]:
    """``kernel(*args, part, threads)`` for every part, on ``threads`` threads (the calling
    thread runs part 0: one thread fewer to start); their results in part order. One thread
    calls ``kernel(*args, 0, 1)``."""
    if threads <= 1:
        return [kernel(*args, 0, 1)]
    with ThreadPoolExecutor(max_workers=threads - 1) as pool:
        futures = [pool.submit(kernel, *args, part, threads) for part in range(1, threads)]
        first = kernel(*args, 0, threads)
        return [first] + [future.result() for future in futures]


def epoch_threads(count: int, cores: int) -> tuple[int, list[int]]:
    """How ``count`` epochs share ``cores``: ``(at_once, threads)``, the epochs planned side by
    side and the threads each epoch's kernels split over. Cores left over split the work of
    each epoch, and the epochs of a last, partial wave share all the cores (3 epochs on 2
    cores: 1, 1, then 2 threads)."""
    at_once = max(1, min(count, cores))
    last_wave = count % at_once or at_once
    threads = [max(1, cores // at_once)] * (count - last_wave) + [max(1, cores // last_wave)] * last_wave
    return at_once, threads
