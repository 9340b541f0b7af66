"""`PartedBins` (a mixture's parts, each packed on its own, as one layout) against the slow
reference: the parts' members laid out one part after another (`concatenate_parts`)."""

from __future__ import annotations

from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplan import PlanConfig
from batchplan.kernels.segments import gather_rows
from batchplan.planning import bins as bins_module
from batchplan.planning.epoch_batches import EpochBatches
from batchplan.planning.forming import concatenate_parts, form_micro_batches
from batchplan.planning.parted_bins import PartedBins


def _formed(parts_lengths, config, seed):
    rng = np.random.default_rng(seed)
    return [form_micro_batches(lengths, config, rng) for lengths in parts_lengths]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_parted_bins_hold_and_lay_out_what_the_parts_laid_out_one_after_another_hold(data):
    cap = data.draw(st.sampled_from([4, 16, 300]), label="max_tokens")
    parts_lengths = [
        np.array(data.draw(st.lists(st.integers(1, cap), min_size=1, max_size=50)), dtype=np.int32)
        for _ in range(data.draw(st.integers(1, 5), label="parts"))
    ]
    seed = data.draw(st.integers(0, 2**16), label="seed")
    config = PlanConfig(max_tokens=cap)
    sizes = [lengths.shape[0] for lengths in parts_lengths]
    bases = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    total = int(bases[-1])
    parted = EpochBatches.of_bins(
        PartedBins([formed.layout for formed in _formed(parts_lengths, config, seed)], bases[:-1].tolist(), total)
    )
    reference = concatenate_parts(
        [
            (formed, bases[i] + np.arange(sizes[i]), np.arange(formed.count))
            for i, formed in enumerate(_formed(parts_lengths, config, seed))
        ],
        total,
    )
    np.testing.assert_array_equal(parted.starts, reference.starts)
    np.testing.assert_array_equal(parted.ends, reference.ends)
    np.testing.assert_array_equal(parted.tokens(), reference.tokens())

    # Split a micro-batch of two or more entries in two (what completing the last round does).
    splittable = np.flatnonzero(reference.ends - reference.starts >= 2)
    removed = []
    if splittable.size and data.draw(st.booleans(), label="split"):
        which = int(data.draw(st.sampled_from(splittable.tolist()), label="split which"))
        start, end = int(reference.starts[which]), int(reference.ends[which])
        middle = data.draw(st.integers(start + 1, end - 1), label="split at")
        pairs = np.array([[start, middle], [middle, end]], dtype=np.int64)
        tokens = np.array([reference.lengths[start:middle].sum(), reference.lengths[middle:end].sum()])
        for batches in (parted, reference):
            batches.extend(pairs, tokens)
        removed.append(which)
    np.testing.assert_array_equal(parted.tokens(), reference.tokens())

    values = np.arange(total, dtype=np.int64) * 7 % 11
    np.testing.assert_array_equal(parted.entry_sums(values), reference.entry_sums(values))
    np.testing.assert_allclose(
        parted.length_sums(lambda x: x + 0.25 * x**2), reference.length_sums(lambda x: x + 0.25 * x**2), rtol=1e-12
    )
    some = np.array(data.draw(st.lists(st.integers(0, parted.count - 1), max_size=6)), dtype=np.int64)
    for (members, lengths), (want_members, want_lengths) in zip(parted.ranges(some), reference.ranges(some)):
        assert (members.tolist(), lengths.tolist()) == (want_members.tolist(), want_lengths.tolist())
    np.testing.assert_array_equal(parted.members_of(some), reference.members_of(some))

    # Lay out every micro-batch but the split one, in a random order: gather, then a window at a time.
    kept = [k for k in range(parted.count) if k not in removed]
    order = np.array(data.draw(st.permutations(kept), label="order"), dtype=np.int64)
    counts = (reference.ends - reference.starts)[order].astype(np.int64)
    offsets, gathered = parted.gather(order, counts)
    want_offsets, want = reference.gather(order, counts)
    assert (offsets.tolist(), gathered.tolist()) == (want_offsets.tolist(), want.tolist())
    window = data.draw(st.integers(1, max(1, total)), label="window")
    windows = mock.patch.object(bins_module, "MEMBERS_AT_ONCE", window)
    with windows, mock.patch.object(bins_module, "MAX_PASSES", total + 1):
        laid = parted.lay_out(parted.destinations(order, counts))
        step = data.draw(st.integers(1, max(1, total)), label="read step")
        pieces = [laid.between(first, first + step) for first in range(0, laid.count, step)]
    read = np.concatenate([np.zeros(0, dtype=np.int64), *pieces])
    assert read.tolist() == want.tolist()


@given(st.data())
def test_gather_rows_copies_each_rows_range_of_member_space(data):
    """`gather_rows` against a slow reference: every member of a range, row by row, read at
    its row's start in member space (rows in any order there)."""
    sizes = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=30), label="sizes")
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    total = int(offsets[-1])
    placed = data.draw(st.permutations(range(len(sizes))), label="placement")
    row_starts = np.zeros(len(sizes), dtype=np.int64)
    cursor = 0
    for row in placed:  # rows laid in member space in another order
        row_starts[row] = cursor
        cursor += sizes[row]
    space = np.array(data.draw(st.permutations(range(total))), dtype=np.int32) * 3
    start = data.draw(st.integers(0, total), label="start")
    stop = data.draw(st.integers(start, total), label="stop")
    want = [int(space[row_starts[row] + k]) for row in range(len(sizes)) for k in range(sizes[row])][start:stop]
    first = int(np.searchsorted(offsets, start, side="right")) - 1
    last = int(np.searchsorted(offsets, stop, side="left"))
    out = np.full(stop - start, -1, dtype=np.int32)
    gather_rows(space, offsets, row_starts, max(first, 0), last, start, out)
    assert out.tolist() == want
