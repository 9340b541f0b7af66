"""docs/runtime.md runs as pasted: each ```python block is a script (``# <file>: <command>``, run
like docs/integrations.md's) or says in its first line that it is a fragment, and each line of
each ```sh block runs, in order, in a fresh directory with the repository's ``.venv``,
``data/`` and ``examples/`` linked in. What the commands leave there is git-ignored.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from _spawn import documented_steps, not_ignored, run_documented

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "runtime.md"


def test_every_python_block_is_a_script_or_says_it_is_a_fragment():
    assert len(documented_steps(PAGE, fragments=True)) >= 2


def test_every_command_calls_the_venv():
    for command, _, _ in documented_steps(PAGE, fragments=True):
        assert command.startswith(".venv/bin/"), command


@pytest.mark.slow
def test_every_script_and_command_of_the_page_runs_as_written(tmp_path):
    for name in ("data", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outputs = []
    for command, file, content in documented_steps(PAGE, fragments=True):
        if file is not None:
            (tmp_path / file).write_text(content)
        done = run_documented(command, tmp_path, env)
        outputs.append(done.stdout)
    assert "resumed from example-checkpoint.pt at step 20" in outputs[-1]
    assert re.search(r"^step   40 ", outputs[-1], re.M)
    linked = (".venv", "data", "examples")
    assert not_ignored(tmp_path, linked) == [], "the page leaves files .gitignore does not ignore"
