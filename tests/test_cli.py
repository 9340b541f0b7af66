"""The `batchplan` command end to end on the files in data/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from batchplan_cli.main import app

DATA = Path(__file__).resolve().parent.parent / "data"
DIALOGUES = DATA / "sharegpt_dialogues_cl100k.parquet"
SQUAD = DATA / "squad11_bert384.parquet"
runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def inspect_json(plan: Path) -> dict:
    result = run("inspect", plan, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_build_inspect_validate_pack(tmp_path):
    plan = tmp_path / "plan.arrow"
    result = run("build", SQUAD, "-o", plan, "--max-tokens", 4096, "--world-size", 8, "--epochs", 2)
    assert result.exit_code == 0, result.output
    assert "wrote" in result.stdout and plan.name in result.stdout
    summary = inspect_json(plan)
    for key in (
        "num_samples",
        "num_epochs",
        "num_steps",
        "world_size",
        "mode",
        "max_tokens",
        "tokens",
        "fill",
        "padding_fraction",
        "token_imbalance",
        "dropped_samples",
    ):
        assert key in summary
    assert summary["num_samples"] == 88_641
    assert summary["world_size"] == 8 and summary["num_epochs"] == 2 and summary["mode"] == "pack"
    assert summary["fill"] >= 0.995
    result = run("validate", plan, "--dataset", SQUAD)
    assert result.exit_code == 0, result.output
    assert "OK, every guarantee holds" in result.stdout


@pytest.mark.parametrize("oversize", ["drop", "truncate", "split"])
@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_heavy_tail_under_each_oversize_policy(tmp_path, mode, oversize):
    plan = tmp_path / "plan.arrow"
    result = run(
        "build",
        DIALOGUES,
        "-o",
        plan,
        "--max-tokens",
        8192,
        "--mode",
        mode,
        "--world-size",
        8,
        "--oversize",
        oversize,
        "--tokens-per-step",
        8 * 8192 * 2,
        "-q",
    )
    assert result.exit_code == 0, result.output
    assert run("validate", plan, "-d", DIALOGUES).exit_code == 0
    summary = inspect_json(plan)
    assert (summary["dropped_samples"] > 0) == (oversize == "drop")


def test_same_command_twice_is_byte_identical(tmp_path):
    args = ["--max-tokens", 8192, "--world-size", 8, "--epochs", 2, "--oversize", "split", "-q"]
    assert run("build", DIALOGUES, "-o", tmp_path / "a.arrow", *args).exit_code == 0
    assert run("build", DIALOGUES, "-o", tmp_path / "b.arrow", *args).exit_code == 0
    assert (tmp_path / "a.arrow").read_bytes() == (tmp_path / "b.arrow").read_bytes()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-tokens", 8192], "samples are longer than max_tokens 8,192 (longest: 199,994 tokens"),
        (["--max-tokens", 0], "--max-tokens must be >= 1, got 0"),
        (["--max-tokens", 8192, "--oversize", "split", "--micro-batches", 2, "--tokens-per-step", 10**6], "both given"),
        (
            ["--max-tokens", 8192, "--length-column", "nope", "--tokens-column", "nada"],
            "no length column 'nope' and no token column 'nada'",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_1(tmp_path, args, message):
    plan = tmp_path / "plan.arrow"
    result = run("build", DIALOGUES, "-o", plan, *args)
    assert result.exit_code == 1
    assert message in " ".join(result.stderr.split())
    assert "Traceback" not in result.output
    assert not plan.exists()
    assert list(tmp_path.iterdir()) == []


def test_bad_paths(tmp_path):
    result = run("build", tmp_path / "missing.parquet", "-o", tmp_path / "p.arrow", "--max-tokens", 64)
    assert result.exit_code == 1 and "no such file or directory" in result.stderr
    result = run("build", SQUAD, "-o", tmp_path / "no" / "p.arrow", "--max-tokens", 512)
    assert result.exit_code == 1 and "does not exist" in result.stderr
    result = run("inspect", tmp_path / "missing.arrow")
    assert result.exit_code == 1 and "no such plan file" in result.stderr


def test_output_equal_to_input_is_refused(tmp_path):
    copy = tmp_path / "d.parquet"
    copy.write_bytes(SQUAD.read_bytes())
    result = run("build", copy, "-o", copy, "--max-tokens", 512)
    assert result.exit_code == 1 and "also an input" in result.stderr
    assert copy.read_bytes() == SQUAD.read_bytes()


def test_validate_reports_a_corrupt_plan(tmp_path):
    plan = tmp_path / "plan.arrow"
    assert run("build", SQUAD, "-o", plan, "--max-tokens", 1024, "--world-size", 2, "-q").exit_code == 0
    data = bytearray(plan.read_bytes())
    # Flip a byte inside the first record batch body (past the schema at the start).
    table_start = len(data) // 3
    data[table_start] ^= 0xFF
    plan.write_bytes(bytes(data))
    result = run("validate", plan, "-d", SQUAD)
    assert result.exit_code == 1
    assert "FAIL" in result.stderr


def test_validate_refuses_another_dataset(tmp_path):
    plan = tmp_path / "plan.arrow"
    assert run("build", SQUAD, "-o", plan, "--max-tokens", 1024, "-q").exit_code == 0
    result = run("validate", plan, "-d", DIALOGUES)
    assert result.exit_code == 1 and "[dataset]" in result.stderr


@pytest.mark.slow
def test_debug_variable_shows_the_traceback(tmp_path):
    command = [
        sys.executable,
        "-m",
        "batchplan_cli.main",
        "build",
        str(DIALOGUES),
        "-o",
        str(tmp_path / "p.arrow"),
        "--max-tokens",
        "8192",
    ]
    quiet = subprocess.run(command, capture_output=True, text=True)
    assert quiet.returncode == 1 and "Traceback" not in quiet.stderr
    assert len(quiet.stderr.strip().splitlines()) == 1
    loud = subprocess.run(command, capture_output=True, text=True, env=os.environ | {"BATCHPLAN_DEBUG": "1"})
    assert loud.returncode != 0 and "Traceback" in loud.stderr


@pytest.mark.slow
def test_help_does_not_import_numba():
    code = "import sys; from batchplan_cli.main import app; assert 'numba' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    result = subprocess.run([sys.executable, "-m", "batchplan_cli.main", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "build" in result.stdout


@pytest.mark.slow
def test_interrupted_build_leaves_no_partial_plan_and_keeps_the_old_one(tmp_path):
    """SIGTERM mid-build: the previous plan is intact and no temporary file stays behind."""
    import signal
    import time

    plan = tmp_path / "plan.arrow"
    assert run("build", SQUAD, "-o", plan, "--max-tokens", 512, "-q").exit_code == 0
    before = plan.read_bytes()
    big = DATA / "wikipedia_bert512_1m.parquet"
    command = [
        sys.executable,
        "-m",
        "batchplan_cli.main",
        "build",
        str(big),
        "-o",
        str(plan),
        "--max-tokens",
        "512",
        "--epochs",
        "50",
        "-q",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(2.0)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)
    assert process.returncode != 0
    assert plan.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.arrow"]


@pytest.mark.slow
def test_the_command_keeps_exit_codes_and_output_when_it_skips_teardown(tmp_path):
    """`main` ends with os._exit after flushing: the exit code (0 done, 1 known error,
    2 usage) and every line of output survive."""
    command = [sys.executable, "-m", "batchplan_cli.main"]
    plan = tmp_path / "plan.arrow"
    done = subprocess.run([*command, "build", SQUAD, "-o", plan, "--max-tokens", "512"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith(f"wrote {plan}") and "dropped samples" in done.stdout
    assert json.loads(subprocess.run([*command, "inspect", plan, "--json"], capture_output=True).stdout)
    failed = subprocess.run(
        [*command, "build", tmp_path / "none.parquet", "-o", plan, "--max-tokens", "8"], capture_output=True, text=True
    )
    assert failed.returncode == 1 and failed.stderr.count("error:") == 1
    assert subprocess.run([*command, "build"], capture_output=True).returncode == 2


def test_stale_temporary_of_a_killed_build_is_removed_on_rerun(tmp_path):
    plan = tmp_path / "plan.arrow"
    stale = tmp_path / ".plan.arrow.999999999.abcd.tmp"  # no such process
    stale.write_bytes(b"half a plan")
    assert run("build", SQUAD, "-o", plan, "--max-tokens", 512, "-q").exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.arrow"]


def test_inspect_refuses_a_damaged_plan(tmp_path):
    """inspect verifies the checksum: a flipped byte in the rows is an error, not wrong numbers."""
    from batchplan.formats.opening import open_plan

    plan = tmp_path / "plan.arrow"
    assert run("build", SQUAD, "-o", plan, "--max-tokens", 1024, "--world-size", 2, "-q").exit_code == 0
    data = bytearray(plan.read_bytes())
    tokens = open_plan(plan).read_rank(0, 0).column("tokens").to_numpy()
    position = bytes(data).find(tokens[:4].tobytes())  # the first rank's tokens column
    data[position] ^= 0x01
    plan.write_bytes(bytes(data))
    result = run("inspect", plan)
    assert result.exit_code == 1 and "the file is corrupt, rebuild it" in result.stderr
