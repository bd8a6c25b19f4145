"""Report figures: learning curves over seeds, the metric against bytes sent and against
training time, and the partition heatmap (matplotlib, Agg).

Figures are built on `matplotlib.figure.Figure` with an Agg canvas (no pyplot, no global
state) and saved twice, as a PNG at `_DPI` for the markdown and as an SVG beside it for
papers. Both are byte-identical for the same store on the same matplotlib version: no
`Software` entry in the PNG, no `Date` in the SVG, and a fixed SVG hash salt (its element
ids are otherwise random).

Fractions (accuracy, precision, recall, F1) are drawn in % as the tables show them. The
report's thresholds are dashed horizontal lines and its rounds R dotted vertical ones.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedcli.tracking import metric_defs as md
from fedcli.tracking.report.model import is_percent

if TYPE_CHECKING:
    from fedcli.tracking.report.model import Group, Report
    from fedcli.tracking.report.search import SearchSummary

__all__ = ["axis_label", "learning_curves", "metric_vs_cost", "partition_heatmap", "report_figures"]

_DPI = 200
_PNG_METADATA = {"Software": None}
_SVG_METADATA = {"Date": None}
_NAMES = {
    "accuracy": "accuracy",
    "loss": "loss",
    "dist_to_opt": "distance to optimum",
    "macro_f1": "macro F1",
    "micro_f1": "micro F1",
    "nll": "NLL",
    "ece": "ECE",
    "brier": "Brier score",
    "perplexity": "perplexity",
}
# x-axes of metric_vs_cost: (cumulative keys, per-round keys they sum, axis title, unit kind)
COSTS = {
    "bytes": (
        ("comm/cum_bytes_up", "comm/cum_bytes_down"),
        ("comm/bytes_up", "comm/bytes_down"),
        "bytes sent, up + down, cumulative",
        "bytes",
    ),
    "time": (("time/cum_train_s",), ("time/round_s",), "training time, cumulative", "seconds"),
}


def axis_label(key: str) -> str:
    """`eval/accuracy` -> `eval accuracy (%)`; `eval/dist_to_opt` -> `eval distance to optimum`."""
    split, _, name = key.rpartition("/")
    shown = " ".join([*([split] if split else []), _NAMES.get(name, name.replace("_", " "))])
    return f"{shown} (%)" if is_percent(key) else shown


def figure(width: float, height: float) -> Any:
    """A matplotlib Figure on an Agg canvas (no pyplot, no global state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def write_figure(fig: Any, path: Path) -> None:
    """Write `path` (PNG) and the SVG beside it, both reproducible byte for byte."""
    import matplotlib

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI, metadata=_PNG_METADATA)
    with matplotlib.rc_context({"svg.hashsalt": "fedcli-report"}):  # else element ids are random
        fig.savefig(path.with_suffix(".svg"), metadata=_SVG_METADATA)


def _dense(curves: Sequence[tuple[np.ndarray, np.ndarray]], last: int) -> np.ndarray:
    """Stack curves into [runs, last + 1] with NaN where a round was not logged."""
    out = np.full((len(curves), last + 1), np.nan)
    for i, (rounds, values) in enumerate(curves):
        out[i, rounds] = values
    return out


def _nan_stats(stack: np.ndarray, with_std: bool) -> tuple[np.ndarray, np.ndarray | None]:
    with warnings.catch_warnings():  # all-NaN rounds: 'Mean of empty slice'
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(stack, axis=0)
        std = np.nanstd(stack, axis=0, ddof=1) if with_std else None
    return mean, std


def _group_curves(report: Report, group: Group, key: str) -> list[tuple[np.ndarray, np.ndarray]]:
    return [report.curves[r.id][key] for r in group.runs if key in report.curves[r.id]]


def _band_words(counts: Sequence[int]) -> str:
    """What the band is, only as far as some group has 2+ seeds (one seed has no std)."""
    if all(n < 2 for n in counts):
        return "one seed per group, no std band"
    if all(n >= 2 for n in counts):
        return "band: ±1 std over seeds"
    return "band: ±1 std over seeds (groups with 2+)"


