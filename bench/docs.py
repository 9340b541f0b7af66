"""Regenerate the output of every ``$ batchplan ...`` command the docs show.

    .venv/bin/python -m bench.docs            # rewrite stale blocks, redraw docs/example-plan.png
    .venv/bin/python -m bench.docs --check    # exit 1, naming each stale block

A block is a fenced ``text`` block of README.md or docs/*.md whose first line is
``$ batchplan ...`` and which shows the command's output below it; the command runs
from the repository root with ``COLUMNS=120`` (the tables' width), and the block
becomes its exact output. Plans and comparisons are deterministic for the same
versions, so a fresh run must match the docs to the character
(``tests/test_docs_fresh.py`` runs ``--check`` in CI). Blocks that show only a
command (no output) are left alone. Without ``--check`` it also redraws
docs/example-plan.png: the README's demo plan (its ``batchplan build`` command, written
to a temporary file) drawn by ``inspect --plot --dataset``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"```text\n(\$ (batchplan [^\n]*))\n(.*?)```", re.S)
COLUMNS = "120"


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def run(command: str) -> str:
    """The command's output (stdout, then stderr), as a terminal COLUMNS wide would show it."""
    executable = Path(sys.executable).with_name("batchplan")
    argv = [str(executable), *shlex.split(command)[1:]]
    env = {**os.environ, "COLUMNS": COLUMNS, "NO_COLOR": "1", "TERM": "dumb"}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"`{command}` exited {done.returncode}: {done.stderr.strip()}")
    return "\n".join(line.rstrip() for line in (done.stdout + done.stderr).rstrip().splitlines()) + "\n"


def stale_blocks(path: Path) -> tuple[str, list[str]]:
    """The document with every command block regenerated, and the commands whose output changed."""
    text = path.read_text()
    changed: list[str] = []

    def regenerate(match: re.Match) -> str:
        shown, command, output = match.group(1), match.group(2), match.group(3)
        if not output.strip():
            return match.group(0)
        fresh = run(command)
        if fresh != output:
            changed.append(command)
        return f"```text\n{shown}\n{fresh}```"

    return BLOCK.sub(regenerate, text), changed


def redraw_example_plan() -> Path:
    """docs/example-plan.png from the README's demo command (its build, to a temporary plan)."""
    readme = (ROOT / "README.md").read_text()
    line = readme.split("<!-- demo-command -->", 1)[1].split("```sh\n", 1)[1].splitlines()[0]
    build = next(part.strip() for part in line.split("&&") if "batchplan build" in part)
    argv = shlex.split(build)
    dataset = argv[2]
    with tempfile.TemporaryDirectory() as directory:
        plan = str(Path(directory) / "plan.arrow")
        argv[argv.index("-o") + 1] = plan
        run(shlex.join(["batchplan", *argv[1:]]))
        run(shlex.join(["batchplan", "inspect", plan, "--plot", "docs/example-plan.png", "--dataset", dataset]))
    return ROOT / "docs" / "example-plan.png"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="report stale blocks, change nothing")
    args = parser.parse_args()
    stale = 0
    for path in documents():
        text, changed = stale_blocks(path)
        for command in changed:
            print(f"{path.relative_to(ROOT)}: `{command}` shows output that a fresh run does not give")
        stale += len(changed)
        if changed and not args.check:
            path.write_text(text)
    if args.check and stale:
        print(f"{stale} stale block(s); regenerate them with: .venv/bin/python -m bench.docs")
        return 1
    if not args.check:
        print(f"redrew {redraw_example_plan().relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
