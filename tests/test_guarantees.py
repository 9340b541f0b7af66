"""DESIGN.md's guarantees, one named test each, over a matrix of plans.

The matrix crosses pack/pad, world sizes 1, 2, 3, 8, 64, steps of 1 or 4
micro-batches or a token target, and drop_last on/off; the dataset, oversize policy,
epochs (1..3), seed, pad window and batch multiple rotate through the combinations.
Datasets: synthetic (lognormal, uniform, heavy tail far above max_tokens, tiny chat
turns, with empty samples) and the real files in data/. Edge cases add one sample on
64 ranks, every length == max_tokens, max_tokens 1, all-equal lengths, fewer
micro-batches than ranks, and drop_last emptying an epoch.

Each plan is built and written once per session; every test reads the file. Every
plan must pass both `check_plan` and the independent `reference.check_guarantees`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import subprocess
import sys
from collections import Counter
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import reference as ref
from conftest import REAL_FILES, build_and_write, dataset_lengths

from batchplan import DatasetError, PlanConfig
from batchplan.formats.opening import open_plan
from batchplan.operations.validate import check_plan
from batchplan.planning.epochs import build_plan

# --------------------------------------------------------------------------- the matrix

MAX_TOKENS = {
    "lognormal": 2048,
    "uniform": 2048,
    "heavy_tail": 1024,
    "chat": 256,
    "with_empty": 2048,
    "squad": 1024,
    "sharegpt_dialogues": 8192,
    "sharegpt_segments": 4096,
}
HAS_OVERSIZE = {"lognormal", "heavy_tail", "with_empty", "sharegpt_dialogues", "sharegpt_segments"}
DATASETS = list(MAX_TOKENS)
POLICIES = ["error", "drop", "truncate", "split"]

EDGE_LENGTHS = {
    "one_sample": np.array([5], dtype=np.int32),
    "all_at_cap": np.full(50, 16, dtype=np.int32),
    "all_ones": np.ones(40, dtype=np.int32),
    "all_equal": np.full(1000, 7, dtype=np.int32),
    "ten_halves": np.full(10, 8, dtype=np.int32),
    "three_small": np.array([3, 4, 5], dtype=np.int32),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One plan of the matrix: a dataset, the build options, and whether a loss column is used."""

    dataset: str
    options: tuple[tuple[str, object], ...]
    loss_column: bool = False

    @property
    def config(self) -> PlanConfig:
        return PlanConfig(**dict(self.options))

    @property
    def id(self) -> str:
        short = {
            "micro_batches": "mb",
            "tokens_per_step": "tps",
            "world_size": "w",
            "epochs": "e",
            "oversize": "",
            "shuffle_window": "win",
            "batch_multiple": "bm",
            "max_tokens": "cap",
        }
        parts = [self.dataset]
        for key, value in self.options:
            if key in ("seed", "drop_empty"):
                continue
            if key in ("mode",):
                parts.append(str(value))
            elif key == "drop_last":
                parts.append("droplast" if value else "keeplast")
            else:
                parts.append(f"{short.get(key, key)}{value}")
        return "-".join(parts + (["loss"] if self.loss_column else []))


def lengths_of(dataset: str) -> np.ndarray:
    return EDGE_LENGTHS[dataset] if dataset in EDGE_LENGTHS else dataset_lengths(dataset)


def make_case(dataset: str, loss_column: bool = False, **options) -> Case:
    return Case(dataset, tuple(options.items()), loss_column)


