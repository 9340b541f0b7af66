"""What a user sees first: help at 80 columns, the README's demo, and the messages for a
plan cut short, a world-size mismatch and a full disk."""

from __future__ import annotations

import errno
import io
import os
import re
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from batchplan.config import BALANCE_MODES, LAYOUTS, MODES, OVERSIZE_POLICIES, PlanConfig
from batchplan.errors import PlanFormatError, PlanMismatchError
from batchplan.formats import plan_writer
from batchplan.formats.opening import open_plan
from batchplan.formats.plan_writer import write_plan
from batchplan.planning.epochs import build_plan
from batchplan_cli.choices import Balance, Layout, Mode, Oversize
from batchplan_cli.main import app

ROOT = Path(__file__).resolve().parent.parent
SQUAD = ROOT / "data" / "squad11_bert384.parquet"
CLI = [sys.executable, "-m", "batchplan_cli.main"]
LENGTHS = np.random.default_rng(3).integers(1, 90, 40).astype(np.int32)
runner = CliRunner()


def commands() -> dict:
    return typer.main.get_command(app).commands


def choices(param) -> tuple[str, ...]:
    """The values an enumerated option takes; () for the others. (Typer's choice type is its
    own, not a ``click.Choice``.)"""
    return tuple(str(choice) for choice in getattr(param.type, "choices", None) or ())


def help_text(*command: str) -> str:
    result = subprocess.run(
        [*CLI, *command, "--help"], capture_output=True, text=True, env=os.environ | {"COLUMNS": "80"}
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def small_plan(path: Path, world_size: int = 2) -> Path:
    write_plan(build_plan(LENGTHS, PlanConfig(max_tokens=128, world_size=world_size)), path)
    return path


# -- help ------------------------------------------------------------------------


def test_choices_are_the_library_values_in_its_order():
    """The CLI's enums list exactly the values the library takes, so none is missing from ``--help``."""
    for choice, values in ((Mode, MODES), (Oversize, OVERSIZE_POLICIES), (Balance, BALANCE_MODES), (Layout, LAYOUTS)):
        assert tuple(member.value for member in choice) == values, choice.__name__


def test_every_choice_build_offers_builds_a_plan_that_records_it(tmp_path):
    """Each value an enumerated option of ``build`` lists is one the library takes: the plan
    built with it records it (``--layout``: a file or a directory)."""
    dataset = tmp_path / "lengths.parquet"
    pq.write_table(pa.table({"length": LENGTHS}), dataset)
    offered = {param.opts[-1]: choices(param) for param in commands()["build"].params if choices(param)}
    assert set(offered) == {"--mode", "--oversize", "--balance", "--layout"}
    assert choices(next(p for p in commands()["compare"].params if "--oversize" in p.opts))
    for option, values in offered.items():
        for value in values:
            plan = tmp_path / f"{option[2:]}-{value}"
            args = ["build", str(dataset), "-o", str(plan), "--max-tokens", "128", "--hidden-size", "64", option, value]
            result = runner.invoke(app, [*args, "-q"])
            assert result.exit_code == 0, (option, value, result.output)
            if option == "--layout":
                assert plan.is_dir() == (value == "directory")
            else:
                assert open_plan(plan).metadata["config"][option[2:]] == value


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(commands()))
def test_help_at_80_columns_shows_every_option_whole_and_every_choice(name):
    text = help_text(name)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80, text
    for param in commands()[name].params:
        for opt in (*param.opts, *param.secondary_opts):
            if opt.startswith("-"):  # an argument's "opt" is its name
                assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text), f"{opt} cut or missing:\n{text}"
        if choices(param):
            shown = "|".join(choices(param))
            assert f"{param.opts[-1]} <{shown}>" in text, f"choices of {param.opts[-1]} not shown:\n{text}"


@pytest.mark.slow
def test_top_level_help_lists_every_command_with_its_whole_summary():
    text = help_text()
    assert max(len(line) for line in text.splitlines()) <= 80, text
    listed = text.split("Commands:", 1)[1].splitlines()
    for name in commands():
        line = next(line for line in listed if line.split()[:1] == [name])
        assert not line.rstrip().endswith(("...", "…")), line


