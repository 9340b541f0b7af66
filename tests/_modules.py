"""Which modules a statement loads, run in a fresh interpreter (`import batchplan` stays light;
the build, replay and readers leave pandas out)."""

from __future__ import annotations

import subprocess
import sys


def loaded_after(statement: str, watch: tuple[str, ...] = ("numba", "torch", "typer")) -> set[str]:
    """The modules of ``watch`` in ``sys.modules`` after ``statement`` (lines of Python) runs."""
    code = f"import sys\n{statement}\nprint(' '.join(sorted(m for m in {watch!r} if m in sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return set(result.stdout.strip().splitlines()[-1].split()) if result.stdout.strip() else set()
