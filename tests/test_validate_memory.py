"""`check_plan` holds one rank's rows at a time and about one byte per sample, and its rank-by-rank
coverage count (`batchplan.operations.coverage`) reaches the verdict of a whole-epoch count.

The references here are plain Python over a whole epoch: what the checks mean, without the
counter, the second passes or the sorting of pieces only.
"""

from __future__ import annotations

import tracemalloc
from collections import Counter, defaultdict
from collections.abc import Sequence
from itertools import pairwise

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _plan_views import RankReader
from hypothesis import given
from hypothesis import strategies as st

from batchplan import PlanConfig, build_plan_file
from batchplan.formats.opening import open_plan
from batchplan.operations.coverage import EpochCoverage
from batchplan.operations.reshard import reshard_plan_file
from batchplan.operations.validate import check_plan
from batchplan.reduce import add_counts

LENGTHS = np.random.default_rng(3).integers(1, 700, 2_000).astype(np.int32)
LENGTHS[::97] = 2_500  # oversize: split or truncated

CONFIGS = {
    "split": PlanConfig(
        max_tokens=1024,
        world_size=4,
        epochs=2,
        oversize="split",
        micro_batches=2,
        hidden_size=256,
        seqlen_warmup_min=256,
        seqlen_warmup_tokens=100_000,
        drop_last=True,
    ),
    "pad": PlanConfig(max_tokens=1024, mode="pad", world_size=3, epochs=2, oversize="truncate"),
    "pack": PlanConfig(max_tokens=1024, world_size=5, epochs=2, oversize="drop", drop_last=True),
}


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, str]:
    """Each config as a plan file, the split one as a directory and resharded too."""
    root = tmp_path_factory.mktemp("rank-reader")
    pq.write_table(pa.table({"length": LENGTHS}), root / "data.parquet")
    paths = {}
    for name, config in CONFIGS.items():
        paths[name] = str(root / f"{name}.arrow")
        build_plan_file(root / "data.parquet", paths[name], config)
    paths["directory"] = str(root / "directory")
    build_plan_file(root / "data.parquet", paths["directory"], CONFIGS["split"], layout="directory")
    paths["resharded"] = str(root / "resharded.arrow")
    reshard_plan_file(paths["split"], paths["resharded"], world_size=3, from_step=7)
    return paths


@pytest.mark.parametrize("name", ["split", "pad", "pack", "directory", "resharded"])
def test_checks_read_each_rank_at_most_twice_and_never_an_epoch(plans, name):
    """A layout pass and a row pass: with the dataset, a sound plan needs no other read."""
    plan = RankReader(open_plan(plans[name]))
    assert check_plan(plan, LENGTHS) == []
    expected = {(e, r) for e in range(plan.num_epochs) for r in range(plan.world_size)}
    first_epoch = plan.metadata.get("resharded_from", {}).get("epoch", 0)
    assert {key for key in plan.reads if key[0] >= first_epoch} == {key for key in expected if key[0] >= first_epoch}
    assert max(plan.reads.values()) <= 2


@pytest.mark.parametrize("name", ["split", "pad", "directory", "resharded"])
def test_checks_without_the_dataset_use_the_rank_reader_too(plans, name):
    assert check_plan(RankReader(open_plan(plans[name]))) == []


@pytest.mark.parametrize("oversize", ["drop", "split"])
def test_checks_hold_about_one_byte_per_sample(tmp_path, oversize):
    """numpy's allocations (traced) while checking 300,000 samples on 64 ranks: the coverage
    counter (a byte per sample), one rank's rows, the pieces of split samples and about 1 MiB
    for the final scan; a whole epoch's int64 sample indices alone would be 8 bytes per sample."""
    num_samples = 300_000
    lengths = np.random.default_rng(0).integers(1, 600, num_samples).astype(np.int32)
    lengths[::50] = 3_000
    pq.write_table(pa.table({"length": lengths}), tmp_path / "data.parquet")
    config = PlanConfig(max_tokens=1024, world_size=64, oversize=oversize)
    build_plan_file(tmp_path / "data.parquet", tmp_path / "plan.arrow", config)
    plan = open_plan(tmp_path / "plan.arrow")
    tracemalloc.start()
    try:
        assert check_plan(plan, lengths) == []
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < num_samples + 2 * 2**20, f"{peak / num_samples:.1f} bytes per sample"


