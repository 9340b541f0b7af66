"""A large mixture's build holds less and plans the same plan: where its run has
`DRAW_AGAIN_FROM_USES` uses or more, each part's samples are drawn again from their seeds when
its members are laid out (no sample per use held), and where an epoch has `COMPRESS_FROM_ENTRIES`
entries or more, every part's bins are compressed while the epoch is composed and scheduled and
packed again to be laid out (`batchplan.planning.parted_bins`). Here both thresholds are set
to 1, so that small mixtures take those paths: the plan files are byte for byte those of the
default build, in every configuration the mixture's paths branch on (pack and pad, a
loss-tokens column, spans and drops, several epochs, phases, compute balance, a ramp-up,
drop_last, a sequence-length warmup, a plan directory, a re-planned continuation). The draws
they rest on are checked on their own: a selection's order drawn again
(`SourceSelection.draw`), a permutation's prefix (`PermutedPrefix`), and whole passes in
sample order read as ranges, never written (`MixtureEntries.chunk_samples`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchplan import PlanConfig
from batchplan.formats.mixture_file import read_mixture, read_mixture_lengths
from batchplan.formats.opening import open_plan
from batchplan.mixture import Mixture, MixtureSource
from batchplan.operations.build_mixture import build_mixture_plan_file
from batchplan.operations.replan_mixture import replan_mixture_file
from batchplan.planning import mixture_entries, mixture_epochs, parted_bins
from batchplan.planning.epoch_batches import EpochBatches
from batchplan.planning.forming import form_micro_batches
from batchplan.planning.mixture_entries import prepare_mixture_entries
from batchplan.planning.mixture_sizing import SourceResume, draw_sources, select_sources
from batchplan.planning.parted_bins import CompressedBins, PartedBins, RowMembers
from batchplan.planning.randomness import PermutedPrefix, permute

SOURCES = {"s0": (3000, 0.3), "s1": (700, 0.2), "s2": (12_000, 0.4), "s3": (90, 0.1)}
PHASES = [{"from_tokens": 3_000_000, "weights": {"s0": 0.5, "s1": 0.0, "s2": 0.2, "s3": 0.3}}]

CASES = {
    "pack": dict(max_tokens=2048, world_size=4, micro_batches=2),
    "loss-column": dict(max_tokens=2048, world_size=4, micro_batches=2),
    "epochs-token-steps": dict(max_tokens=2048, world_size=8, tokens_per_step=100_000, epochs=3),
    "compute": dict(max_tokens=2048, world_size=3, micro_batches=1, hidden_size=1024, balance="compute", epochs=2),
    "rampup": dict(max_tokens=2048, world_size=4, micro_batches=4, rampup_start=4 * 2048, rampup_tokens=2_000_000),
    "truncate": dict(max_tokens=1024, world_size=4, micro_batches=2, oversize="truncate"),
    "split": dict(max_tokens=1024, world_size=4, micro_batches=2, oversize="split", epochs=2),
    "drop": dict(max_tokens=1024, world_size=4, micro_batches=2, oversize="drop"),
    "pad": dict(max_tokens=2048, mode="pad", world_size=4, micro_batches=2),
    "drop-last": dict(max_tokens=2048, world_size=4, micro_batches=3, drop_last=True),
    "warmup": dict(max_tokens=2048, world_size=4, micro_batches=2, seqlen_warmup_min=128, seqlen_warmup_tokens=10**6),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """Four sources of lognormal lengths up to 2,048 (with a loss-tokens column), and two
    mixtures of them, the second with a phase."""
    directory = tmp_path_factory.mktemp("sources")
    rng = np.random.default_rng(0)
    for name, (size, _) in SOURCES.items():
        lengths = np.clip(rng.lognormal(5, 1, size), 1, 2048).astype(np.int32)
        pq.write_table(pa.table({"length": lengths, "loss": np.maximum(lengths - 3, 0)}), directory / f"{name}.parquet")
    spec = {
        "sources": [
            {"name": name, "paths": [f"{name}.parquet"], "weight": weight} for name, (_, weight) in SOURCES.items()
        ],
        "tokens": 5_000_000,
    }
    (directory / "mixture.json").write_text(json.dumps(spec))
    (directory / "phases.json").write_text(json.dumps({**spec, "phases": PHASES}))
    return directory


@pytest.fixture
def at_scale(monkeypatch):
    """The paths of a large mixture for any mixture: samples drawn again, parts compressed."""
    monkeypatch.setattr(mixture_entries, "DRAW_AGAIN_FROM_USES", 1)
    monkeypatch.setattr(mixture_epochs, "COMPRESS_FROM_ENTRIES", 1)
    monkeypatch.setattr(parted_bins, "COMPRESS_FROM_ENTRIES", 1)


def _build(sources: Path, mixture: str, case: str, output: Path, **options) -> Path:
    loss = "loss" if case == "loss-column" else None
    build_mixture_plan_file(sources / mixture, output, PlanConfig(**CASES[case]), loss_tokens_column=loss, **options)
    return output


@pytest.mark.parametrize("mixture", ["mixture.json", "phases.json"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_large_mixtures_paths_plan_the_same_plan(sources, tmp_path, monkeypatch, mixture, case):
    want = _build(sources, mixture, case, tmp_path / "default.arrow").read_bytes()
    monkeypatch.setattr(mixture_entries, "DRAW_AGAIN_FROM_USES", 1)
    monkeypatch.setattr(mixture_epochs, "COMPRESS_FROM_ENTRIES", 1)
    monkeypatch.setattr(parted_bins, "COMPRESS_FROM_ENTRIES", 1)
    assert _build(sources, mixture, case, tmp_path / "at_scale.arrow").read_bytes() == want


@pytest.mark.parametrize("case", ["pack", "epochs-token-steps", "warmup", "pad"])
def test_a_mixtures_plan_does_not_depend_on_the_number_of_threads(sources, tmp_path, monkeypatch, case):
    """A packed epoch's parts are formed side by side on the build's threads and written into
    member space a part a thread; one thread or several, the same bytes."""
    files = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("BATCHPLAN_THREADS", threads)
        files.append(_build(sources, "phases.json", case, tmp_path / f"plan-{threads}.arrow").read_bytes())
    assert files[0] == files[1] == files[2]


def test_a_large_mixtures_plan_directory_is_the_default_ones(sources, tmp_path, monkeypatch):
    def epoch_files(directory: Path) -> list[bytes]:
        return [path.read_bytes() for path in sorted(directory.glob("epoch-*.arrow"))]

    want = epoch_files(_build(sources, "phases.json", "epochs-token-steps", tmp_path / "default", layout="directory"))
    monkeypatch.setattr(mixture_entries, "DRAW_AGAIN_FROM_USES", 1)
    monkeypatch.setattr(mixture_epochs, "COMPRESS_FROM_ENTRIES", 1)
    monkeypatch.setattr(parted_bins, "COMPRESS_FROM_ENTRIES", 1)
    got = epoch_files(_build(sources, "phases.json", "epochs-token-steps", tmp_path / "at_scale", layout="directory"))
    assert len(want) == 3 and got == want


@pytest.mark.parametrize(
    ("case", "drawn_again"),
    [
        ("pack", True),
        ("loss-column", True),
        ("truncate", False),
        ("drop", False),
        ("pad", False),
        ("drop-last", False),
        ("warmup", False),
    ],
)
def test_samples_are_drawn_again_where_each_use_is_one_packed_entry(sources, at_scale, case, drawn_again):
    """Uses one entry each and packed: members are the samples, drawn again (none held);
    truncated spans, drops, pad mode, drop_last or a warmup (which name samples): each entry
    keeps its sample."""
    mixture = read_mixture(sources / "mixture.json")
    read = read_mixture_lengths(mixture, loss_tokens_column="loss" if case == "loss-column" else None)
    prepared = prepare_mixture_entries(
        mixture, read.lengths, read.offsets, PlanConfig(**CASES[case]), loss_tokens=read.loss_tokens
    )
    assert prepared.members_are_samples == drawn_again
    assert prepared.uses is None and (prepared.entries.sample is None) == drawn_again


def test_a_replanned_continuation_at_scale_is_the_default_one(sources, tmp_path, monkeypatch):
    """Sources resumed part-way through a pass (their orders begin with the rest of it) draw
    that rest again as they drew it."""
    config = PlanConfig(max_tokens=2048, world_size=2, micro_batches=2, epochs=2, seed=7)
    parent = tmp_path / "parent.arrow"
    build_mixture_plan_file(sources / "mixture.json", parent, config)
    from_step = open_plan(parent).num_steps * 3 // 5
    want = tmp_path / "default.arrow"
    replan_mixture_file(parent, want, sources / "phases.json", from_step=from_step)
    monkeypatch.setattr(mixture_entries, "DRAW_AGAIN_FROM_USES", 1)
    monkeypatch.setattr(mixture_epochs, "COMPRESS_FROM_ENTRIES", 1)
    monkeypatch.setattr(parted_bins, "COMPRESS_FROM_ENTRIES", 1)
    got = tmp_path / "at_scale.arrow"
    replan_mixture_file(parent, got, sources / "phases.json", from_step=from_step)
    assert got.read_bytes() == want.read_bytes()


def test_a_selection_draws_any_pass_of_its_order_again():
    """Positions inside the head (a resumed pass), a whole pass or the partial one, drawn
    again, are the order's own."""
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 50, 700).astype(np.int32)
    offsets = np.array([0, 300, 700])
    left = rng.random(300) < 0.4
    for tokens, resume in [
        (50_000, None),
        (50_000, {"a": SourceResume(pass_index=2, left=left)}),
        (1_000, {"a": SourceResume(pass_index=2, left=left)}),
    ]:
        mixture = Mixture(
            sources=(
                MixtureSource(name="a", paths=("x",), weight=0.7),
                MixtureSource(name="b", paths=("x",), weight=0.3),
            ),
            tokens=tokens,
        )
        drawn = [
            *select_sources(mixture, lengths, offsets, seed=9, resume=resume),
            *draw_sources(mixture, lengths, offsets, seed=9, resume=resume, shuffled=False),
        ]
        for selection in drawn:
            order, count = selection.order, selection.num_samples
            assert selection.num_uses == order.shape[0] > 0
            cuts = [0, selection.head] + list(range(selection.head + count, order.shape[0], count)) + [order.shape[0]]
            for first, last in [(first, last) for first, last in zip(cuts[:-1], cuts[1:]) if last > first]:
                for at, stop in [(first, last), (first + (last - first) // 3, last - 1), (last - 1, last)]:
                    if stop > at:
                        drawn = selection.draw(at, stop, 9, order.dtype)
                        assert drawn.tolist() == order[at:stop].tolist()


@pytest.mark.parametrize("count", [1, 5, 1000, 70_000, 600_000])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_permuted_prefix_is_the_permutations_prefix(count, threads):
    values = np.arange(count, dtype=np.int64)[::-1] * 3
    want, want_carried = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64)
    permute(np.random.default_rng(count), want, 11, values=values, carried=want_carried, threads=threads)
    got, carried = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64)
    prefix = PermutedPrefix(np.random.default_rng(count), got, 11, values=values, carried=carried, threads=threads)
    for position in (0, count // 7, count // 7, count // 2, count):
        ready = prefix.extend(position)
        assert ready >= position
        assert got[:ready].tolist() == want[:ready].tolist()
        assert carried[:ready].tolist() == want_carried[:ready].tolist()
    assert prefix.ready == count


@pytest.mark.parametrize("seed", range(4))
def test_compressed_parts_hold_and_lay_out_what_the_parts_hold(seed):
    """`PartedBins` of compressed parts (`CompressedBins`, packed again when needed) against the same
    parts kept: tokens, sums, ranges, a gather, and the members laid out (into member space,
    read back in row order, `RowMembers`), a few at a time and all at once; with values in
    place of entry ids too."""
    rng = np.random.default_rng(seed)
    config = PlanConfig(max_tokens=300)
    parts = [np.clip(rng.lognormal(4, 1, int(rng.integers(1, 400))), 1, 300).astype(np.int32) for _ in range(4)]
    bases = np.concatenate([[0], np.cumsum([part.shape[0] for part in parts])])

    def formed():
        draw = np.random.default_rng(seed + 100)
        return [form_micro_batches(part, config, draw).layout for part in parts]

    values = [lambda threads, part=part: np.arange(part.shape[0], dtype=np.int32) * 5 for part in parts]
    kept = EpochBatches.of_bins(PartedBins(formed(), bases[:-1].tolist(), int(bases[-1]), values=values))
    compressed = EpochBatches.of_bins(
        PartedBins([CompressedBins(layout) for layout in formed()], bases[:-1].tolist(), int(bases[-1]), values=values)
    )
    split = int(np.flatnonzero(np.diff(kept.layout.offsets) >= 2)[0])
    start, end = int(kept.starts[split]), int(kept.ends[split])
    for batches in (kept, compressed):
        batches.extend(np.array([[start, start + 1], [start + 1, end]]), np.array([0, 0]))
    np.testing.assert_array_equal(compressed.tokens(), kept.tokens())
    sums = np.arange(int(bases[-1]), dtype=np.int64) % 7
    np.testing.assert_array_equal(compressed.entry_sums(sums), kept.entry_sums(sums))
    np.testing.assert_array_equal(compressed.length_sums(lambda x: x * x), kept.length_sums(lambda x: x * x))
    some = rng.integers(0, kept.count, 5)
    assert [m.tolist() for m, _ in compressed.ranges(some)] == [m.tolist() for m, _ in kept.ranges(some)]
    order = np.array([k for k in rng.permutation(kept.count) if k != split], dtype=np.int64)
    sizes = (kept.ends - kept.starts)[order].astype(np.int64)
    assert [a.tolist() for a in compressed.gather(order, sizes)] == [a.tolist() for a in kept.gather(order, sizes)]
    want = kept.lay_out(kept.destinations(order, sizes)).all()
    got = compressed.lay_out(compressed.destinations(order, sizes))
    assert isinstance(got, RowMembers)
    assert [got.between(first, first + 37).tolist() for first in range(0, got.count, 37)] == [
        want[first : first + 37].tolist() for first in range(0, got.count, 37)
    ]
    assert got.all().tolist() == want.tolist()


def test_a_one_epoch_packed_mixture_reads_its_whole_passes_as_ranges_never_written(sources, monkeypatch):
    """Where every use is one packed entry (one epoch, no warmup, every length within the
    cap), a whole pass in sample order is not written into the uses' samples (a buffer of
    sentinels keeps them there) and `chunk_samples` gives it as the source's range; a partial
    pass is written, and is the prefix of its pass drawn again (`SourceSelection.draw`)."""

    def sentinels(shape, dtype):
        return np.full(shape, np.iinfo(dtype).max, dtype=dtype)

    monkeypatch.setattr(mixture_entries, "new_buffer", sentinels)
    mixture = read_mixture(sources / "mixture.json")
    read = read_mixture_lengths(mixture)
    config = PlanConfig(max_tokens=2048, world_size=4, micro_batches=2)
    prepared = prepare_mixture_entries(mixture, read.lengths, read.offsets, config)
    assert prepared.members_are_samples and prepared.uses is not None
    ranges = 0
    for chunk, source in enumerate(prepared.chunk_source):
        selection = prepared.selections[source]
        first, last = int(prepared.chunk_bounds[chunk]), int(prepared.chunk_bounds[chunk + 1])
        at = int(prepared.chunk_start[chunk])
        got = prepared.chunk_samples(chunk, config.seed)
        held = prepared.uses[first:last]
        if selection.is_range(at):
            ranges += 1
            assert got.tolist() == list(range(selection.offset, selection.offset + selection.num_samples))
            assert (held == np.iinfo(held.dtype).max).all()
        else:
            assert (
                got.tolist() == held.tolist() == selection.draw(at, at + last - first, config.seed, got.dtype).tolist()
            )
    assert ranges >= 2
