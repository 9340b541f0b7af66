"""Completing an epoch's last round (`batchplan.planning.epoch_end`): splitting the largest
micro-batch again and again, with a heap, gives what the plain repeated scan gives."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from batchplan.planning.epoch_end import _halving_point, _split_largest


def split_by_scanning(last, world_size):
    """Split the micro-batch of most tokens with two entries or more (the first in the list
    among equals: it goes, its halves are appended) until there are ``world_size`` or none
    can be split; ``(start, end, tokens)`` in list order."""
    pairs = [(int(start), int(end), lengths) for start, end, lengths in last]
    while len(pairs) < world_size:
        splittable = [i for i, (start, end, _) in enumerate(pairs) if end - start > 1]
        if not splittable:
            break
        largest = max(splittable, key=lambda i: int(pairs[i][2].sum()))
        start, end, lengths = pairs.pop(largest)
        cut = _halving_point(lengths)
        pairs += [(start, start + cut, lengths[:cut]), (start + cut, end, lengths[cut:])]
    return [(start, end, int(lengths.sum())) for start, end, lengths in pairs]


@st.composite
def last_rounds(draw):
    """A last round of micro-batches (ranges of member space with their lengths; many ties)
    and a world size above their number."""
    sizes = draw(st.lists(st.integers(1, 9), min_size=1, max_size=12))
    lengths = draw(st.lists(st.integers(1, 4), min_size=sum(sizes), max_size=sum(sizes)))
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    last = [
        (bounds[i], bounds[i + 1], np.array(lengths[bounds[i] : bounds[i + 1]], dtype=np.int32))
        for i in range(len(sizes))
    ]
    return last, len(sizes) + draw(st.integers(1, 40))


@given(last_rounds())
@example(([(0, 4, np.array([2, 2, 2, 2], dtype=np.int32)), (4, 8, np.array([1, 3, 2, 2], dtype=np.int32))], 7))
@example(([(0, 1, np.array([5], dtype=np.int32))], 3))  # nothing to split
def test_split_largest_is_the_repeated_scan(case):
    last, world_size = case
    assert _split_largest(last, world_size) == split_by_scanning(last, world_size)
