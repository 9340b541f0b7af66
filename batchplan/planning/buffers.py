"""Where planning allocates its large arrays, and why.

Planning's big arrays (best fit's per-bin arrays, the schedule, the rows, the members)
are written at random positions. numpy allocates them (numba's own allocations are
avoided for these): numpy asks the kernel for transparent huge pages on large
allocations, so scattered writes fault in 2 MiB at a time instead of 4 KiB, which is
much of these passes' cost. Pages that are never written (a bound on the number of
bins that is not reached) are never resident.

Where memory peaks, arrays are freed as soon as they are used rather than kept as
scratch: an epoch's final layout writes each slot's place over best fit's bins, and the
members are made only once every other per-entry array is gone
(`batchplan.planning.bins`). A caller's dead array may still serve as scratch
(`scratch_or_new`) where it costs no peak: memory already faulted in costs less than new.
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