# -- add_counts -------------------------------------------------------------------------------------


@given(
    st.lists(st.integers(0, 9), max_size=60), st.lists(st.integers(0, 5), min_size=10, max_size=10), st.integers(1, 5)
)
def test_add_counts_counts_every_occurrence_up_to_the_limit(values, before, limit):
    counts = np.minimum(np.array(before), limit).astype(np.uint8)
    expected = [min(int(count) + values.count(i), limit) for i, count in enumerate(counts)]
    add_counts(counts, np.array(values, dtype=np.int32), limit)
    assert counts.tolist() == expected


# -- coverage, rank by rank, against a whole-epoch reference -----------------------------------------


def reference_coverage(case: dict) -> str | None:
    """The first coverage violation of an epoch, from all its entries at once."""
    entries = [entry for rank in case["ranks"] for entry in rank]
    whole, trained, always, last = case["whole"], case["trained"], case["always"], case["last"]
    seen = Counter(e[0] for e in entries) + Counter(whole) + Counter(s for s, _, _ in trained)
    if any(seen[s] for s in always):
        return "a sample listed as dropped is in the plan (or was trained before it)"
    if case["has_spans"]:
        return reference_pieces(case, entries)
    if trained:
        return "pieces of samples are listed as consumed in a plan without spans"
    wrong = [s for s in range(case["num_samples"]) if s not in always and s not in last and seen[s] != 1]
    if wrong:
        return (
            f"{len(wrong):,} samples are not planned exactly once (sample {wrong[0]:,} appears {seen[wrong[0]]} times)"
        )
    if any(seen[s] for s in last):
        return "a sample dropped by drop_last is in the plan (or was trained before it)"
    return None


def reference_pieces(case: dict, entries: list[tuple[int, int, int]]) -> str | None:
    if sorted({s for s, _, _ in case["last_spans"]}) != sorted(set(case["last"])):
        return "drop_last lists other samples than its dropped pieces"
    pieces = entries + case["last_spans"] + case["trained"]
    if any(s in case["whole"] for s, _, _ in pieces):
        return "a sample trained whole before the plan's first step is planned again"
    kept = kept_lengths(case)
    if kept is not None:
        pieces += [(s, 0, kept[s]) for s in case["whole"]]
    pieces.sort(key=lambda piece: piece[:2])  # stable: equal starts keep the plan's order
    if any(a[0] == b[0] and b[1] < a[1] + a[2] for a, b in pairwise(pieces)):
        return "two pieces of a sample overlap"
    of = defaultdict(list)
    for piece in pieces:
        of[piece[0]].append(piece)
    expected = [s for s in range(case["num_samples"]) if s not in case["always"]]
    if kept is None:
        if any(not of[s] and s not in case["whole"] for s in expected):
            return "a sample is neither planned, trained before, nor listed as dropped"
        return None
    if any(start + length > kept[s] for s, start, length in pieces):
        return "a piece reaches past the end of its sample"
    if any(found[0][1] != 0 for found in of.values() if found):
        return "a sample's first piece does not start at token 0"
    wrong = [s for s in expected if sum(length for _, _, length in of[s]) != kept[s]]
    if wrong:
        return f"{len(wrong):,} samples are not covered exactly once (sample {wrong[0]:,})"
    return None


def kept_lengths(case: dict) -> list[int] | None:
    if case["lengths"] is None:
        return None
    return [length if case["cap"] is None else min(length, case["cap"]) for length in case["lengths"]]


