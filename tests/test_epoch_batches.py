"""`EpochBatches` over packed bins (members laid out lazily) agrees with the same bins laid out.

The planner only ever sees `EpochBatches`; pack mode hands it `PackedBins` and never lays the
members out bin by bin. Every method must give what the materialised form gives, also after
`extend` adds pieces of bins (several pieces of one bin, a whole bin as a piece) and empties,
and laying out once (`lay_out`, which uses the micro-batches up) must give what `gather` gives.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchplan.config import PlanConfig
from batchplan.formats.plan_writer import write_plan
from batchplan.kernels.pack import fill_bins, pack_bins
from batchplan.plan import index_dtype
from batchplan.planning import bins, randomness
from batchplan.planning.bins import PackedBins
from batchplan.planning.epoch_batches import EpochBatches
from batchplan.planning.epochs import build_plan
from batchplan.planning.randomness import KeyStream, permute, shuffle_by_group


def both_forms(lengths: np.ndarray, cap: int, seed: int) -> tuple[EpochBatches, EpochBatches, PackedBins]:
    """The same packing as lazy micro-batches (`PackedBins`: the entries' shuffled order not
    held) and as micro-batches filled from that order (`fill_bins`)."""
    stream = KeyStream.draw_later(np.random.default_rng(seed), lengths.shape[0])
    keys = np.concatenate([np.zeros(0, dtype=np.uint32), *(k for _, k in stream.chunks(0, stream.count, size=7))])
    capacity = int(min(cap, lengths.sum()))
    items = np.empty(lengths.shape[0], dtype=index_dtype(lengths.shape[0]))
    start = shuffle_by_group(lengths, capacity + 1, keys, items)
    slot_bin, offsets, tokens = pack_bins(items, start, capacity)
    members, member_lengths = fill_bins(items, start, slot_bin, offsets, capacity)
    eager = EpochBatches.of_ranges(members, member_lengths, offsets[:-1].astype(np.int64), offsets[1:].astype(np.int64))
    packed = PackedBins(lengths, start, stream, slot_bin, offsets, tokens, capacity)
    assert [a.tolist() for a in packed.members()] == [members.tolist(), member_lengths.tolist()]
    return EpochBatches.of_bins(packed), eager, packed


@st.composite
def packings(draw):
    cap = draw(st.sampled_from([1, 5, 16, 100]))
    lengths = draw(st.lists(st.integers(1, cap), min_size=1, max_size=120))
    return np.array(lengths, dtype=np.int32), cap, draw(st.integers(0, 2**16))


@given(packings(), st.integers(0, 2**16))
def test_packed_micro_batches_agree_with_laid_out_ones(case, seed):
    lengths, cap, key_seed = case
    lazy, eager, packed = both_forms(lengths, cap, key_seed)
    rng = np.random.default_rng(seed)
    offsets, num_bins = packed.offsets, packed.num_bins
    # Pieces: some bins cut into 1-4 pieces (1 = the whole bin as a piece), then empties.
    pairs, cut_bins = [], set()
    for b in rng.choice(num_bins, size=min(num_bins, int(rng.integers(0, 4))), replace=False):
        first, end = int(offsets[b]), int(offsets[b + 1])
        cuts = sorted(set(rng.integers(first, end + 1, int(rng.integers(0, 4))).tolist()) | {first, end})
        pairs += [(s, e) for s, e in zip(cuts[:-1], cuts[1:]) if e > s]
        cut_bins.add(int(b))
    pairs += [(0, 0)] * int(rng.integers(0, 3))
    if pairs:
        p = np.array(pairs, dtype=np.int64)
        tokens = np.array([int(eager.lengths[s:e].sum()) for s, e in pairs], dtype=np.int64)
        assert lazy.extend(p, tokens).tolist() == eager.extend(p, tokens).tolist()
    assert lazy.count == eager.count == num_bins + len(pairs)
    width = 1 / (12 * 7)
    values = rng.integers(0, 9, lengths.shape[0]).astype(np.int32)
    which = rng.permutation(lazy.count)
    # Packed bins count tokens in best fit's own array (int32 below 2^31 entries): the same values.
    assert lazy.tokens().tolist() == eager.tokens().tolist()
    for got, want in [
        (lazy.token_table(), eager.token_table()),
        (lazy.length_sums(lambda x: x + width * x**2), eager.length_sums(lambda x: x + width * x**2)),
        (lazy.entry_sums(values), eager.entry_sums(values)),
        (lazy.members_of(which), eager.members_of(which)),
        (np.stack(lazy.bounds(which)), np.stack([eager.starts[which], eager.ends[which]])),
    ]:
        assert got.dtype == want.dtype and got.tolist() == want.tolist()
    # A layout as the planner makes it: bins that were cut appear only as their pieces.
    order = np.array([k for k in which if k >= num_bins or k not in cut_bins], dtype=np.int64)
    sizes = (eager.ends - eager.starts)[order]
    want = eager.gather(order, sizes)
    for threads in (1, 2, 3):  # laid out in parts on threads: the same
        for got, expected in zip(lazy.gather(order, sizes, threads), want):
            assert got.tolist() == expected.tolist()
    # Scratch memory holding garbage, long enough or not (then unused): the same.
    for scratch in (np.full(lazy.count + 5, 7, dtype=np.int64), np.full(1, 7, dtype=np.int64)):
        for batches in (lazy, eager):
            for got, expected in zip(batches.gather(order, sizes, 2, scratch=scratch), want):
                assert got.tolist() == expected.tolist()
    # Laid out once, emptying the micro-batches (as the planner does): the same.
    for batches in (lazy, eager):
        where = batches.destinations(order, sizes, 2)
        laid = batches.lay_out(where, 2)
        windows = [laid.between(first, first + 3) for first in range(0, laid.count, 3)]  # rank after rank
        members = laid.all()
        assert (where.offsets.tolist(), members.tolist()) == (want[0].tolist(), want[1].tolist())
        assert np.concatenate([members[:0], *windows]).tolist() == members.tolist()
        assert not hasattr(batches, "layout") and members.dtype == want[1].dtype  # the layout was freed


def test_gather_refuses_a_bin_laid_out_whole_and_in_pieces():
    """Pieces only replace bins; a layout holding both would leave members unwritten: refused."""
    lazy, _, packed = both_forms(np.array([3, 3, 2, 1], dtype=np.int32), 4, 0)
    bin_with_two = int(np.flatnonzero(np.diff(packed.offsets) >= 2)[0])
    first = int(packed.offsets[bin_with_two])
    piece = lazy.extend(np.array([[first, first + 1]]), np.array([int(lazy.tokens()[bin_with_two])]))
    order = np.concatenate([np.arange(packed.num_bins), piece])
    with pytest.raises(AssertionError, match="overlapping micro-batches"):
        lazy.gather(order, (lazy.ends - lazy.starts)[order])


@pytest.mark.parametrize("count", [0, 1, 7, 16_384, 40_000, 300_000])
@pytest.mark.parametrize("first", [0, 5])
def test_permute_is_a_permutation_and_reproducible(count, first):
    out = np.empty(count, dtype=np.int32)
    permute(np.random.default_rng(3), out, first)
    assert np.array_equal(np.sort(out), np.arange(first, first + count))
    again = np.empty(count, dtype=np.int32)
    permute(np.random.default_rng(3), again, first)
    assert np.array_equal(out, again)
    for threads in (2, 3):  # the same permutation on any number of threads
        split = np.empty(count, dtype=np.int32)
        permute(np.random.default_rng(3), split, first, threads=threads)
        assert np.array_equal(out, split)
    if count > 1000:  # several groups of ~16,000: still well mixed across the whole range
        other = np.empty(count, dtype=np.int32)
        permute(np.random.default_rng(4), other, first)
        assert not np.array_equal(out, other)
        assert abs(np.corrcoef(np.arange(count), out)[0, 1]) < 0.02


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_permute_does_not_depend_on_how_its_keys_are_read(monkeypatch, threads):
    """The swaps' keys are read a few whole groups at a time: in chunks of 16 keys (one group
    each, ~16,000 items) the permutation and the carried values are the same."""
    count = 70_000
    values = np.arange(count, dtype=np.int32) * 3
    want, want_carried = np.empty(count, dtype=np.int32), np.empty(count, dtype=np.int32)
    permute(np.random.default_rng(5), want, 2, values=values, carried=want_carried)
    monkeypatch.setattr(randomness, "KEY_CHUNK", 16)
    got, carried = np.empty(count, dtype=np.int32), np.empty(count, dtype=np.int32)
    permute(np.random.default_rng(5), got, 2, values=values, carried=carried, threads=threads)
    assert np.array_equal(got, want) and np.array_equal(carried, want_carried)
    assert np.array_equal(carried, values[want - 2])


def test_permute_spreads_every_item_evenly():
    """Where item 0 lands, over many permutations of 65,536 items (4 groups): each eighth of
    the positions about equally often."""
    rng = np.random.default_rng(0)
    hits = np.zeros(8)
    out = np.empty(65_536, dtype=np.int64)
    for _ in range(1600):
        permute(rng, out)
        hits[int(np.flatnonzero(out == 0)[0]) * 8 // out.shape[0]] += 1
    assert np.all(np.abs(hits / 1600 - 1 / 8) < 0.03)


def test_a_window_holds_a_tenth_of_a_large_epoch_and_at_least_2_to_the_26():
    assert bins.members_at_once(10**7) == bins.members_at_once(0) == 1 << 26
    assert bins.members_at_once(10**9) == 100_000_000
    assert bins.members_at_once(10 * (1 << 26) + 1) == (1 << 26) + 1  # never more than 10 passes


@pytest.mark.parametrize("window", [1, 50, 10**9])
def test_members_laid_out_a_window_at_a_time_are_the_members(monkeypatch, tmp_path, window):
    """A packed epoch keeps each slot's place and lays its members out a window at a time
    (`PendingMembers`): ranks read in order, a range read again or out of order, and the
    written plan are the same as with every member laid out at once."""
    lengths = np.random.default_rng(3).integers(1, 700, 6_000).astype(np.uint16)
    config = PlanConfig(max_tokens=1024, world_size=4, epochs=2, oversize="split")
    want = build_plan(lengths, config)
    monkeypatch.setattr(bins, "MEMBERS_AT_ONCE", window)
    monkeypatch.setattr(bins, "MAX_PASSES", 10**12)  # windows of exactly `window`
    got = build_plan(lengths, config)
    for epoch, expected in zip(got.epochs, want.epochs):
        assert isinstance(epoch.member_store, bins.PendingMembers)
        members = expected.members
        per_rank = epoch.offsets[:: epoch.rows_per_rank]
        for start, stop in [*zip(per_rank[:-1], per_rank[1:]), (0, 7), (per_rank[-1] - 3, per_rank[-1])]:
            assert epoch.members_between(int(start), int(stop)).tolist() == members[start:stop].tolist()
    write_plan(want, tmp_path / "at_once.arrow")
    write_plan(got, tmp_path / "windows.arrow")
    assert (tmp_path / "at_once.arrow").read_bytes() == (tmp_path / "windows.arrow").read_bytes()
    assert got.epochs[0].members.tolist() == want.epochs[0].members.tolist()  # all at once, after windows


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"hidden_size": 1024, "drop_last": True, "tokens_per_step": 60_000},
        {"drop_last": True, "tokens_per_step": 40_000, "rampup_start": 10_000, "rampup_tokens": 500_000},
        {"loss": True},
    ],
)
def test_compressed_bins_plan_the_same_plan(monkeypatch, tmp_path, options):
    """A large epoch keeps the bin of each slot run-length encoded while it is scheduled and
    decodes it to lay its members out (`PackedBins.compress`): the plan is byte for byte the one
    made keeping the bins (here every epoch compresses), with cost balance, drop_last, a ramp-up
    and a loss-tokens column."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 900, 8_000).astype(np.uint16)
    options = dict(options)
    loss = rng.integers(0, lengths).astype(np.int32) if options.pop("loss", False) else None
    config = PlanConfig(max_tokens=1024, world_size=4, epochs=2, **options)
    write_plan(build_plan(lengths, config, loss_tokens=loss), tmp_path / "kept.arrow")
    decoded = []
    decode = bins.SlotRuns.decode
    monkeypatch.setattr(bins, "COMPRESS_FROM_ENTRIES", 0)

    def counted(*args, **kwargs):
        decoded.append(1)
        return decode(*args, **kwargs)

    monkeypatch.setattr(bins.SlotRuns, "decode", counted)
    write_plan(build_plan(lengths, config, loss_tokens=loss), tmp_path / "compressed.arrow")
    assert len(decoded) == config.epochs  # once per epoch, to lay the members out
    assert (tmp_path / "kept.arrow").read_bytes() == (tmp_path / "compressed.arrow").read_bytes()
