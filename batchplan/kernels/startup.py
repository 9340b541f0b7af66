"""numba's one-time start-up, paid on purpose when it suits the caller."""

from __future__ import annotations

from numba import njit

__all__ = ["start_numba"]


@njit(cache=True, nogil=True)
def start_numba():
    """Does nothing. numba's first call of any kernel in a process (even a cached one)
    loads its typing and target registries: ~0.15 s of Python. Calling this one first
    lets a caller pay that while another thread reads input (`batchplan.operations.build`)."""
    return 0
