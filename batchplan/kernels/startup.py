"""numba's one-time start-up, paid on purpose when it suits the caller; and word of the
kernels it compiles (`batchplan.kernels.compiling`), from the moment this module is imported."""

from __future__ import annotations

from numba import njit
from numba.core import event

from batchplan.kernels.compiling import compilation_ended, compilation_started

__all__ = ["start_numba"]


class _ForwardCompilation(event.Listener):
    """numba's ``numba:compile`` events (sent only when a function is not in its cache) to
    `batchplan.kernels.compiling`."""

    def on_start(self, _event: event.Event) -> None:
        compilation_started()

    def on_end(self, _event: event.Event) -> None:
        compilation_ended()


event.register("numba:compile", _ForwardCompilation())


@njit(cache=True, nogil=True)
def start_numba():
    """Does nothing. numba's first call of any kernel in a process (even a cached one)
    loads its typing and target registries: ~0.15 s of Python. Calling this one first
    lets a caller pay that while another thread reads input (`batchplan.operations.build`)."""
    return 0
