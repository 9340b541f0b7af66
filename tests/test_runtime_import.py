"""Layering: the runtime is numpy + pyarrow + torch; importing it loads neither numba nor typer,
nor any library an integration adapts."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_importing_the_runtime_loads_no_numba_and_no_typer():
    code = (
        "import sys\n"
        "import batchplan.runtime, batchplan.toy\n"
        "from batchplan.runtime import PlanSampler, PackCollator, PadCollator, token_lr_scheduler\n"
        "banned = ('numba', 'typer', 'llvmlite', 'batchplan_cli', 'transformers', 'trl', 'accelerate', 'lightning',\n"
        "          'pytorch_lightning', 'torchdata', 'datasets', 'batchplan.integrations')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in banned or m.startswith('batchplan.integrations'))\n"
        "print(','.join(bad))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "", f"importing batchplan.runtime loaded: {done.stdout.strip()}"


def test_the_public_api_is_exported():
    import batchplan.runtime as runtime

    for name in (
        "PlanSampler",
        "PackCollator",
        "PadCollator",
        "PlanDataset",
        "MicroBatch",
        "PlanBatch",
        "with_record",
        "token_lr_scheduler",
        "token_loss_sum",
    ):
        assert name in runtime.__all__
        assert getattr(runtime, name) is not None


@pytest.mark.slow
def test_an_integration_whose_library_is_missing_says_how_to_install_it():
    code = (
        "import sys\n"
        "sys.modules['transformers'] = None  # as if not installed\n"
        "try:\n"
        "    import batchplan.integrations.transformers\n"
        "except Exception as error:\n"
        "    print(type(error).__name__, error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.startswith("ConfigError") and "pip install -e '.[integrations]'" in done.stdout
