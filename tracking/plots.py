"""Report figures: learning curves over seeds and the partition heatmap (matplotlib, Agg).

Figures are built on `matplotlib.figure.Figure` with an Agg canvas (no pyplot, no global
state) and saved without the `Software` metadata entry and at a fixed size and dpi, so the
same store gives the same PNG bytes on the same matplotlib version.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedcli.tracking import metric_defs as md

if TYPE_CHECKING:
    from fedcli.tracking.report import Report

__all__ = ["learning_curves", "partition_heatmap"]

_DPI = 100
_METADATA = {"Software": None}


def _figure(width: float, height: float):  # noqa: ANN202 - matplotlib types stay lazy
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _dense(curves: list[tuple[np.ndarray, np.ndarray]], last: int) -> np.ndarray:
    """Stack curves into [runs, last + 1] with NaN where a round was not logged."""
    out = np.full((len(curves), last + 1), np.nan)
    for i, (rounds, values) in enumerate(curves):
        out[i, rounds] = values
    return out


def learning_curves(report: Report, key: str, path: Path) -> bool:
    """Per group: per-round mean over seeds (x markers), running average (line), ±1 std band.

    The running average is the report's trailing `smooth`-round average (metric_defs), drawn
    from round 1 with partial windows before round `smooth`; the band is ±1 sample std over
    seeds of the per-seed running averages (2+ seeds).

    Returns:
        False (and writes nothing) when no run logged `key`.
    """
    smooth = report.spec.smooth
    fig = _figure(7.5, 4.5)
    ax = fig.add_subplot()
    drawn = False
    for i, group in enumerate(report.groups):
        curves = [report.curves[r.id][key] for r in group.runs if key in report.curves[r.id]]
        if not curves:
            continue
        drawn = True
        color = f"C{i % 10}"
        last = max(int(rounds[-1]) for rounds, _ in curves)
        points = _dense(curves, last)
        averages = _dense([(rounds, md.running_average(rounds, values, smooth, full_window=False)) for rounds, values in curves], last)
        x = np.arange(last + 1)
        with warnings.catch_warnings():  # all-NaN rounds: 'Mean of empty slice'
            warnings.simplefilter("ignore", RuntimeWarning)
            mean_points = np.nanmean(points, axis=0)
            mean_avg = np.nanmean(averages, axis=0)
            std_avg = np.nanstd(averages, axis=0, ddof=1) if len(curves) > 1 else None
        ax.plot(x, mean_points, linestyle="none", marker="x", markersize=3, alpha=0.35, color=color)
        ax.plot(x, mean_avg, color=color, linewidth=1.6, label=f"{group.label} (n={len(curves)})")
        if std_avg is not None:
            ax.fill_between(x, mean_avg - std_avg, mean_avg + std_avg, color=color, alpha=0.18, linewidth=0)
    if not drawn:
        return False
    ax.set_xlabel("round")
    ax.set_ylabel(key)
    ax.set_title(f"{key}: per-round mean over seeds (×), {smooth}-round running average (line, ±1 std band)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI, metadata=_METADATA)
    return True


def partition_heatmap(counts: np.ndarray, path: Path, title: str) -> None:
    """Draw a [clients, labels] example-count matrix as a heatmap (clients on x, labels on y)."""
    fig = _figure(9.0, 4.0)
    ax = fig.add_subplot()
    image = ax.imshow(np.asarray(counts).T, aspect="auto", interpolation="nearest", cmap="viridis", origin="lower")
    fig.colorbar(image, ax=ax, label="examples")
    ax.set_xlabel("client")
    ax.set_ylabel("label")
    ax.set_title(title, fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI, metadata=_METADATA)



def report_figures(report: Report, output: Path, counts: np.ndarray | None = None,
                   counts_title: str = "") -> list[tuple[str, str]]:
    """Draw the report's PNGs beside `output`; return (caption, path relative to it) pairs.

    Files: `<stem>-<metric>.png`, `<stem>-loss.png` (eval/loss, when it is not the metric)
    and `<stem>-partition.png` when `counts` (clients x labels) is given.
    """
    stem, folder, figures = output.stem, output.parent, []
    keys = [report.metric] + (["eval/loss"] if report.metric != "eval/loss" else [])
    for key in keys:
        name = f"{stem}-{key.replace('/', '_')}.png"
        if learning_curves(report, key, folder / name):
            figures.append((f"Learning curves of {key} (one line per group; band: ±1 std over seeds).", name))
    if counts is not None:
        name = f"{stem}-partition.png"
        partition_heatmap(counts, folder / name, counts_title)
        figures.append((f"Partition shared by every run: {counts_title}.", name))
    return figures
