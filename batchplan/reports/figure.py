"""The canvas every figure is drawn on, saving it, and series over steps drawn so that a plan of
millions of steps plots in seconds.

matplotlib is optional (``pip install -e '.[plot]'``) and imported only here, inside the
functions. Figures are built without pyplot on the Agg canvas: no window, no global state,
nothing changes a notebook's backend.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from batchplan.errors import BatchPlanError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["draw_epoch_lines", "draw_series", "matplotlib_modules", "require_matplotlib", "save_figure"]

_MAX_POINTS = 2_000  # a series longer than this is drawn per bin of steps
_BINS = 1_000


def matplotlib_modules():
    """The Agg-backed Figure class, or a clear error naming the extra to install."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise BatchPlanError(
            f"plotting needs matplotlib, which is not installed ({error}); "
            "install it with, from the batchplan checkout: pip install -e '.[plot]'"
        ) from error
    return Figure, FigureCanvasAgg


def require_matplotlib() -> None:
    """Raise `BatchPlanError` now if matplotlib is missing (before a long computation)."""
    matplotlib_modules()


def save_figure(figure: Figure, path: str | os.PathLike) -> Path:
    """Write ``figure`` (PNG, SVG or PDF by the file extension) and return the path."""
    _, canvas = matplotlib_modules()
    path = Path(path)
    if not path.parent.is_dir():
        raise BatchPlanError(f"{path}: directory {path.parent} does not exist; create it first")
    canvas(figure)
    try:
        figure.savefig(path, dpi=100)
    except ValueError as error:  # unknown extension
        raise BatchPlanError(f"{path}: cannot write this figure ({error}); use .png, .svg or .pdf") from error
    return path


def draw_series(ax: Axes, values: NDArray, color: str, label: str, zorder: float = 2) -> None:
    """A per-step series (NaN: a step left out); long ones as the mean per bin of steps with a
    min-max band."""
    if values.shape[0] <= _MAX_POINTS:
        ax.plot(np.arange(values.shape[0]), values, color=color, linewidth=0.8, label=label, zorder=zorder)
        return
    edges = np.linspace(0, values.shape[0], _BINS + 1).astype(np.int64)
    known = np.nan_to_num(values, nan=0.0)
    counted = np.add.reduceat(~np.isnan(values), edges[:-1])
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.add.reduceat(known, edges[:-1]) / counted
    low = np.fmin.reduceat(values, edges[:-1])
    high = np.fmax.reduceat(values, edges[:-1])
    centre = (edges[:-1] + edges[1:]) / 2
    ax.fill_between(centre, low, high, color=color, alpha=0.25, linewidth=0, zorder=zorder)
    step_bin = values.shape[0] / _BINS
    ax.plot(
        centre,
        mean,
        color=color,
        linewidth=0.8,
        label=f"{label}; mean per {step_bin:,.0f} steps, band min-max",
        zorder=zorder,
    )


def draw_epoch_lines(ax: Axes, starts: NDArray) -> None:
    """A dotted line where each epoch starts."""
    for start in starts:
        ax.axvline(start, color="grey", linestyle=":", linewidth=0.8)
