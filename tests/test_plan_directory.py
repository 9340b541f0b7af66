"""Plan directories: one Arrow file per epoch and a manifest, built whole or by epoch ranges
in parallel processes, read by every reader like a plan file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchplan import PlanConfig, build_plan_file, open_plan, reshard_plan_file, validate_plan
from batchplan.errors import ConfigError, PlanFormatError
from batchplan.planning.epochs import build_plan, plan_epochs, prepare_entries
from batchplan.reports.summary import summarize_plan
from batchplan_cli.main import app
from batchplan_cli.parsing import parse_epoch_range

DATA = Path(__file__).resolve().parent.parent / "data"
DIALOGUES = DATA / "sharegpt_dialogues_cl100k.parquet"
SQUAD = DATA / "squad11_bert384.parquet"
# Ramp-up under drop_last (epochs depend on the tokens of the ones before), split samples
# (spans), the cost model: what an epoch range must plan exactly as a whole build does.
RAMPED = PlanConfig(
    max_tokens=8192,
    world_size=4,
    oversize="split",
    tokens_per_step=65536,
    rampup_start=32768,
    rampup_tokens=3_000_000,
    epochs=4,
    drop_last=True,
    hidden_size=1024,
)
CLI_OPTIONS = [
    "--max-tokens",
    "8192",
    "--world-size",
    "4",
    "--oversize",
    "split",
    "--tokens-per-step",
    "65536",
    "--rampup",
    "32768:3000000",
    "--epochs",
    "4",
    "--drop-last",
    "--hidden-size",
    "1024",
    "-q",
]


def cli(*args) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "batchplan_cli.main", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The same plan as one file and as a directory, built by the library."""
    root = tmp_path_factory.mktemp("plans")
    build_plan_file(DIALOGUES, root / "plan.arrow", RAMPED)
    build_plan_file(DIALOGUES, root / "plan", RAMPED, layout="directory")
    return {"file": root / "plan.arrow", "directory": root / "plan"}


def test_a_directory_holds_the_plan_of_a_file(built):
    file, directory = open_plan(built["file"]), open_plan(built["directory"])
    directory.verify()
    plan = directory.metadata["plan"]
    names = [f"epoch-{epoch:05d}.{plan}.arrow" for epoch in range(4)]
    assert sorted(p.name for p in built["directory"].iterdir()) == [*names, "manifest.json"]
    assert [f["name"] for f in directory.metadata["epoch_files"]] == names
    for epoch in range(RAMPED.epochs):
        for rank in range(RAMPED.world_size):
            assert directory.read_rank(epoch, rank).equals(file.read_rank(epoch, rank))
    assert directory.read_all().equals(file.read_all())
    only_directory = {"layout", "plan", "epoch_files", "content_hash"}
    assert {k: v for k, v in directory.metadata.items() if k not in only_directory} == {
        k: v for k, v in file.metadata.items() if k != "content_hash"
    }
    assert directory.metadata["steps_per_epoch"] == file.metadata["steps_per_epoch"]
    assert file.metadata["dropped"]["drop_last"]  # the drops of each epoch made it into the manifest


def test_epoch_files_count_steps_and_tokens_from_their_epoch(built):
    """The files hold epoch-local steps and tokens; the reader adds the epoch's start."""
    import pyarrow as pa

    directory = open_plan(built["directory"])
    raw = pa.ipc.open_file(_epoch_path(built["directory"], 2)).get_batch(1)
    shifted = directory.read_rank(2, 1)
    first_step = sum(directory.metadata["steps_per_epoch"][:2])
    assert raw.column("step")[0].as_py() == 0 and shifted.column("step")[0].as_py() == first_step
    tokens_before = sum(f["tokens"] for f in directory.metadata["epoch_files"][:2])
    assert shifted.column("tokens_before_step")[0].as_py() == tokens_before


def test_epoch_ranges_plan_what_the_whole_build_plans():
    """`plan_epochs` of any range yields the epochs a whole build makes, ramp-up under drop_last included."""
    lengths = pq.read_table(DIALOGUES, columns=["length"]).column(0).to_numpy().astype(np.int32)
    whole = build_plan(lengths, RAMPED)
    prepared = prepare_entries(lengths, RAMPED)
    for epochs in (range(0, 1), range(1, 3), range(3, 4), range(2, 4)):
        for planned in plan_epochs(prepared, RAMPED, epochs):
            expected = whole.epochs[planned.epoch]
            assert planned.epoch in epochs
            assert np.array_equal(planned.members, expected.members)
            assert np.array_equal(planned.step_tokens, expected.step_tokens)
            assert np.array_equal(planned.rank_step, expected.rank_step)


