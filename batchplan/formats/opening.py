"""Open a plan whatever its layout: a plan file (`batchplan.formats.plan_file.PlanFile`) or a
plan directory (`batchplan.formats.plan_directory.PlanDirectory`), both an `OpenedPlan`."""

from __future__ import annotations

import os
from pathlib import Path

from batchplan.formats.opened_plan import OpenedPlan
from batchplan.formats.plan_directory import PlanDirectory
from batchplan.formats.plan_file import PlanFile

__all__ = ["open_plan"]


def open_plan(path: str | os.PathLike) -> OpenedPlan:
    """Open a plan: a plan file by memory map (`PlanFile`), or a plan directory by its
    manifest (`PlanDirectory`)."""
    if Path(path).is_dir():
        return PlanDirectory(path)
    return PlanFile(path)
