"""Layering: `import batchplan` is light; readers of plans never load numba."""

from __future__ import annotations

import subprocess
import sys

import pytest


def loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(m for m in ('numba', 'torch', 'typer') if m in sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(result.stdout.split())


def test_import_batchplan_is_light():
    assert loaded_after("import batchplan") == set()


@pytest.mark.parametrize("module", ["batchplan.plan_file", "batchplan.lengths", "batchplan.summary", "batchplan.validate"])
def test_file_layer_does_not_import_numba(module):
    assert "numba" not in loaded_after(f"import {module}")


def test_kernels_package_import_is_light():
    assert loaded_after("import batchplan.kernels") == set()
