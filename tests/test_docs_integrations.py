"""docs/integrations.md runs as pasted: every script and command of the page, on 2 processes.

Each ```python block opens with ``# <file>: <command>``; the test writes the file and runs the
command (``.venv/bin/...`` is this environment's interpreter), and runs each line of each ```sh
block, in a directory with the repository's ``.venv`` linked in. The page's setup (the blocks
before its first ``torchrun``: the tokenized data and the two plans) runs once per test process,
in order; each launch is a test of its own, in a copy of that directory, and a unit of its own
under ``pytest -n`` (conftest's ``ALONE``), so that xdist spreads them. What the page leaves
there does not overwrite the README demo's ``plan.arrow`` and is ignored by the repository's
.gitignore.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from _spawn import documented_steps, not_ignored, run_documented

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "integrations.md"
STEPS = documented_steps(PAGE)
FIRST_LAUNCH = next(i for i, (command, _, _) in enumerate(STEPS) if "torchrun" in command)
SETUP, LAUNCHES = STEPS[:FIRST_LAUNCH], STEPS[FIRST_LAUNCH:]

# What a launch leaves besides its script, by the script's name: a checkpoint of each stack.
LEFT = {
    "train_trainer.py": ["out-trainer/checkpoint-10/batchplan_sampler_rank1.json"],
    "train_sft.py": ["out-sft"],
    "train_accelerate.py": ["out-accelerate"],
    "train_torchdata.py": ["loader0.pt", "loader1.pt"],
    "train_lightning.py": [],
}


def test_the_page_sets_up_then_launches_each_stack_once():
    """Every step after the setup is a torchrun launch of one script, each stack's once."""
    assert [file for _, file, _ in SETUP] == ["make_data.py", None, None]
    assert all(command.startswith(".venv/bin/torchrun --nproc_per_node 2 ") for command, _, _ in LAUNCHES)
    assert sorted(file for _, file, _ in LAUNCHES) == sorted(LEFT)


@pytest.fixture(scope="session")
def environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="session")
def set_up(tmp_path_factory, environment) -> Path:
    """A directory after the page's setup, run as written: the data, then the two plans."""
    for module in ("transformers", "trl", "accelerate", "lightning", "torchdata", "datasets"):
        pytest.importorskip(module)
    directory = tmp_path_factory.mktemp("integrations-page")
    (directory / ".venv").symlink_to(Path(sys.prefix))
    for command, file, content in SETUP:
        if file is not None:
            (directory / file).write_text(content)
        run_documented(command, directory, environment)
    assert (directory / "plan-micro.arrow").is_file() and (directory / "plan-tokens.arrow").is_file()
    return directory


@pytest.mark.slow
@pytest.mark.parametrize(("command", "file", "content"), LAUNCHES, ids=[file for _, file, _ in LAUNCHES])
def test_each_launch_of_the_page_runs_as_written(set_up, environment, tmp_path, command, file, content):
    directory = tmp_path / "page"
    shutil.copytree(set_up, directory, symlinks=True)
    (directory / file).write_text(content)
    run_documented(command, directory, environment)
    for path in LEFT[file]:
        assert (directory / path).exists(), f"{command} did not write {path}"
    assert not (directory / "plan.arrow").exists()  # the README demo's plan is left alone
    assert not_ignored(directory) == [], "the page leaves files that .gitignore does not ignore"
