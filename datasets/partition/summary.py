"""Heterogeneity statistics of a partition and its figure (`fedcli partition` prints and draws them).

Part of datasets/partition/. Per-client label
histograms, label entropy (bits) and total-variation distance to the global label mix; the
client x label heatmap and the client-size histogram, written atomically as a PNG.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class PartitionSummary:
    """Heterogeneity statistics of one partition (`fedcli partition` prints them)."""

    num_clients: int
    num_examples: int  # examples in the data
    num_assigned: int  # examples given to some client
    size_min: int
    size_median: float
    size_max: int
    size_mean: float
    num_classes: int | None  # None when the targets have no classes
    entropy: np.ndarray | None  # [K] per-client label entropy in bits
    global_entropy: float | None  # entropy of the global label distribution, bits
    tv: np.ndarray | None  # [K] total-variation distance to the global label distribution

    @property
    def mean_entropy(self) -> float | None:
        return None if self.entropy is None else float(self.entropy.mean())

    @property
    def mean_tv(self) -> float | None:
        """Mean TV distance; for unordered classes it equals the earth mover's distance."""
        return None if self.tv is None else float(self.tv.mean())


def label_histograms(
    clients: Sequence[np.ndarray], labels: np.ndarray, num_classes: int | None = None
) -> np.ndarray | None:
    """Return [K, C] per-client label counts (tag counts for multi-hot), or None if no classes."""
    labels = np.asarray(labels)
    if (
        labels.ndim == 1
        and np.issubdtype(labels.dtype, np.integer)
        and (len(labels) == 0 or labels.min() >= 0)
    ):
        c = max(num_classes or 0, int(labels.max()) + 1 if len(labels) else 0)
        return np.stack([np.bincount(labels[ix], minlength=c) for ix in clients]).astype(np.int64)
    if labels.ndim == 2 and np.isin(labels, (0, 1)).all():
        return np.stack([labels[ix].sum(axis=0) for ix in clients]).astype(np.int64)
    return None


def _entropy_bits(p: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, -p * np.log2(np.where(p > 0, p, 1.0)), 0.0)
    return terms.sum(axis=-1)


def summarize(clients: list[np.ndarray], labels: np.ndarray, num_classes: int | None) -> PartitionSummary:
    """Sizes (min/median/max), per-client label entropy and TV distance to the global mix."""
    sizes = np.array([len(c) for c in clients])
    hist = label_histograms(clients, labels, num_classes)
    entropy = tv = global_entropy = None
    if hist is not None:
        totals = hist.sum(axis=1, keepdims=True)
        dist = hist / np.maximum(totals, 1)  # [K, C]
        overall = hist.sum(axis=0) / max(hist.sum(), 1)  # [C]
        entropy = _entropy_bits(dist)
        global_entropy = float(_entropy_bits(overall))
        tv = 0.5 * np.abs(dist - overall).sum(axis=1)
    assigned = int(len(np.unique(np.concatenate(clients)))) if clients else 0
    return PartitionSummary(
        num_clients=len(clients),
        num_examples=len(labels),
        num_assigned=assigned,
        size_min=int(sizes.min()),
        size_median=float(np.median(sizes)),
        size_max=int(sizes.max()),
        size_mean=float(sizes.mean()),
        num_classes=None if hist is None else hist.shape[1],
        entropy=entropy,
        global_entropy=global_entropy,
        tv=tv,
    )


def plot_partition(
    clients: list[np.ndarray], labels: np.ndarray, num_classes: int | None, path: Path
) -> None:
    """Draw the client x label count heatmap and the client size histogram to a PNG."""
    fig = partition_figure(clients, labels, num_classes)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(handle)
    try:  # temp file + rename: a failed write (disk full) leaves no half-written PNG
        fig.savefig(tmp, dpi=110, format="png")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def partition_figure(clients: list[np.ndarray], labels: np.ndarray, num_classes: int | None) -> Any:
    """The figure `plot_partition` saves: every axis counts clients, labels or examples, so
    every tick is a whole number."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    hist = label_histograms(clients, labels, num_classes)
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    heat, sizes = fig.subplots(1, 2, width_ratios=(2, 1))
    if hist is None:
        heat.text(0.5, 0.5, "targets have no classes", ha="center", va="center")
    else:
        image = heat.imshow(hist.T, aspect="auto", interpolation="nearest", cmap="viridis", origin="lower")
        fig.colorbar(image, ax=heat, label="examples", ticks=MaxNLocator(integer=True))
        heat.set_xlabel("client")
        heat.set_ylabel("label")
    heat.set_title("examples per client and label")
    sizes.hist([len(c) for c in clients], bins=min(30, max(len(clients), 1)), color="tab:blue")
    sizes.set_xlabel("client size (examples)")
    sizes.set_ylabel("clients")
    for axis in (heat.xaxis, heat.yaxis, sizes.xaxis, sizes.yaxis):  # clients, labels, sizes: whole numbers
        axis.set_major_locator(MaxNLocator(integer=True))
    sizes.set_title(f"{len(clients)} clients")
    return fig
