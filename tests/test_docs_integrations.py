"""docs/integrations.md runs as pasted: every script and command of the page, in order, on 2 processes.

Each ```python block opens with ``# <file>: <command>``; the test writes the file and
runs the command (``.venv/bin/...`` is this environment's interpreter), and runs each
line of each ```sh block, in a fresh directory with the repository's ``.venv`` linked in.
What the page leaves there does not overwrite the README demo's ``plan.arrow`` and is
ignored by the repository's .gitignore.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _spawn import documented_steps, run_documented

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "integrations.md"

for module in ("transformers", "trl", "accelerate", "lightning", "torchdata", "datasets"):
    pytest.importorskip(module)


@pytest.mark.slow
def test_every_script_and_command_of_the_page_runs_as_written(tmp_path):
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    ran = []
    for command, file, content in documented_steps(PAGE):
        if file is not None:
            (tmp_path / file).write_text(content)
        run_documented(command, tmp_path, env)
        ran.append(command)
    assert sum("torchrun" in c for c in ran) == 5
    assert (tmp_path / "out-trainer" / "checkpoint-10" / "batchplan_sampler_rank1.json").exists()
    assert (tmp_path / "out-accelerate").is_dir() and (tmp_path / "loader1.pt").exists()
    assert not (tmp_path / "plan.arrow").exists()  # the README demo's plan is left alone
    left = sorted(path.name + ("/" if path.is_dir() else "") for path in tmp_path.iterdir() if path.name != ".venv")
    assert not_ignored(left) == [], "the page leaves files that .gitignore does not ignore"


def not_ignored(names: list[str]) -> list[str]:
    """The names (relative to the repository root; folders end in /) that .gitignore does not ignore."""
    done = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, input="\n".join(names),
                          capture_output=True, text=True)
    ignored = set(done.stdout.splitlines())
    return [name for name in names if name not in ignored]
