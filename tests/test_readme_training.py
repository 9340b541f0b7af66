"""The README's training section runs as written: its two commands and its train.py.

The data is the first 64 conversations of data/sharegpt_dialogues_cl100k.parquet (the
full file trains for minutes), placed where the README's commands read it; the build
command, the script and the torchrun launch are the README's, unchanged. Each rank
saves its sampler state after every step; the test checks the last ones end the plan.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DATA = "data/sharegpt_dialogues_cl100k.parquet"


def training_section() -> tuple[list[str], str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Training with a plan", 1)[1].split("\n## ", 1)[0]
    commands = re.search(r"```sh\n(.*?)```", section, re.S).group(1).strip().splitlines()
    script = re.search(r"```python\n(# train\.py.*?)```", section, re.S).group(1)
    return commands, script


@pytest.mark.slow
def test_the_readme_training_section_runs_as_written(tmp_path):
    commands, script = training_section()
    assert len(commands) == 2 and commands[1].startswith(".venv/bin/torchrun")
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    (tmp_path / "data").mkdir()
    table = pq.read_table(ROOT / DATA).slice(0, 64)
    pq.write_table(table, tmp_path / DATA)
    (tmp_path / "train.py").write_text(script)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for command in commands:
        done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stderr[-3000:]}"
    from batchplan.runtime import PlanSampler

    for rank in (0, 1):
        state = torch.load(tmp_path / f"sampler{rank}.pt", weights_only=True)
        sampler = PlanSampler(tmp_path / "plan2.arrow", rank=rank, world_size=2)
        sampler.load_state_dict(state)
        assert sampler.finished  # the last state saved is the end of the plan
