"""What a new user sees in their first hour reads right.

- A plan where ranks never get a sample says so: a warning line under the build summary and
  from ``inspect`` (table and ``--json``), naming how many ranks run only empty micro-batches.
- A statistic with nothing to average (no regular step) shows "n/a", never 0 %.
- A count that is the same in every step shows once (``1``, not ``1..1``); the packing row says
  the packing and its bound once each.
- An error on a stderr that is not a terminal is one line, with no empty line before it; a
  mistyped option is click's usage error, exit code 2, as the README says.
- The distribution name is not the package index's ``batchplan``, and no install line of the
  README or the docs names the index's ``batchplan``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchplan_cli.main import app

ROOT = Path(__file__).resolve().parent.parent
SQUAD = ROOT / "data" / "squad11_bert384.parquet"
runner = CliRunner()


@pytest.fixture()
def three_samples(tmp_path) -> Path:
    path = tmp_path / "three.parquet"
    pq.write_table(pa.table({"length": [10, 20, 30]}), path)
    return path


def row(table: str, name: str) -> str:
    """The value of row ``name`` of a summary table printed wide enough to keep rows on one line."""
    line = next(line for line in table.splitlines() if line.startswith(f"│ {name} "))
    return line.split("│")[2].strip()


def test_ranks_without_a_sample_are_a_warning_in_build_and_inspect(tmp_path, three_samples):
    plan = tmp_path / "plan.arrow"
    options = ["--max-tokens", "64", "--world-size", "8"]
    built = runner.invoke(app, ["build", str(three_samples), "-o", str(plan), *options])
    assert built.exit_code == 0, built.output
    warning = "warning: 5 of 8 ranks get no sample: they run only empty micro-batches"
    assert warning in built.stderr and warning not in built.stdout
    shown = runner.invoke(app, ["inspect", str(plan)])
    assert shown.exit_code == 0 and warning in shown.stderr
    as_json = runner.invoke(app, ["inspect", str(plan), "--json"])
    assert as_json.exit_code == 0 and warning in as_json.stderr and '"idle_ranks": 5' in as_json.stdout


def test_a_plan_with_a_sample_on_every_rank_has_no_warning(tmp_path):
    plan = tmp_path / "plan.arrow"
    built = runner.invoke(app, ["build", str(SQUAD), "-o", str(plan), "--max-tokens", "4096", "--world-size", "8"])
    assert built.exit_code == 0 and "warning" not in built.output


def test_statistics_without_a_step_to_average_show_n_a(tmp_path, three_samples):
    plan = tmp_path / "plan.arrow"
    runner.invoke(app, ["build", str(three_samples), "-o", str(plan), "--max-tokens", "64", "--world-size", "8", "-q"])
    table = runner.invoke(app, ["inspect", str(plan)], env={"COLUMNS": "200"}).stdout
    assert row(table, "fill").startswith("n/a") and row(table, "token imbalance").startswith("n/a")
    assert "0.000%" not in row(table, "fill") + row(table, "token imbalance")


def test_an_equal_count_per_step_shows_once_and_the_packing_row_says_each_number_once(tmp_path, three_samples):
    plan = tmp_path / "plan.arrow"
    runner.invoke(app, ["build", str(SQUAD), "-o", str(plan), "--max-tokens", "4096", "--world-size", "8", "-q"])
    table = runner.invoke(app, ["inspect", str(plan)], env={"COLUMNS": "200"}).stdout
    assert row(table, "micro-batches per rank per step") == "1"
    packing = row(table, "packing")
    assert re.fullmatch(
        r"[\d,]+ micro-batches, (the fewest possible|[\d,]+ above) \(the \w+ bound: >= [\d,]+, "
        r"at most \d+\.\d{3}% fill\)",
        packing,
    ), packing
    assert packing.count("%") == 1
    varying = tmp_path / "varying.arrow"
    runner.invoke(
        app,
        [
            "build",
            str(SQUAD),
            "-o",
            str(varying),
            "--max-tokens",
            "4096",
            "--world-size",
            "8",
            "--tokens-per-step",
            "100000",
            "-q",
        ],
    )
    steps = row(
        runner.invoke(app, ["inspect", str(varying)], env={"COLUMNS": "200"}).stdout, "micro-batches per rank per step"
    )
    assert re.fullmatch(r"\d+\.\.\d+", steps), steps


@pytest.mark.slow
def test_an_error_on_a_pipe_is_one_line_with_no_empty_line_before_it(tmp_path):
    command = [
        sys.executable,
        "-m",
        "batchplan_cli.main",
        "build",
        str(tmp_path / "none.parquet"),
        "-o",
        str(tmp_path / "plan.arrow"),
        "--max-tokens",
        "8",
    ]
    failed = subprocess.run(command, capture_output=True, text=True)
    assert failed.returncode == 1
    assert failed.stderr.startswith("error: ") and failed.stderr.count("\n") == 1, repr(failed.stderr)


@pytest.mark.slow
def test_a_build_on_a_pipe_writes_nothing_to_stderr(tmp_path):
    command = [
        sys.executable,
        "-m",
        "batchplan_cli.main",
        "build",
        str(SQUAD),
        "-o",
        str(tmp_path / "plan.arrow"),
        "--max-tokens",
        "4096",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == "" and done.stdout.startswith("wrote ")


def test_a_mistyped_option_is_a_usage_error_with_exit_code_2_as_the_readme_says():
    result = runner.invoke(app, ["build", str(SQUAD), "-o", "plan.arrow", "--max-tokns", "8"])
    assert result.exit_code == 2 and "No such option: --max-tokns" in result.output
    readme = (ROOT / "README.md").read_text()
    assert "exit code 1" in readme and re.search(r"usage error[^.]*exit code 2", readme, re.S)


def test_the_distribution_name_is_not_the_package_index_batchplan():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "batchplan-llm"
    assert project["scripts"]["batchplan"] == "batchplan_cli.main:main"


def test_no_install_line_names_the_package_index_batchplan_and_torch_is_pinned():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    install = re.compile(r"pip install[^`&;#\n]*")  # one command: up to its end, `&&`, `;` or a comment
    installs = [(page.name, found) for page in pages for found in install.findall(page.read_text())]
    assert len(installs) >= 4
    for page, install in installs:
        assert not re.search(r"\bbatchplan\b", install), (page, install)
        if "torch" in install:
            assert "torch==2.13.0" in install, (page, install)
