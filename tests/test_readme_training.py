"""The README's training section runs as pasted after the demo command: its install line, its
build command, its train.py and the torchrun launch, unchanged, on the full demo data.

The install line runs with ``--dry-run --ignore-installed`` from the repository root (it must
not rewrite the environment the tests run in): it resolves, and to torch's CPU build, with no
CUDA package. The other two lines run in a fresh directory with the repository's ``.venv`` and
``data/`` linked in. train.py stops at its ``MAX_STEPS``; the test checks that rank 0 prints
progress lines (step, loss, tokens/s, time left) up to the last step, and that each rank's last
saved sampler state is the plan's state right before that step, and that what the section
leaves in the directory is git-ignored.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _spawn import not_ignored, run_documented

ROOT = Path(__file__).resolve().parent.parent
INSTALL = ".venv/bin/pip install -e '.[torch]' torch==2.13.0"
PROGRESS = re.compile(r"step (?P<done>[\d,]+)/(?P<last>[\d,]+)  loss \d+\.\d{3}  [\d,]+ tokens/s  \d+ s left")


def training_section() -> tuple[list[str], str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Training with a plan", 1)[1].split("\n## ", 1)[0]
    commands = re.search(r"```sh\n(.*?)```", section, re.S).group(1).strip().splitlines()
    script = re.search(r"```python\n(# train\.py.*?)```", section, re.S).group(1)
    return commands, script


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_documented(command, cwd, {**os.environ, "OMP_NUM_THREADS": "1"})


def test_the_section_opens_with_the_pinned_install_line():
    commands, _ = training_section()
    assert commands[0] == INSTALL
    assert len(commands) == 3 and commands[2] == ".venv/bin/torchrun --nproc_per_node 2 train.py"


@pytest.mark.slow
def test_the_install_line_resolves_to_the_cpu_build_of_torch():
    commands, _ = training_section()
    done = run(commands[0] + " --dry-run --ignore-installed", ROOT)
    would_install = done.stdout.splitlines()[-1]
    assert would_install.startswith("Would install") and "torch-2.13.0" in would_install
    assert "nvidia" not in would_install.lower() and "cuda" not in would_install.lower()


@pytest.mark.slow
def test_the_readme_training_section_runs_as_written_and_shows_progress(tmp_path):
    commands, script = training_section()
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    (tmp_path / "data").symlink_to(ROOT / "data")
    (tmp_path / "train.py").write_text(script)
    max_steps = int(re.search(r"^MAX_STEPS = (\d+)", script, re.M).group(1))
    for command in commands[1:-1]:
        run(command, tmp_path)
    lines = [line for line in run(commands[-1], tmp_path).stdout.splitlines() if line.startswith("step ")]
    progress = [PROGRESS.fullmatch(line) for line in lines]
    assert len(progress) >= 2 and all(progress), "\n".join(lines)
    assert {int(m["last"].replace(",", "")) for m in progress} == {max_steps}
    assert int(progress[-1]["done"].replace(",", "")) == max_steps  # the run ends at its last step
    from batchplan.runtime import PlanSampler

    for rank in (0, 1):
        state = torch.load(tmp_path / f"sampler{rank}.pt", weights_only=True)
        sampler = PlanSampler(tmp_path / "plan2.arrow", rank=rank, world_size=2)
        assert state == sampler.state_at_step(max_steps)  # the last state saved: right before step MAX_STEPS
    assert not_ignored(tmp_path, (".venv", "data")) == [], "the section leaves files .gitignore does not ignore"
