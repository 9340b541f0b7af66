"""The bin of each slot, run-length encoded (`batchplan.kernels.slot_runs`, `PackedBins.compress`):
decoding gives back exactly what was encoded, in as many parts as encoded it, and the runs are
those of a plain loop over each part's share."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchplan.kernels.slot_runs import MAX_RUN, decode_runs
from batchplan.planning import slot_runs
from batchplan.planning.slot_runs import SlotRuns


def reference_runs(values: list[int], parts: int) -> list[tuple[int, int]]:
    """(value, length) of each run, a run cut at each part's end and at `MAX_RUN` slots."""
    runs: list[tuple[int, int]] = []
    for part in range(parts):
        low, high = len(values) * part // parts, len(values) * (part + 1) // parts
        for slot in range(low, high):
            if slot > low and values[slot] == values[slot - 1] and runs[-1][1] < MAX_RUN:
                runs[-1] = (values[slot], runs[-1][1] + 1)
            else:
                runs.append((values[slot], 1))
    return runs


slot_bins = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), max_size=60).map(
    lambda pairs: np.repeat([value for value, _ in pairs], [count for _, count in pairs]).astype(np.int32)
)


@given(slot_bin=slot_bins, parts=st.integers(1, 9), threads=st.integers(1, 3))
def test_runs_are_those_of_each_part_and_decode_to_the_bins(slot_bin, parts, threads):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(slot_runs, "SLOT_RUN_PARTS", parts)
        runs = SlotRuns.encode(slot_bin, threads)
    got = [(int(value), int(length)) for bins_, lengths in runs.parts for value, length in zip(bins_, lengths)]
    assert got == reference_runs(slot_bin.tolist(), parts)
    assert len(runs.parts) == parts
    decoded = runs.decode()
    assert decoded.tolist() == slot_bin.tolist()
    assert decoded.dtype == slot_bin.dtype
    assert runs.parts == [None] * parts  # each part's runs freed once decoded


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_a_run_longer_than_a_uint16_is_cut(dtype):
    slot_bin = np.concatenate([np.full(MAX_RUN + 10, 7), np.full(3, 2), np.full(MAX_RUN, 7)]).astype(dtype)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(slot_runs, "SLOT_RUN_PARTS", 1)
        runs = SlotRuns.encode(slot_bin, 1)
    run_bin, run_length = runs.parts[0]
    assert run_length.tolist() == [MAX_RUN, 10, 3, MAX_RUN]
    assert run_bin.tolist() == [7, 7, 2, 7]
    assert np.array_equal(runs.decode(), slot_bin)


def test_runs_holding_more_than_the_share_write_nothing_past_it():
    """Decoding checks each run against its share's end: runs of another array are refused."""
    out = np.full(5, -9, dtype=np.int32)
    run_bin, run_length = np.array([1, 2], dtype=np.int32), np.array([3, 3], dtype=np.uint16)
    assert decode_runs(run_bin, run_length, out[:4], 0, 1) == -1
    assert out[4] == -9