@st.composite
def epochs(draw) -> dict:
    """A sound epoch (each sample planned whole or in pieces, dropped, or trained before),
    then a few entries added, removed or moved, dealt to one to three ranks."""
    num_samples = draw(st.integers(1, 9))
    lengths = draw(st.lists(st.integers(0, 6), min_size=num_samples, max_size=num_samples))
    case = {
        "num_samples": num_samples,
        "has_spans": draw(st.booleans()),
        "cap": draw(st.sampled_from([None, 3])),
        "lengths": lengths,
        "whole": [],
        "trained": [],
        "always": [],
        "last": [],
        "last_spans": [],
    }
    kept = kept_lengths(case)
    entries = []
    for sample in range(num_samples):
        fate = draw(st.sampled_from(["planned", "planned", "planned", "always", "last", "whole", "trained"]))
        cuts = sorted(draw(st.sets(st.integers(1, max(1, kept[sample] - 1)), max_size=2))) if case["has_spans"] else []
        bounds = [0, *[c for c in cuts if c < kept[sample]], kept[sample]]
        pieces = [(sample, a, b - a) for a, b in pairwise(bounds)]
        if fate in ("always", "whole", "last"):
            case[fate].append(sample)
        if fate == "last" and case["has_spans"]:
            case["last_spans"] += pieces
        elif fate == "trained" and case["has_spans"]:
            case["trained"] += pieces
        elif fate in ("planned", "trained"):
            entries += pieces
    for _ in range(draw(st.integers(0, 2))):
        entries = mutate(draw, entries, num_samples)
    entries = draw(st.permutations(entries))
    cuts = sorted(draw(st.lists(st.integers(0, len(entries)), max_size=2)))
    case["ranks"] = [entries[a:b] for a, b in zip([0, *cuts], [*cuts, len(entries)])]
    if draw(st.booleans()):
        case["lengths"] = None
    return case


def mutate(draw, entries: list, num_samples: int) -> list:
    kind = draw(st.sampled_from(["add", "remove", "repeat", "shift"]))
    if kind == "add" or not entries:
        sample, start, length = draw(st.integers(0, num_samples - 1)), draw(st.integers(0, 4)), draw(st.integers(0, 4))
        return [*entries, (sample, start, length)]
    index = draw(st.integers(0, len(entries) - 1))
    if kind == "remove":
        return entries[:index] + entries[index + 1 :]
    if kind == "repeat":
        return [*entries, entries[index]]
    sample, start, length = entries[index]
    moved = (sample, max(0, start + draw(st.integers(-2, 2))), max(0, length + draw(st.integers(-2, 2))))
    return [*entries[:index], moved, *entries[index + 1 :]]


def columns(rank: Sequence[tuple[int, int, int]], has_spans: bool):
    samples = np.array([s for s, _, _ in rank], dtype=np.int32)
    if not has_spans:
        return samples, None, None
    return samples, np.array([a for _, a, _ in rank], dtype=np.int64), np.array([n for _, _, n in rank], dtype=np.int32)


@given(epochs())
def test_coverage_rank_by_rank_matches_a_whole_epoch_count(case):
    lengths = None if case["lengths"] is None else np.array(case["lengths"], dtype=np.int32)
    whole = np.zeros(case["num_samples"], dtype=bool)
    whole[case["whole"]] = True
    coverage = EpochCoverage(
        case["num_samples"],
        case["has_spans"],
        lengths,
        None if lengths is None else case["cap"],
        whole if whole.any() else None,
        np.array(case["trained"], dtype=np.int64).reshape(-1, 3),
    )
    ranks = [columns(rank, case["has_spans"]) for rank in case["ranks"]]
    for rank in ranks:
        coverage.add(*rank)
    found = coverage.check(
        np.array(case["always"], dtype=np.int64),
        np.array(case["last"], dtype=np.int64),
        np.array(case["last_spans"], dtype=np.int64).reshape(-1, 3),
        lambda: iter(ranks),
    )
    assert found == reference_coverage(case)
