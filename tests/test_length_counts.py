"""`batchplan.planning.memory.length_counts`, what a build's memory estimate reads of the lengths,
counted a chunk at a time: the same as counting the whole array at once."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchplan.planning import memory


@given(
    lengths=st.lists(st.integers(0, 70_000), max_size=50),
    cap=st.integers(1, 66_000),
    chunk=st.integers(1, 8),
    dtype=st.sampled_from([np.uint16, np.int32, np.int64]),
)
def test_length_counts_in_chunks_equal_the_whole_array(lengths, cap, chunk, dtype):
    values = np.array(lengths, dtype=np.int64)
    if dtype == np.uint16:
        values = np.minimum(values, 65_535)
    values = values.astype(dtype)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory, "COUNT_CHUNK", chunk)
        tokens, big, oversize = memory.length_counts(values, cap)
    assert tokens == int(values.astype(np.int64).sum())
    assert big == int(np.count_nonzero(values > cap // 2))
    assert oversize.dtype == np.int64
    assert oversize.tolist() == values[values > cap].astype(np.int64).tolist()
