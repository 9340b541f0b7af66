"""A first run says that kernels compile, and only a run that compiles says it
(`batchplan.kernels.compiling`, `batchplan_cli.progress`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _modules import loaded_after
from numba import njit

import batchplan.kernels.startup  # noqa: F401  (forwards numba's compile events)
from batchplan.kernels.compiling import watch_compilation
from batchplan_cli.progress import COMPILING, BuildProgress

ROOT = Path(__file__).resolve().parent.parent
SQUAD = ROOT / "data" / "squad11_bert384.parquet"


def new_kernel():
    """A kernel numba has not compiled yet (no cache): its first call compiles."""

    @njit
    def add_one(values):
        return values + 1

    return add_one


def test_a_watcher_hears_one_compilation_then_nothing_once_compiled():
    kernel = new_kernel()
    heard = []
    with watch_compilation(heard.append):
        kernel(np.zeros(3, dtype=np.int64))
        first = list(heard)
        kernel(np.ones(3, dtype=np.int64))
    assert first == [True, False] and heard == first


def test_a_new_type_specialisation_is_a_compilation_too():
    kernel = new_kernel()
    kernel(np.zeros(3, dtype=np.int64))
    heard = []
    with watch_compilation(heard.append):
        kernel(np.zeros(3, dtype=np.int32))
    assert heard == [True, False]


def test_a_watcher_hears_nothing_after_its_block():
    heard = []
    with watch_compilation(heard.append):
        pass
    new_kernel()(np.zeros(3, dtype=np.int64))
    assert heard == []


def run_build_progress(kernel, values, monkeypatch, capsys) -> str:
    """What `BuildProgress` writes to a terminal while ``kernel(values)`` runs inside it."""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich draws as on a terminal
    with BuildProgress() as progress:
        progress.stage("planning epochs", 1)
        kernel(values)
    return capsys.readouterr().err


def test_the_progress_display_shows_the_compiling_line_while_a_kernel_compiles(monkeypatch, capsys):
    assert COMPILING in run_build_progress(new_kernel(), np.zeros(3, dtype=np.int64), monkeypatch, capsys)


def test_the_progress_display_has_no_compiling_line_when_nothing_compiles(monkeypatch, capsys):
    kernel = new_kernel()
    kernel(np.zeros(3, dtype=np.int64))
    shown = run_build_progress(kernel, np.zeros(3, dtype=np.int64), monkeypatch, capsys)
    assert "planning epochs" in shown and COMPILING not in shown


@pytest.mark.slow
def test_the_compiling_module_does_not_import_numba():
    assert "numba" not in loaded_after("import batchplan.kernels.compiling")


@pytest.mark.slow
def test_a_first_build_on_a_terminal_says_kernels_compile_and_the_next_build_does_not(tmp_path):
    # An empty numba cache of its own: the first build compiles every kernel it uses (~10-30 s).
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache"), "TTY_COMPATIBLE": "1"}
    plans, shown = [], []
    for name in ("first.arrow", "second.arrow"):
        options = ["-o", str(tmp_path / name), "--max-tokens", "4096", "--world-size", "2"]
        command = [sys.executable, "-m", "batchplan_cli.main", "build", str(SQUAD), *options]
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        plans.append((tmp_path / name).read_bytes())
        shown.append(done.stderr)
    assert COMPILING in shown[0] and "reading lengths" in shown[1] and COMPILING not in shown[1]
    assert plans[0] == plans[1]


@pytest.mark.slow
def test_a_first_build_on_a_pipe_writes_nothing_to_stderr(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    env.pop("TTY_COMPATIBLE", None)
    env.pop("FORCE_COLOR", None)
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
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == "" and done.stdout.startswith("wrote ")
