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


def build_command(tmp_path: Path, name: str) -> list[str]:
    options = ["-o", str(tmp_path / name), "--max-tokens", "4096", "--world-size", "2"]
    return [sys.executable, "-m", "batchplan_cli.main", "build", str(SQUAD), *options]


def build_environment(cache: Path, *, terminal: bool) -> dict[str, str]:
    """An environment with numba's cache at ``cache`` (empty: the first build compiles every
    kernel it uses, ~10-30 s), on a terminal as rich sees it or on a pipe."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    env.pop("FORCE_COLOR", None)
    env.pop("TTY_COMPATIBLE", None)
    if terminal:
        env["TTY_COMPATIBLE"] = "1"
    return env


def run_build(tmp_path: Path, name: str, cache: Path, *, terminal: bool) -> subprocess.CompletedProcess:
    env = build_environment(cache, terminal=terminal)
    return subprocess.run(build_command(tmp_path, name), capture_output=True, text=True, env=env, cwd=tmp_path)


@pytest.mark.slow
def test_a_first_build_on_a_pipe_writes_nothing_to_stderr_and_the_next_on_a_terminal_does_not_compile(tmp_path):
    cache = tmp_path / "numba-cache"
    first = run_build(tmp_path, "first.arrow", cache, terminal=False)
    assert first.returncode == 0 and first.stderr == "" and first.stdout.startswith("wrote ")
    second = run_build(tmp_path, "second.arrow", cache, terminal=True)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "reading lengths" in second.stderr and COMPILING not in second.stderr
    assert (tmp_path / "first.arrow").read_bytes() == (tmp_path / "second.arrow").read_bytes()


@pytest.mark.slow
def test_a_first_build_on_a_terminal_says_kernels_compile(tmp_path):
    """The build is stopped once the line shows: what follows is the build above's."""
    env = build_environment(tmp_path / "numba-cache", terminal=True)
    build = subprocess.Popen(build_command(tmp_path, "plan.arrow"), stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    shown = b""
    try:
        while COMPILING.encode() not in shown and (chunk := os.read(build.stderr.fileno(), 65536)):
            shown += chunk
    finally:
        build.kill()
        build.wait()
        build.stderr.close()
    assert COMPILING.encode() in shown, shown.decode(errors="replace")[-3000:]