def _finish(
    fig: Any, ax: Any, report: Report, key: str, scale: float, xlabel: str, title: str, path: Path
) -> None:
    """The threshold lines (of the report's metric), labels, title, grid and legend; write the figure."""
    for x in report.spec.thresholds if key == report.metric else ():
        ax.axhline(x * scale, color="0.35", linestyle="--", linewidth=0.9)
        text = f"{x * scale:g}%" if scale != 1 else f"{x:g}"
        ax.annotate(
            f"threshold {text}",
            (0.005, x * scale),
            xycoords=("axes fraction", "data"),
            fontsize=7,
            color="0.3",
            va="bottom",
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel(axis_label(key))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    write_figure(fig, path)


def _smoothed(
    report: Report, group: Group, key: str, scale: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, int] | None:
    """(rounds x, per-round mean, running-average mean, its std or None, seeds) of a group, in display units."""
    curves = _group_curves(report, group, key)
    if not curves:
        return None
    smooth = report.spec.smooth or 1
    last = max(int(rounds[-1]) for rounds, _ in curves)
    points = _dense(curves, last) * scale
    averages = (
        _dense([(r, md.running_average(r, v, smooth, full_window=False)) for r, v in curves], last) * scale
    )
    mean_points, _ = _nan_stats(points, False)
    mean_avg, std_avg = _nan_stats(averages, len(curves) > 1)
    return np.arange(last + 1), mean_points, mean_avg, std_avg, len(curves)


def learning_curves(report: Report, key: str, path: Path) -> bool:
    """Per group: per-round mean over seeds (x markers), running average (line), ±1 std band.

    The running average is the report's trailing `smooth`-round average (metric_defs), drawn
    from round 1 with partial windows before round `smooth`; the band is ±1 sample std over
    seeds of the per-seed running averages, for groups with 2+ seeds. Rounds that were not
    evaluated are skipped (the line joins the evaluated ones), never interpolated as values.

    Returns:
        False (and writes nothing) when no run logged `key`.
    """
    scale = 100.0 if is_percent(key) else 1.0
    fig = figure(7.5, 4.5)
    ax = fig.add_subplot()
    seeds = []
    for i, group in enumerate(report.groups):
        drawn = _smoothed(report, group, key, scale)
        if drawn is None:
            continue
        x, mean_points, mean_avg, std_avg, n = drawn
        seeds.append(n)
        color, seen = f"C{i % 10}", ~np.isnan(mean_avg)
        ax.plot(x, mean_points, linestyle="none", marker="x", markersize=3, alpha=0.35, color=color)
        ax.plot(x[seen], mean_avg[seen], color=color, linewidth=1.6, label=f"{group.label} (n={n})")
        if std_avg is not None:
            ax.fill_between(
                x[seen],
                (mean_avg - std_avg)[seen],
                (mean_avg + std_avg)[seen],
                color=color,
                alpha=0.18,
                linewidth=0,
            )
    if not seeds:
        return False
    for r in report.at:
        ax.axvline(r, color="0.5", linestyle=":", linewidth=0.9)
        ax.annotate(
            f"R={r}",
            (r, 1.0),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            color="0.3",
            ha="right",
            va="top",
            rotation=90,
        )
    title = (
        f"{axis_label(key)} by round\n×: per-round mean over seeds; line: {report.spec.smooth}-round "
        f"running average; {_band_words(seeds)}"
    )
    _finish(fig, ax, report, key, scale, "communication round", title, path)
    return True


def cost_curve(curves: dict[str, tuple[np.ndarray, np.ndarray]], cost: str, last: int) -> np.ndarray | None:
    """Cumulative cost at rounds 0..last (NaN where unknown), from the cumulative keys, else by
    summing the per-round keys (md.cumulative); None when the run logged neither."""
    cumulative, per_round, _, _ = COSTS[cost]
    if all(k in curves for k in cumulative):
        parts = [_dense([curves[k]], last)[0] for k in cumulative]
    elif all(k in curves for k in per_round):
        parts = [_dense([(curves[k][0], md.cumulative(*curves[k]))], last)[0] for k in per_round]
    else:
        return None
    total = np.sum(parts, axis=0)
    total[0] = 0.0  # round 0, the initial model, has cost nothing yet
    return total


def _cost_unit(kind: str, largest: float) -> tuple[float, str]:
    if kind == "bytes":
        from fedcli.tracking.report.render import byte_unit

        return byte_unit(largest)
    return (3600.0, "h") if largest >= 3 * 3600 else (60.0, "min") if largest >= 180 else (1.0, "s")


def metric_vs_cost(report: Report, key: str, cost: str, path: Path) -> bool:
    """Per group: the running average of `key` (mean over seeds) against the mean cumulative cost.

    `cost` is "bytes" (comm/cum_bytes_up + comm/cum_bytes_down, or the sums of comm/bytes_*)
    or "time" (time/cum_train_s, or the sum of time/round_s). Only evaluated rounds are
    drawn; x is the mean over the group's seeds of the cost up to that round.

    Returns:
        False (and writes nothing) when no run logged both `key` and the cost.
    """
    scale = 100.0 if is_percent(key) else 1.0
    lines = []
    for i, group in enumerate(report.groups):
        drawn = _smoothed(report, group, key, scale)
        costs = [
            cost_curve(report.curves[r.id], cost, report.last_round[r.id])
            for r in group.runs
            if key in report.curves[r.id]
        ]
        if drawn is None or any(c is None for c in costs):
            continue
        x_rounds, _, mean_avg, std_avg, n = drawn
        last = len(x_rounds) - 1
        stacked = np.stack(
            [
                np.pad(c[: last + 1], (0, max(0, last + 1 - len(c))), constant_values=np.nan)
                for c in costs
                if c is not None
            ]
        )
        mean_cost, _ = _nan_stats(stacked, False)
        seen = ~np.isnan(mean_avg) & ~np.isnan(mean_cost)
        lines.append(
            (i, group, mean_cost[seen], mean_avg[seen], None if std_avg is None else std_avg[seen], n)
        )
    if not lines:
        return False
    _, _, title, kind = COSTS[cost]
    unit_scale, unit = _cost_unit(kind, max(float(np.max(x, initial=0.0)) for _, _, x, _, _, _ in lines))
    fig = figure(7.5, 4.5)
    ax = fig.add_subplot()
    for i, group, x, y, std, n in lines:
        color = f"C{i % 10}"
        ax.plot(
            x / unit_scale,
            y,
            color=color,
            linewidth=1.6,
            marker=".",
            markersize=3,
            label=f"{group.label} (n={n})",
        )
        if std is not None:
            ax.fill_between(x / unit_scale, y - std, y + std, color=color, alpha=0.18, linewidth=0)
    caption = (
        f"{axis_label(key)} against {title}\nline: {report.spec.smooth}-round running average, mean "
        f"over seeds; {_band_words([n for *_, n in lines])}"
    )
    _finish(fig, ax, report, key, scale, f"{title} ({unit})", caption, path)
    return True


def partition_heatmap(counts: np.ndarray, path: Path, title: str) -> None:
    """Draw a [clients, labels] example-count matrix as a heatmap (clients on x, labels on y)."""
    fig = figure(9.0, 4.0)
    ax = fig.add_subplot()
    image = ax.imshow(
        np.asarray(counts).T, aspect="auto", interpolation="nearest", cmap="viridis", origin="lower"
    )
    fig.colorbar(image, ax=ax, label="examples")
    ax.set_xlabel("client")
    ax.set_ylabel("label")
    ax.set_title(title, fontsize=9)
    write_figure(fig, path)


def report_figures(
    report: Report, output: Path, counts: np.ndarray | None = None, counts_title: str = ""
) -> list[tuple[str, str]]:
    """Draw the report's figures beside `output`; return (caption, PNG path relative to it) pairs.

    Files (each PNG with an SVG of the same stem): `<stem>-<metric>.png`, `<stem>-loss.png`
    (eval/loss, when it is not the metric), `<stem>-<metric>-vs-bytes.png`,
    `<stem>-<metric>-vs-time.png` and `<stem>-partition.png` when `counts` (clients x labels)
    is given.
    """
    stem, folder, figures = output.stem, output.parent, []
    band = _band_words([len(g.runs) for g in report.groups])
    keys = [report.metric] + (["eval/loss"] if report.metric != "eval/loss" else [])
    for key in keys:
        name = f"{stem}-{key.replace('/', '_')}.png"
        if learning_curves(report, key, folder / name):
            figures.append(
                (
                    f"Learning curves of {key} (one line per group; {band}). SVG: "
                    f"{Path(name).with_suffix('.svg')}.",
                    name,
                )
            )
    for cost, words in (("bytes", "bytes sent (up + down)"), ("time", "training time")):
        name = f"{stem}-{report.metric.replace('/', '_')}-vs-{cost}.png"
        if metric_vs_cost(report, report.metric, cost, folder / name):
            figures.append(
                (
                    f"{report.metric} against cumulative {words} (one line per group; {band}). SVG: "
                    f"{Path(name).with_suffix('.svg')}.",
                    name,
                )
            )
    if counts is not None:
        name = f"{stem}-partition.png"
        partition_heatmap(counts, folder / name, counts_title)
        figures.append(
            (f"Partition shared by every run: {counts_title}. SVG: {Path(name).with_suffix('.svg')}.", name)
        )
    if report.search is not None:  # a search's history and importances (tracking/report/search.py)
        figures += search_figures(report.search, output)
    return figures


def search_figures(summary: SearchSummary, output: Path) -> list[tuple[str, str]]:
    """Optuna's optimisation history and parameter importances, PNG (and SVG) beside `output`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna
    from optuna.visualization import matplotlib as vis

    stem, folder, figures = output.stem, output.parent, []
    complete = [
        t for t in summary.handle.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE
    ]
    plots = [
        (
            "history",
            "Optimisation history of the search (Optuna): each completed trial's "
            f"{summary.metric} and the best so far.",
            lambda: vis.plot_optimization_history(summary.handle, target_name=summary.metric),
        )
    ]
    if len(complete) >= 2 and len({tuple(sorted(t.params.items())) for t in complete}) >= 2:
        plots.append(
            (
                "importances",
                "Parameter importances of the search (Optuna, fANOVA with seed 0 over the completed trials).",
                lambda: vis.plot_param_importances(
                    summary.handle, evaluator=_evaluator(), target_name=summary.metric
                ),
            )
        )
    for name, caption, draw in plots:
        with (
            warnings.catch_warnings(),
            matplotlib.rc_context(),
        ):  # Optuna sets a pyplot style: kept to its plots
            warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
            axes = draw()
            fig = axes.get_figure(root=True)
            path = folder / f"{stem}-search-{name}.png"
            write_figure(fig, path)
            plt.close(fig)
        figures.append((f"{caption} SVG: {path.with_suffix('.svg').name}.", path.name))
    return figures


def _evaluator() -> Any:
    import optuna

    try:
        import sklearn  # noqa: F401 - fANOVA's random forest
    except ImportError:
        return optuna.importance.PedAnovaImportanceEvaluator()
    return optuna.importance.FanovaImportanceEvaluator(seed=0)
