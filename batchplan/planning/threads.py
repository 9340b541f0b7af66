"""Run a kernel that splits into parts (`batchplan.kernels.split`) on threads."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["run_in_parts"]


def run_in_parts(kernel: Callable[..., Any], threads: int, *args: Any) -> list[Any]:
    """``kernel(*args, part, threads)`` for every part, on ``threads`` threads; their results
    in part order. One thread calls ``kernel(*args, 0, 1)``."""
    if threads <= 1:
        return [kernel(*args, 0, 1)]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        futures = [pool.submit(kernel, *args, part, threads) for part in range(threads)]
        return [future.result() for future in futures]