@pytest.mark.slow
def test_parallel_epoch_range_builds_are_byte_identical_to_one_build(tmp_path):
    """Three processes build disjoint epoch ranges into one directory at the same time; the
    directory equals one process's build byte for byte, manifest included."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert cli("build", DIALOGUES, "-o", whole, "--layout", "directory", *CLI_OPTIONS).returncode == 0
    command = [sys.executable, "-m", "batchplan_cli.main", "build", str(DIALOGUES), "-o", str(parts), *CLI_OPTIONS]
    processes = [
        subprocess.Popen([*command, "--only-epochs", r], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for r in ("0:1", "1:3", "3:")
    ]
    for process in processes:
        _, error = process.communicate(timeout=300)
        assert process.returncode == 0, error.decode()
    names = sorted(p.name for p in whole.iterdir())
    assert names == sorted(p.name for p in parts.iterdir()) and "manifest.json" in names
    for name in names:
        assert (whole / name).read_bytes() == (parts / name).read_bytes(), name


@pytest.mark.slow
def test_every_reader_takes_a_directory(built):
    from batchplan.runtime import PlanSampler
    from batchplan.runtime.lr_schedule import read_step_tokens

    file, directory = built["file"], built["directory"]
    assert validate_plan(directory, DIALOGUES) == []
    assert summarize_plan(open_plan(directory)) == summarize_plan(open_plan(file))
    for path in (file, directory):
        assert cli("validate", path, "--dataset", DIALOGUES).returncode == 0
        assert cli("inspect", path, "--json").returncode == 0
    for rank in range(RAMPED.world_size):
        from_file, from_directory = (
            PlanSampler(file, rank=rank, world_size=4),
            PlanSampler(directory, rank=rank, world_size=4),
        )
        assert list(from_directory) == list(from_file)
    for got, expected in zip(read_step_tokens(directory), read_step_tokens(file)):
        assert np.array_equal(got, expected)


def test_reshard_takes_a_directory(tmp_path):
    """(Resharding a ramp-up plan is refused either way: a plan without one.)"""
    config = PlanConfig(max_tokens=384, world_size=4, epochs=3)
    build_plan_file(SQUAD, tmp_path / "plan.arrow", config)
    build_plan_file(SQUAD, tmp_path / "plan", config, layout="directory")
    step = open_plan(tmp_path / "plan").metadata["steps_per_epoch"][0] + 3
    reshard_plan_file(tmp_path / "plan.arrow", tmp_path / "a.arrow", world_size=2, from_step=step)
    reshard_plan_file(tmp_path / "plan", tmp_path / "b.arrow", world_size=2, from_step=step)
    assert open_plan(tmp_path / "a.arrow").read_all().equals(open_plan(tmp_path / "b.arrow").read_all())
    assert validate_plan(tmp_path / "b.arrow", SQUAD) == []


def test_an_incomplete_directory_says_which_epochs_are_missing(tmp_path):
    config = PlanConfig(max_tokens=384, world_size=2, epochs=5)
    written = build_plan_file(SQUAD, tmp_path / "plan", config, only_epochs=range(1, 3))
    assert written == {"missing_epochs": [0, 3, 4]}
    with pytest.raises(PlanFormatError, match=r"incomplete plan directory.*epochs 0, 3-4 of 5 are missing"):
        open_plan(tmp_path / "plan")
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / "plan")])
    assert result.exit_code == 1 and "epochs 0, 3-4 of 5 are missing" in " ".join(result.output.split())
    build_plan_file(SQUAD, tmp_path / "plan", config, only_epochs=range(3, 5))
    assert build_plan_file(SQUAD, tmp_path / "plan", config, only_epochs=range(0, 1))["epochs"] == 5
    open_plan(tmp_path / "plan").verify()


def test_a_missing_epoch_file_is_named(built, tmp_path):
    copy = _copy(built["directory"], tmp_path)
    _epoch_path(copy, 2).unlink()
    with pytest.raises(PlanFormatError, match=r"epoch-00002\.[0-9a-f]{16}\.arrow missing"):
        open_plan(copy)


@pytest.mark.slow
def test_a_corrupt_epoch_file_is_named(built, tmp_path):
    copy = _copy(built["directory"], tmp_path)
    path = _epoch_path(copy, 1)
    data = bytearray(path.read_bytes())
    at = data.index(b"ARROW1", 8) - 64  # inside the last record batch, before the footer
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    plan = open_plan(copy)
    with pytest.raises(PlanFormatError, match=path.name):
        plan.verify()
    result = cli("validate", copy)
    assert result.returncode == 1 and path.name in result.stderr + result.stdout
    path.write_bytes(bytes(data[: len(data) // 2]))  # cut short
    with pytest.raises(PlanFormatError, match=rf"{path.name}.*truncated"):
        open_plan(copy).read_rank(1, 0)


def test_epoch_files_of_other_settings_never_complete_a_plan(tmp_path):
    """Epoch files carry their plan's fingerprint in their name: a range built with other
    settings leaves the epochs of this plan missing, and completing it removes the other's."""
    directory = tmp_path / "plan"
    config = PlanConfig(max_tokens=384, world_size=2, epochs=2)
    other = PlanConfig(max_tokens=384, world_size=2, epochs=2, seed=1)
    build_plan_file(SQUAD, directory, config, only_epochs=range(0, 1))
    assert build_plan_file(SQUAD, directory, other, only_epochs=range(1, 2)) == {"missing_epochs": [0]}
    assert build_plan_file(SQUAD, directory, config, only_epochs=range(1, 2))["seed"] == 0
    listed = [f["name"] for f in open_plan(directory).metadata["epoch_files"]]
    assert sorted(p.name for p in directory.iterdir()) == sorted([*listed, "manifest.json"])
    assert validate_plan(directory, SQUAD) == []


