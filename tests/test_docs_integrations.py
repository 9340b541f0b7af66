"""docs/integrations.md runs as pasted: every script and command of the page, in order, on 2 processes.

Each ```python block opens with ``# <file>: <command>``; the test writes the file and
runs the command (``.venv/bin/...`` is this environment's interpreter), and runs each
line of each ```sh block, in a fresh directory with the repository's ``.venv`` linked in.
What the page leaves there does not overwrite the README demo's ``plan.arrow`` and is
ignored by the repository's .gitignore.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _spawn import run_documented

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "integrations.md"
HEADER = re.compile(r"# (?P<file>[\w.-]+\.py): (?P<command>.+)")

for module in ("transformers", "trl", "accelerate", "lightning", "torchdata", "datasets"):
    pytest.importorskip(module)


def steps(text: str) -> list[tuple[str, str | None, str]]:
    """``(command, file, content)`` for each runnable piece of the page, in order."""
    out = []
    for kind, body in re.findall(r"```(python|sh)\n(.*?)```", text, re.S):
        if kind == "sh":
            out += [(line, None, "") for line in body.splitlines() if line.strip()]
            continue
        header = HEADER.match(body.splitlines()[0])
        assert header, f"a python block of {PAGE.name} does not open with '# <file>: <command>':\n{body[:200]}"
        out.append((header["command"], header["file"], body))
    return out


@pytest.mark.slow
def test_every_script_and_command_of_the_page_runs_as_written(tmp_path):
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    ran = []
    for command, file, content in steps(PAGE.read_text()):
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
