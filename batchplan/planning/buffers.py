"""Where planning allocates its large arrays, and why.

Planning's big arrays (best fit's per-bin arrays, the schedule, the rows, the members)
are written at random positions. numpy allocates them (numba's own allocations are
avoided for these): numpy asks the kernel for transparent huge pages on large
allocations, so scattered writes fault in 2 MiB at a time instead of 4 KiB, which is
much of these passes' cost. Pages that are never written (a bound on the number of
bins that is not reached) are never resident. Arrays whose data is dead once taken
(the schedule after the rows are gathered) are reused as scratch: memory already
faulted in costs less than new.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["new_buffer", "scratch_or_new"]


def new_buffer(shape, dtype) -> NDArray:
    """An uninitialised array for scattered writes (numpy: huge pages, see above)."""
    return np.empty(shape, dtype=dtype)


def scratch_or_new(scratch: NDArray | None, count: int) -> NDArray[np.int64]:
    """``count`` int64 of ``scratch`` if it has them, else a `new_buffer`."""
    if scratch is not None and scratch.dtype == np.int64 and scratch.shape[0] >= count:
        return scratch[:count]
    return new_buffer(count, np.int64)