@pytest.mark.slow
def test_help_does_not_import_the_planner_or_plotting():
    code = (
        "import sys; from batchplan_cli.main import app; "
        "loaded = {'numba', 'torch', 'matplotlib'} & set(sys.modules); assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_value_outside_the_choices_is_a_usage_error_listing_them(tmp_path):
    result = runner.invoke(
        app, ["build", str(SQUAD), "-o", str(tmp_path / "p.arrow"), "--max-tokens", "512", "--oversize", "keep"]
    )
    assert result.exit_code == 2
    assert "'keep' is not one of 'error', 'drop', 'truncate', 'split'" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_choices_reach_the_plan_as_plain_strings(tmp_path):
    plan = tmp_path / "plan.arrow"
    args = [
        "build",
        SQUAD,
        "-o",
        plan,
        "--max-tokens",
        2048,
        "--mode",
        "pad",
        "--oversize",
        "drop",
        "--hidden-size",
        1024,
        "--balance",
        "tokens",
        "-q",
    ]
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    config = open_plan(plan).metadata["config"]
    assert (config["mode"], config["oversize"], config["balance"]) == ("pad", "drop", "tokens")


# -- the README's demo -------------------------------------------------------------


def demo_command() -> str:
    """The line after ``<!-- demo-command -->`` in README.md, as .ci/run reads the test command."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("<!-- demo-command -->") + 1
    return next(line for line in lines[start:] if not line.startswith("```"))


@pytest.mark.slow
def test_the_readme_demo_builds_then_prints_one_summary(tmp_path):
    """The demo's batchplan commands, run as written in a folder whose ``data`` is the repo's
    (the set-up steps before them are the test command's, run by CI)."""
    steps = [shlex.split(step) for step in demo_command().split("&&")]
    batchplan = [step for step in steps if step[0].endswith("bin/batchplan")]
    assert [step[1] for step in batchplan] == ["build", "inspect"]
    (tmp_path / "data").symlink_to(ROOT / "data")
    output = ""
    for step in batchplan:
        result = subprocess.run([*CLI, *step[1:]], cwd=tmp_path, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        output += result.stdout
    assert (tmp_path / "plan.arrow").is_file()
    tables = re.findall(r"^\W*samples\W+9,457\W*$", output, flags=re.MULTILINE)
    assert len(tables) == 1, output
    assert "token imbalance" in output and "cost imbalance" in output


# -- a plan cut short ----------------------------------------------------------------


def cut_points(data: bytes) -> dict[str, int]:
    schema_end = 16 + struct.unpack("<i", data[12:16])[0]  # "ARROW1\0\0", 0xFFFFFFFF, length, schema
    footer_length = struct.unpack("<i", data[-10:-6])[0]
    return {
        "empty": 0,
        "inside the leading magic": 3,
        "after the leading magic": 8,
        "after the schema": schema_end,
        "halfway": len(data) // 2,
        "inside the footer": len(data) - 10 - footer_length // 2,
        "before the trailing magic": len(data) - 6,
        "one byte short": len(data) - 1,
    }


def test_a_plan_cut_short_anywhere_says_truncated_and_rebuild(tmp_path):
    data = small_plan(tmp_path / "full.arrow").read_bytes()
    for name, cut in cut_points(data).items():
        path = tmp_path / f"cut {cut}.arrow"
        path.write_bytes(data[:cut])
        with pytest.raises(PlanFormatError) as raised:
            open_plan(path)
        message = str(raised.value)
        assert message.startswith(f"{path}: "), (name, message)
        assert "truncated or incomplete; rebuild it" in message, (name, message)
        assert ("the file is empty" in message) == (cut == 0), (name, message)


@pytest.mark.parametrize("command", ["inspect", "validate", "reshard"])
def test_the_commands_print_the_truncation_in_one_line(tmp_path, command):
    path = small_plan(tmp_path / "plan.arrow")
    path.write_bytes(path.read_bytes()[:-100])
    extra = {"reshard": ["--world-size", "3", "--from-step", "0", "-o", str(tmp_path / "new.arrow")]}
    result = runner.invoke(app, [command, str(path), *extra.get(command, [])])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: ")
    assert "truncated or incomplete; rebuild it" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.arrow"]


def test_not_arrow_and_a_damaged_footer_are_not_called_truncated(tmp_path):
    junk = tmp_path / "junk.arrow"
    junk.write_text("epoch,step\n0,0\n")
    with pytest.raises(PlanFormatError, match="not a batchplan plan \\(not an Arrow IPC file"):
        open_plan(junk)
    damaged = small_plan(tmp_path / "damaged.arrow")
    data = bytearray(damaged.read_bytes())
    data[-9] ^= 0xFF  # the footer's length: the file still ends with the magic
    damaged.write_bytes(bytes(data))
    with pytest.raises(PlanFormatError, match="footer is unreadable .*; the file is corrupt, rebuild it") as raised:
        open_plan(damaged)
    assert "truncated" not in str(raised.value)


# -- another world size ----------------------------------------------------------------


def test_a_world_size_mismatch_names_reshard_and_its_call_works(tmp_path):
    """The message's reshard call, with STEP and NEW filled in, makes a plan the run can use."""
    import batchplan
    from batchplan.runtime import PlanSampler

    path = small_plan(tmp_path / "plan.arrow", world_size=2)
    with pytest.raises(PlanMismatchError) as raised:
        PlanSampler(path, rank=0, world_size=3)
    message = str(raised.value)
    assert "the plan was built for world_size 2 but this run has world_size 3" in message
    assert "launch 2 ranks" in message and "`world_size=3`" in message
    suggested = re.search(r"`(batchplan\.reshard_plan_file\([^`]*\))`", message).group(1)
    new = tmp_path / "new.arrow"
    call = suggested.replace("STEP", "1").replace("NEW.arrow", str(new))
    assert call.startswith(f"batchplan.reshard_plan_file({str(path)!r}, ")
    eval(call, {"batchplan": batchplan})
    assert PlanSampler(new, rank=2, world_size=3).world_size == 3


# -- a full disk ------------------------------------------------------------------------


class FullDisk(io.FileIO):
    """A file on a disk that fills up after ``room`` bytes."""

    room = 2_000

    def write(self, data) -> int:
        if self.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


@pytest.fixture
def fill_disk(monkeypatch):
    """Call it to make every plan write from then on run out of space."""
    return lambda: monkeypatch.setattr(
        plan_writer.pa, "OSFile", lambda path, mode: pa.PythonFile(FullDisk(path, "wb"), mode="w")
    )


def build_args(output: Path, seed: int) -> list[str]:
    return ["build", str(SQUAD), "-o", str(output), "--max-tokens", "1024", "--seed", str(seed), "-q"]


def test_a_full_disk_names_the_path_and_keeps_the_previous_plan(tmp_path, fill_disk):
    plan = tmp_path / "plan.arrow"
    assert runner.invoke(app, build_args(plan, seed=0)).exit_code == 0
    before = plan.read_bytes()
    fill_disk()
    result = runner.invoke(app, build_args(plan, seed=1))
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"error: {plan}: cannot write the plan (No space left on device); the previous plan.arrow is "
        f"untouched; free space on the disk holding {tmp_path} or choose another -o"
    ], result.stderr
    assert "Errno" not in result.stderr
    assert plan.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.arrow"]  # no temporary left


def test_a_full_disk_without_a_previous_plan_writes_nothing(tmp_path, fill_disk):
    plan = tmp_path / "plan.arrow"
    fill_disk()
    with pytest.raises(OSError) as raised:
        small_plan(plan)
    assert raised.value.errno == errno.ENOSPC  # still an OSError a caller can test
    assert str(raised.value).startswith(f"{plan}: cannot write the plan (No space left on device); nothing was written")
    assert list(tmp_path.iterdir()) == []
