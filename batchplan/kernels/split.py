"""Work split into parts: kernels that take ``(part, parts)`` do their share, so that
threads can run the parts at once (the kernels release the GIL and the parts write
disjoint places: the result does not depend on how many parts there are)."""

from __future__ import annotations

from numba import njit

__all__ = ["share"]


@njit(cache=True, nogil=True, inline="always")
def share(count, part, parts):
    """Part ``part`` of ``parts`` near-equal consecutive shares of ``range(count)``: ``(first, last)``."""
    return count * part // parts, count * (part + 1) // parts