def matrix_cases() -> list[Case]:
    cases = []
    combos = itertools.product(["pack", "pad"], [1, 2, 3, 8, 64], ["mb1", "mb4", "tokens"], [False, True])
    for i, (mode, world_size, steps, drop_last) in enumerate(combos):
        dataset = DATASETS[(i + i // 2) % len(DATASETS)]
        cap = MAX_TOKENS[dataset]
        if dataset in HAS_OVERSIZE:  # "error" raising is its own test
            policy = ["drop", "truncate", "split"][(i // 3) % 3]
        else:  # every policy is a no-op here, and must stay one
            policy = POLICIES[(i // 3) % 4]
        options = {"max_tokens": cap, "mode": mode, "world_size": world_size, "seed": i}
        options["epochs"] = 1 if dataset == "squad" else 1 + i % 3
        if steps == "mb4":
            options["micro_batches"] = 4
        elif steps == "tokens":
            options["tokens_per_step"] = world_size * cap * (3 + i % 2)
        elif i % 2:
            options["micro_batches"] = 1
        options["oversize"] = policy
        options["drop_last"] = drop_last
        options["drop_empty"] = dataset == "with_empty" or i % 5 == 0
        if mode == "pad":
            options["shuffle_window"] = [16_384, 256, 1000][i % 3]
            options["batch_multiple"] = [1, 8][(i // 2) % 2]
        loss_column = policy in ("error", "drop") and i % 3 == 0
        cases.append(make_case(dataset, loss_column, **options))
    return cases


EDGE_CASES = [
    make_case("one_sample", max_tokens=8, mode="pack", world_size=64),
    make_case("one_sample", max_tokens=8, mode="pad", world_size=64, tokens_per_step=64 * 8),
    make_case("all_at_cap", max_tokens=16, mode="pack", world_size=3, micro_batches=4),
    make_case("all_at_cap", max_tokens=16, mode="pad", world_size=8, drop_last=True),
    make_case("all_ones", max_tokens=1, mode="pad", world_size=8, epochs=2),
    make_case("all_ones", max_tokens=1, mode="pack", world_size=3, drop_last=True, epochs=2),
    make_case("all_equal", max_tokens=64, mode="pack", world_size=8, epochs=3),
    make_case("all_equal", max_tokens=64, mode="pad", world_size=2, batch_multiple=4, shuffle_window=100),
    make_case("ten_halves", max_tokens=16, mode="pack", world_size=64, micro_batches=4),
    make_case("ten_halves", max_tokens=16, mode="pad", world_size=64, tokens_per_step=64 * 16),
    make_case("ten_halves", max_tokens=16, mode="pack", world_size=4, drop_last=True),
    make_case("heavy_tail", max_tokens=1024, mode="pack", world_size=8, oversize="split", epochs=2),
    make_case(
        "lognormal", max_tokens=2048, mode="pack", world_size=8, micro_batches=4, hidden_size=1024, oversize="split"
    ),
    make_case(
        "sharegpt_dialogues",
        max_tokens=8192,
        mode="pad",
        world_size=3,
        hidden_size=4096,
        oversize="split",
        tokens_per_step=3 * 8192 * 2,
        drop_last=True,
    ),
    make_case("chat", max_tokens=256, mode="pack", world_size=2, hidden_size=64, balance="tokens", balance_window=1),
    make_case("sharegpt_dialogues", max_tokens=8192, mode="pad", world_size=2, oversize="split", micro_batches=4),
]

CASES = matrix_cases() + EDGE_CASES
CASE_PARAMS = [pytest.param(case, id=case.id) for case in CASES]
MANY_ENTRY_PARAMS = [
    pytest.param(case, id=case.id) for case in CASES if case.dataset not in EDGE_LENGTHS or case.dataset == "all_equal"
]


# --------------------------------------------------------------------------- built plans


@dataclasses.dataclass
class Built:
    """A plan of the matrix, built and written once."""

    case: Case
    path: Path
    lengths: np.ndarray
    loss_tokens: np.ndarray | None

    @property
    def config(self) -> PlanConfig:
        return self.case.config

    @cached_property
    def problems(self) -> list[str]:
        return ref.check_guarantees(self.path, self.lengths, loss_tokens=self.loss_tokens, config=self.config)

    @cached_property
    def violations(self) -> list:
        return check_plan(open_plan(self.path), self.lengths, self.loss_tokens)

    @cached_property
    def metadata(self) -> dict:
        return open_plan(self.path).metadata

    @cached_property
    def epochs(self) -> list[list[dict[str, np.ndarray]]]:
        """Per epoch, per rank: columns as numpy (``samples``: offsets and values)."""
        return [read_epoch(self.path, epoch) for epoch in range(self.config.epochs)]

    def problems_of(self, *guarantees: str) -> list[str]:
        return [p for p in self.problems if any(p.startswith(f"[{g}]") for g in guarantees)]

    def violations_of(self, *guarantees: str) -> list:
        return [v for v in self.violations if v.guarantee in guarantees]


def loss_column_for(lengths: np.ndarray) -> np.ndarray:
    """A deterministic SFT-like loss column: 0..length tokens per sample."""
    rng = np.random.default_rng(12345)
    return (rng.random(lengths.shape[0]) * (lengths.astype(np.int64) + 1)).astype(np.int32)


def read_epoch(path: Path, epoch: int) -> list[dict[str, np.ndarray]]:
    world_size = open_plan(path).world_size
    with pa.memory_map(str(path), "r") as source:
        reader = pa.ipc.open_file(source)
        ranks = []
        for rank in range(world_size):
            batch = reader.get_batch(epoch * world_size + rank)
            columns = {}
            for name in batch.schema.names:
                column = batch.column(name)
                if pa.types.is_list(column.type):
                    offsets = column.offsets.to_numpy().astype(np.int64)
                    values = column.values.to_numpy().astype(np.int64)
                    columns[name + "_offsets"] = offsets - offsets[0]
                    columns[name] = values[offsets[0] : offsets[-1]]
                else:
                    columns[name] = column.to_numpy().copy()
            ranks.append(columns)
    return ranks


@pytest.fixture(scope="session")
def plans(tmp_path_factory):
    store: dict[Case, Built] = {}
    directory = tmp_path_factory.mktemp("plans")

    def get(case: Case) -> Built:
        if case not in store:
            lengths = lengths_of(case.dataset)
            loss = loss_column_for(lengths) if case.loss_column else None
            path = directory / f"{len(store)}.arrow"
            build_and_write(lengths, case.config, path, loss_tokens=loss)
            store[case] = Built(case, path, lengths, loss)
        return store[case]

    return get


def entry_lengths(built: Built, rank_columns: dict[str, np.ndarray]) -> np.ndarray:
    if "lengths" in rank_columns:
        return rank_columns["lengths"]
    return built.lengths[rank_columns["samples"]].astype(np.int64)


def per_row(values: np.ndarray, offsets: np.ndarray, how: str) -> np.ndarray:
    out = np.zeros(offsets.shape[0] - 1, dtype=np.int64)
    for row in range(out.shape[0]):
        part = values[offsets[row] : offsets[row + 1]]
        if part.size:
            out[row] = part.sum() if how == "sum" else part.max()
    return out


def dropped_in_epoch(built: Built, epoch: int) -> set[int]:
    dropped = built.metadata["dropped"]
    listed = set(dropped.get("empty", [])) | set(dropped.get("oversize", []))
    return listed | set(dropped.get("drop_last", {}).get(str(epoch), []))


def always_dropped(built: Built) -> set[int]:
    dropped = built.metadata["dropped"]
    return set(dropped.get("empty", [])) | set(dropped.get("oversize", []))


def dropped_spans(built: Built, epoch: int) -> list[list[int]]:
    """[sample, start, length] of the pieces drop_last left out (span plans only)."""
    return built.metadata["dropped"].get("drop_last_spans", {}).get(str(epoch), [])


# --------------------------------------------------------------------------- the guarantees


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_plan_passes_validate_and_independent_checker(plans, case):
    built = plans(case)
    assert built.violations == []
    assert built.problems == []


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_every_epoch_covers_every_sample_once(plans, case):
    built = plans(case)
    num_samples = built.lengths.shape[0]
    for epoch, ranks in enumerate(built.epochs):
        dropped = dropped_in_epoch(built, epoch)
        if "starts" in ranks[0]:
            # planned pieces plus the pieces drop_last left out cover each sample's tokens
            covered = np.zeros(num_samples, dtype=np.int64)
            for columns in ranks:
                np.add.at(covered, columns["samples"], columns["lengths"])
            for sample, _, length in dropped_spans(built, epoch):
                covered[sample] += length
            want = built.lengths.astype(np.int64)
            if case.config.oversize == "truncate":
                want = np.minimum(want, case.config.max_tokens)
            dropped = always_dropped(built)
        else:
            covered = np.zeros(num_samples, dtype=np.int64)
            for columns in ranks:
                np.add.at(covered, columns["samples"], 1)
            want = np.ones(num_samples, dtype=np.int64)
        want[sorted(dropped)] = 0
        assert np.array_equal(covered, want), f"epoch {epoch}: samples {np.flatnonzero(covered != want)[:10]}"
    assert built.problems_of("coverage") == []
    assert built.violations_of("coverage") == []


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_micro_batches_respect_max_tokens(plans, case):
    built = plans(case)
    cap = case.config.max_tokens
    for ranks in built.epochs:
        for columns in ranks:
            lengths = entry_lengths(built, columns)
            offsets = columns["samples_offsets"]
            if case.config.mode == "pack":
                load = per_row(lengths, offsets, "sum")
            else:
                load = np.diff(offsets) * per_row(lengths, offsets, "max")
            assert load.max(initial=0) <= cap
    assert built.problems_of("max_tokens") == []


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_equal_micro_batches_per_rank_per_step(plans, case):
    built = plans(case)
    for ranks in built.epochs:
        counts = [Counter(columns["step"].tolist()) for columns in ranks]
        assert all(c == counts[0] for c in counts)
        for columns in ranks:
            expected = [m for step in sorted(counts[0]) for m in range(counts[0][step])]
            assert columns["micro"].tolist() == expected
            assert columns["num_micro"].tolist() == [counts[0][s] for s in columns["step"].tolist()]
    assert built.problems_of("equal_micro_batches", "layout", "step_size") == []


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_rebuild_is_byte_identical(plans, case, tmp_path):
    built = plans(case)
    again = tmp_path / "again.arrow"
    build_and_write(built.lengths, case.config, again, loss_tokens=built.loss_tokens)
    assert again.read_bytes() == built.path.read_bytes()


REBUILD_SCRIPT = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from conftest import build_and_write, dataset_lengths
from batchplan import PlanConfig
config = PlanConfig(max_tokens=2048, mode={mode!r}, world_size=3, epochs=2, micro_batches=4, oversize="split")
build_and_write(dataset_lengths("lognormal"), config, {out!r})
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_rebuild_in_another_process_is_byte_identical(tmp_path, mode):
    """Another interpreter with another hash seed writes the same bytes."""
    here = tmp_path / "here.arrow"
    config = PlanConfig(max_tokens=2048, mode=mode, world_size=3, epochs=2, micro_batches=4, oversize="split")
    build_and_write(dataset_lengths("lognormal"), config, here)
    there = tmp_path / "there.arrow"
    script = REBUILD_SCRIPT.format(tests=str(Path(__file__).parent), mode=mode, out=str(there))
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    assert there.read_bytes() == here.read_bytes()


def epoch_sequence(ranks: list[dict[str, np.ndarray]]) -> list[tuple[int, ...]]:
    """The epoch's micro-batches as sample tuples, rank-major in (step, micro) order."""
    out = []
    for columns in ranks:
        offsets = columns["samples_offsets"]
        samples = columns["samples"]
        out.extend(tuple(samples[offsets[i] : offsets[i + 1]].tolist()) for i in range(offsets.shape[0] - 1))
    return out


@pytest.mark.parametrize("case", MANY_ENTRY_PARAMS)
def test_epochs_and_seeds_differ(plans, case):
    built = plans(case)
    sequences = [epoch_sequence(ranks) for ranks in built.epochs]
    for a, b in itertools.combinations(range(len(sequences)), 2):
        assert sequences[a] != sequences[b], f"epochs {a} and {b} have the same order"
    other_seed = dataclasses.replace(case.config, seed=case.config.seed + 1000, epochs=1)
    plan = build_plan(built.lengths, other_seed, loss_tokens=built.loss_tokens)
    epoch = plan.epochs[0]
    other = [
        tuple(plan.entries.samples_of(epoch.members[epoch.offsets[i] : epoch.offsets[i + 1]]).tolist())
        for i in range(epoch.num_rows)
    ]
    assert other != sequences[0], "another seed gave the same epoch 0"


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_dropped_samples_are_listed(plans, case):
    """Everything left out is listed under a reason that holds; nothing else is."""
    built = plans(case)
    config = case.config
    dropped = built.metadata["dropped"]
    assert set(dropped) <= {"empty", "oversize", "drop_last", "drop_last_spans"}
    empty = np.flatnonzero(built.lengths <= 0).tolist()
    oversize = np.flatnonzero(built.lengths > config.max_tokens).tolist()
    assert sorted(dropped.get("empty", [])) == (empty if config.drop_empty else [])
    assert sorted(dropped.get("oversize", [])) == (oversize if config.oversize == "drop" else [])
    if not config.drop_last:
        assert "drop_last" not in dropped
    for epoch, ranks in enumerate(built.epochs):
        planned = set()
        for columns in ranks:
            planned.update(columns["samples"].tolist())
        listed = dropped_in_epoch(built, epoch)
        spans = dropped_spans(built, epoch)
        if spans:  # drop_last may leave out some pieces of a split sample, not all
            assert {sample for sample, _, _ in spans} == listed - always_dropped(built)
            assert planned.isdisjoint(always_dropped(built))
        else:
            assert planned.isdisjoint(listed)
        assert planned | listed == set(range(built.lengths.shape[0]))
    assert built.problems_of("dropped") == []


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_loss_normaliser_is_exact(plans, case):
    """Each row's loss tokens are its samples' (column, or length - 1 per sequence); each
    step's normaliser is the sum over all its rows on every rank."""
    built = plans(case)
    for ranks in built.epochs:
        step_sum: Counter = Counter()
        for columns in ranks:
            offsets = columns["samples_offsets"]
            if "starts" in columns:
                per_entry = columns["lengths"] - 1
            elif built.loss_tokens is not None:
                per_entry = built.loss_tokens[columns["samples"]].astype(np.int64)
            else:
                per_entry = built.lengths[columns["samples"]].astype(np.int64) - 1
            assert np.array_equal(per_row(per_entry, offsets, "sum"), columns["loss_tokens"])
            for step, loss in zip(columns["step"].tolist(), columns["loss_tokens"].tolist()):
                step_sum[step] += loss
        for columns in ranks:
            assert columns["step_loss_tokens"].tolist() == [step_sum[s] for s in columns["step"].tolist()]
    assert built.problems_of("loss_normaliser", "counts") == []
    assert built.violations_of("counts") == []


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_step_sizes_follow_the_config(plans, case):
    """Fixed micro-batches: that many per rank in every step but an epoch's last (all, with
    drop_last). Token target: every step within half a round of it but an epoch's last."""
    built = plans(case)
    config = case.config
    half_round = config.world_size * config.max_tokens / 2
    for ranks in built.epochs:
        steps = Counter(ranks[0]["step"].tolist())
        tokens: Counter = Counter()
        for columns in ranks:
            for step, count in zip(columns["step"].tolist(), columns["tokens"].tolist()):
                tokens[step] += count
        ordered = sorted(steps)
        for step in ordered:
            last = step == ordered[-1]
            if config.tokens_per_step is None:
                fixed = config.micro_batches_per_step
                assert steps[step] == fixed or (last and not config.drop_last and steps[step] < fixed)
            else:
                assert tokens[step] <= config.tokens_per_step + half_round
                assert last or tokens[step] >= config.tokens_per_step - half_round


RANK_READ_PARAMS = [p for p in CASE_PARAMS if p.values[0].config.world_size in (3, 64)][:6]


@pytest.mark.parametrize("case", RANK_READ_PARAMS)
def test_rank_reads_only_its_rows(plans, case):
    """One rank's epoch is one record batch read through the memory map: no copy, and it
    holds that rank's rows only."""
    built = plans(case)
    plan = open_plan(built.path)
    for epoch in range(plan.num_epochs):
        for rank in (0, plan.world_size - 1):
            before = pa.total_allocated_bytes()
            batch = plan.read_rank(epoch, rank)
            assert pa.total_allocated_bytes() == before, "reading a rank copied data"
            assert set(batch.column("rank").to_pylist()) <= {rank}
            assert set(batch.column("epoch").to_pylist()) <= {epoch}
            assert batch.num_rows == plan.metadata["rows_per_rank"][epoch]


# --------------------------------------------------------------------------- policies that refuse


@pytest.mark.parametrize("mode", ["pack", "pad"])
@pytest.mark.parametrize("dataset", ["lognormal", "heavy_tail", "sharegpt_dialogues"])
def test_oversize_error_raises_dataset_error(dataset, mode):
    lengths = dataset_lengths(dataset)
    config = PlanConfig(max_tokens=MAX_TOKENS[dataset], mode=mode, oversize="error", drop_empty=True)
    with pytest.raises(DatasetError, match="longer than max_tokens"):
        build_plan(lengths, config)


@pytest.mark.parametrize("oversize", POLICIES)
def test_empty_samples_need_drop_empty(oversize):
    lengths = dataset_lengths("with_empty")
    with pytest.raises(DatasetError, match="empty"):
        build_plan(lengths, PlanConfig(max_tokens=100_000, oversize=oversize))


@pytest.mark.parametrize("oversize", ["truncate", "split"])
def test_span_policies_refuse_a_loss_column(oversize):
    lengths = dataset_lengths("heavy_tail")
    config = PlanConfig(max_tokens=1024, oversize=oversize)
    with pytest.raises(DatasetError, match="loss-tokens column"):
        build_plan(lengths, config, loss_tokens=loss_column_for(lengths))


def test_nothing_left_to_plan_is_an_error():
    with pytest.raises(DatasetError, match="no samples left"):
        build_plan(np.array([0, 50, 0], dtype=np.int32), PlanConfig(max_tokens=10, drop_empty=True, oversize="drop"))


def written_rows(plan, path: Path) -> tuple[dict, pa.Table]:
    """What ``plan`` drops, and its rows as written to ``path`` (without the metadata, which
    records the config)."""
    from batchplan.formats.plan_writer import write_plan

    dropped = write_plan(plan, path)["dropped"]
    with pa.memory_map(str(path), "r") as source:
        return dropped, pa.ipc.open_file(source).read_all().replace_schema_metadata(None)


@pytest.mark.parametrize("dataset", sorted(set(MAX_TOKENS) | set(REAL_FILES)))
def test_oversize_policies_act_only_on_samples_above_max_tokens(dataset, tmp_path):
    """The matrix rotates every policy through the datasets without oversize samples and only
    drop, truncate and split through the others: there, ``error`` names the count of samples
    above the cap; elsewhere, every policy plans exactly what ``error`` plans, dropping nothing."""
    cap, lengths = MAX_TOKENS[dataset], dataset_lengths(dataset)
    above = int((lengths > cap).sum())
    config = PlanConfig(max_tokens=cap, world_size=2, drop_empty=True, oversize="error")
    if dataset in HAS_OVERSIZE:
        with pytest.raises(DatasetError, match=f"^{above:,} samples are longer than max_tokens {cap:,} "):
            build_plan(lengths, config)
        return
    written = {}
    for policy in POLICIES:
        plan = build_plan(lengths, dataclasses.replace(config, oversize=policy))
        written[policy] = written_rows(plan, tmp_path / f"{policy}.arrow")
    assert all(set(dropped) <= {"empty"} for dropped, _ in written.values())
    assert all(rows.equals(written["error"][1]) for _, rows in written.values())


# --------------------------------------------------------------------------- split + drop_last

SPLIT_DROP_LAST = PlanConfig(
    max_tokens=2048, mode="pack", world_size=3, micro_batches=4, oversize="split", drop_last=True
)


def test_split_with_drop_last_drops_whole_samples(tmp_path):
    lengths = dataset_lengths("lognormal")
    path = tmp_path / "plan.arrow"
    build_and_write(lengths, SPLIT_DROP_LAST, path)
    assert ref.check_guarantees(path, lengths, config=SPLIT_DROP_LAST) == []


def test_validate_accepts_split_with_drop_last_plans(tmp_path):
    lengths = dataset_lengths("lognormal")
    path = tmp_path / "plan.arrow"
    build_and_write(lengths, SPLIT_DROP_LAST, path)
    assert check_plan(open_plan(path), lengths) == []


def test_drop_last_refuses_to_empty_an_epoch():
    """Three samples cannot fill one step of 8 ranks: drop_last would plan nothing."""
    config = PlanConfig(max_tokens=8, mode="pack", world_size=8, drop_last=True)
    with pytest.raises(DatasetError, match="would drop all 2 micro-batches of epoch 0"):
        build_plan(EDGE_LENGTHS["three_small"], config)


def test_drop_last_with_a_token_target_drops_a_short_final_step():
    """92 samples of 100 tokens on 4 ranks, target 4,000: steps of 40 samples; the last
    step would hold 1,200 tokens, well short of the target, so it is dropped."""
    lengths = np.full(92, 100, dtype=np.int32)
    config = PlanConfig(max_tokens=100, world_size=4, tokens_per_step=4000, drop_last=True)
    plan = build_plan(lengths, config)
    assert plan.epochs[0].step_tokens.tolist() == [4000, 4000]
    assert plan.epochs[0].dropped_entries.size == 12


@pytest.mark.parametrize(
    "config",
    [
        PlanConfig(max_tokens=2048, world_size=8, epochs=3, oversize="split", hidden_size=512),
        PlanConfig(max_tokens=2048, world_size=8, oversize="split", hidden_size=512),  # one epoch: split kernels
        PlanConfig(max_tokens=4096, world_size=4, mode="pad", epochs=2, tokens_per_step=40_000, oversize="drop"),
        # A cap this small against 40,000 samples: the shuffle within lengths splits too.
        PlanConfig(max_tokens=256, world_size=8, oversize="truncate", seqlen_warmup_min=64, seqlen_warmup_tokens=10**5),
    ],
    ids=["epochs-in-parallel", "one-epoch-in-parts", "pad-two-epochs", "small-cap-with-warmup"],
)
def test_plan_does_not_depend_on_the_number_of_threads(tmp_path, monkeypatch, config):
    """Epochs are planned in parallel threads, and cores left over split the kernels of
    an epoch; one thread or several, the same bytes. (40,000 samples: several balance
    windows and hundreds of steps for the parts to split.)"""
    lengths = np.tile(dataset_lengths("lognormal"), 14)[:40_000]
    files = []
    for threads in ("1", "2", "3", "4"):
        monkeypatch.setenv("BATCHPLAN_THREADS", threads)
        path = tmp_path / f"plan-{threads}.arrow"
        build_and_write(lengths, config, path)
        files.append(path.read_bytes())
    assert files[0] == files[1] == files[2] == files[3]


def test_a_huge_max_tokens_packs_without_huge_memory():
    """The pack kernels size their arrays by the capacity; a cap far above all the tokens
    packs as one bin of the total, in kilobytes, not gigabytes."""
    plan = build_plan(np.array([3, 4, 5], dtype=np.int32), PlanConfig(max_tokens=2**31 - 1))
    assert plan.epochs[0].tokens.tolist() == [12]
