"""docs/mixtures.md's training section runs as pasted: its build command and its script
(``# <file>: <command>``, run with torchrun on 2 processes), in order, in a fresh directory
with the repository's ``.venv`` and ``data/`` linked in; what they leave there is git-ignored.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from _spawn import documented_steps, not_ignored, run_documented

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "mixtures.md"


def test_the_page_has_a_build_command_and_a_training_script_that_call_the_venv():
    steps = documented_steps(PAGE)
    assert [file for _, file, _ in steps] == [None, "train_mixture.py"]
    for command, _, _ in steps:
        assert command.startswith(".venv/bin/"), command


@pytest.mark.slow
def test_the_training_script_prints_each_sources_loss(tmp_path):
    (tmp_path / "data").symlink_to(ROOT / "data")
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    output = ""
    for command, file, content in documented_steps(PAGE):
        if file is not None:
            (tmp_path / file).write_text(content)
        output = run_documented(command, tmp_path, env).stdout
    lines = re.findall(
        r"^step (\d+)  chat \S+ \(\S+ tokens\)  qa \S+ \(\S+ tokens\)  wiki \S+ \(\S+ tokens\)$", output, re.M
    )
    assert lines == ["10", "20", "30"], output
    assert not_ignored(tmp_path, (".venv", "data")) == [], "the page leaves files .gitignore does not ignore"
