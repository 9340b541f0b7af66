"""The command output the docs show is what the commands print (``bench.docs --check``).

Every ```text block that opens with ``$ batchplan ...`` and shows output is run again
from the repository root; plans and comparisons are deterministic, so the output
must match to the character. Regenerate with ``.venv/bin/python -m bench.docs``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.docs import ROOT, documents, stale_blocks


@pytest.mark.slow
@pytest.mark.parametrize("document", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_shown_command_output_is_fresh(document: Path):
    if "../shared/" in document.read_text() and not (ROOT.parent / "shared" / "data").is_dir():
        pytest.skip("needs ../shared/data beside the repository")
    _, stale = stale_blocks(document)
    assert not stale, f"{document.name}: stale output of {stale}; regenerate with .venv/bin/python -m bench.docs"
