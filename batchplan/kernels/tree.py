"""A counting segment tree over 0..size-1 (leaves at ``size + i``, ``size`` a power of two):
add to a leaf, and find the smallest non-empty leaf at or above one, both O(log size).

Both are inlined into the packing kernels that call them (a few lines each): no kernels of
their own for numba to compile on a first run."""

from __future__ import annotations

from numba import njit

__all__ = ["tree_add", "tree_first_at_least"]


@njit(cache=True, nogil=True, inline="always")
def tree_add(tree, size, leaf, delta):
    node = leaf + size
    while node > 0:
        tree[node] += delta
        node >>= 1


@njit(cache=True, nogil=True, inline="always")
def tree_first_at_least(tree, size, leaf):
    """Smallest leaf index >= ``leaf`` with a non-zero count, or -1."""
    node = leaf + size
    if tree[node] > 0:
        return leaf
    # Climb until a right sibling holds something, then walk down its leftmost path.
    while node > 1:
        if node & 1 == 0 and tree[node + 1] > 0:
            node += 1
            while node < size:
                node = 2 * node if tree[2 * node] > 0 else 2 * node + 1
            return node - size
        node >>= 1
    return -1