def test_an_epoch_file_of_another_plan_is_refused(built, tmp_path):
    copy = _copy(built["directory"], tmp_path)
    whole = tmp_path / "seed1"
    build_plan_file(DIALOGUES, whole, PlanConfig(**{**RAMPED.to_dict(), "seed": 1}), layout="directory")
    _epoch_path(copy, 1).write_bytes(_epoch_path(whole, 1).read_bytes())
    with pytest.raises(PlanFormatError, match=r"epoch-00001\.\w{16}\.arrow: not the epoch file the manifest lists"):
        open_plan(copy).read_rank(1, 0)


def test_an_epoch_file_alone_points_to_its_directory(built):
    with pytest.raises(PlanFormatError, match=r"one epoch's file of a plan directory; open the directory"):
        open_plan(_epoch_path(built["directory"], 0))


def test_bad_layouts_and_ranges_are_refused(tmp_path):
    config = PlanConfig(max_tokens=384, epochs=3)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds files that are not a plan's \(notes\.txt\)"):
        build_plan_file(SQUAD, tmp_path, config, layout="directory")
    with pytest.raises(ConfigError, match=r"`only_epochs` writes part of a plan directory"):
        build_plan_file(SQUAD, tmp_path / "x", config, layout="file", only_epochs=range(0, 1))
    for bad in (range(2, 4), range(1, 1)):
        with pytest.raises(ConfigError, match=r"not a range START:STOP of the plan's epochs 0\.\.2"):
            build_plan_file(SQUAD, tmp_path / "x", config, only_epochs=bad)
    with pytest.raises(ConfigError, match=r'is a directory; give a file path.*`layout="directory"`'):
        build_plan_file(SQUAD, tmp_path, config)
    assert not (tmp_path / "x").exists()


def test_epoch_ranges_parse():
    assert parse_epoch_range("2:4", 8) == range(2, 4)
    assert parse_epoch_range("5", 8) == range(5, 6)
    assert parse_epoch_range(":3", 8) == range(0, 3) and parse_epoch_range("6:", 8) == range(6, 8)
    assert parse_epoch_range(None, 8) is None
    for bad in ("a:b", "1:2:3", "-1:2", ""):
        with pytest.raises(ConfigError, match="--only-epochs takes START:STOP"):
            parse_epoch_range(bad, 8)


def test_the_manifest_is_canonical_json(built):
    raw = (built["directory"] / "manifest.json").read_bytes()
    assert raw == json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()


def _epoch_path(directory: Path, epoch: int) -> Path:
    """Epoch ``epoch``'s file, as the directory's manifest names it."""
    return directory / json.loads((directory / "manifest.json").read_bytes())["epoch_files"][epoch]["name"]


def _copy(directory: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(directory, tmp_path / "copy"))
