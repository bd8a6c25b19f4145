"""Report figures (tracking/report/plots.py): units, labels, markers, SVG twins, reproducible bytes.

Matplotlib's SVG keeps every drawn string as a comment (`<!-- eval accuracy (%) -->`)
before its glyph paths, so the tests read titles, tick labels and annotations from there.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedcli.tracking.report.build import build_report
from fedcli.tracking.report.model import ReportSpec
from fedcli.tracking.report.plots import axis_label, cost_curve, report_figures
from fedcli.tracking.store.sql_store import SqlStore


def _add(store: SqlStore, algo: str, seed: int, accuracy: list[float], cumulative: bool) -> None:
    config = {
        "seed": seed,
        "algorithm": {"name": algo, "hp": {}},
        "data": {"task": "toy"},
        "train": {"rounds": 6},
    }
    run_id = store.start_run(
        experiment="exp",
        run_name=None,
        config=config,
        algo=algo,
        task="toy",
        seed=seed,
        tags={},
        fedcli_version="t",
        torch_version="t",
        git_commit=None,
    )
    for round_idx, value in enumerate(accuracy):
        metrics = {"eval/accuracy": value, "eval/loss": 1.0 - value}
        if round_idx:
            metrics.update({"comm/bytes_up": 1000.0, "comm/bytes_down": 500.0, "time/round_s": 0.5})
            if cumulative:
                metrics.update(
                    {
                        "comm/cum_bytes_up": 1000.0 * round_idx,
                        "comm/cum_bytes_down": 500.0 * round_idx,
                        "time/cum_train_s": 0.5 * round_idx,
                    }
                )
        store.log_round(run_id, round_idx, metrics)
    store.end_run(run_id, "finished")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    """FedAvg with 2 seeds (cumulative keys logged), FedPA with 1 seed (per-round keys only)."""
    with SqlStore(f"sqlite:///{tmp_path / 's.db'}") as sql:
        _add(sql, "fedavg", 0, [0.1, 0.2, 0.4, 0.6, 0.6, 0.6, 0.7], cumulative=True)
        _add(sql, "fedavg", 1, [0.1, 0.2, 0.4, 0.4, 0.6, 0.8, 0.8], cumulative=True)
        _add(sql, "fedpa", 0, [0.1, 0.5, 0.7, 0.9, 0.9, 0.9, 0.9], cumulative=False)
        yield sql


def _texts(svg: Path) -> list[str]:
    return re.findall(r"<!-- (.*?) -->", svg.read_text(encoding="utf-8"))


@pytest.mark.slow
def test_figures_come_as_200_dpi_pngs_with_reproducible_svgs(store: SqlStore, tmp_path: Path) -> None:
    spec = ReportSpec(thresholds=(0.5,), at=(4, 6), window=2, smooth=2)

    first = report_figures(build_report(store, spec), tmp_path / "a" / "report.md")
    second = report_figures(build_report(store, spec), tmp_path / "b" / "report.md")

    names = [path for _, path in first]
    assert names == [
        "report-eval_accuracy.png",
        "report-eval_loss.png",
        "report-eval_accuracy-vs-bytes.png",
        "report-eval_accuracy-vs-time.png",
    ]
    assert first == second
    for name in names:
        svg = name.replace(".png", ".svg")
        with Image.open(tmp_path / "a" / name) as image:
            assert round(image.info["dpi"][0]) == 200 and image.size == (1500, 900)
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
        assert (tmp_path / "a" / svg).read_bytes() == (tmp_path / "b" / svg).read_bytes()
        assert "<dc:date>" not in (tmp_path / "a" / svg).read_text(encoding="utf-8")


@pytest.mark.slow
def test_accuracy_is_drawn_in_percent_with_thresholds_and_round_markers(
    store: SqlStore, tmp_path: Path
) -> None:
    """Accuracy 0.1..0.9 on a % axis has ticks like 80, never 0.8; the 0.5 threshold reads 50%."""
    report_figures(
        build_report(store, ReportSpec(thresholds=(0.5,), at=(4, 6), window=2, smooth=2)),
        tmp_path / "report.md",
    )

    texts = _texts(tmp_path / "report-eval_accuracy.svg")
    assert "eval accuracy (%)" in texts and "communication round" in texts
    assert "80" in texts and "0.8" not in texts
    assert "threshold 50%" in texts and "R=4" in texts and "R=6" in texts
    assert any("band: ±1 std over seeds (groups with 2+)" in t for t in texts)
    loss = _texts(tmp_path / "report-eval_loss.svg")
    assert "eval loss" in loss and not any("threshold" in t for t in loss)
    assert "bytes sent, up + down, cumulative (kB)" in _texts(tmp_path / "report-eval_accuracy-vs-bytes.svg")
    assert "training time, cumulative (s)" in _texts(tmp_path / "report-eval_accuracy-vs-time.svg")


@pytest.mark.slow
def test_one_seed_per_group_promises_no_band(store: SqlStore, tmp_path: Path) -> None:
    report = build_report(store, ReportSpec(where={"algo": "fedpa"}, at=(4,), window=2, smooth=2))

    figures = report_figures(report, tmp_path / "report.md")

    assert all("no std band" in caption and "±1 std" not in caption for caption, _ in figures)
    assert any("one seed per group, no std band" in t for t in _texts(tmp_path / "report-eval_accuracy.svg"))


def test_cost_axes_use_cumulative_keys_else_sum_the_per_round_ones() -> None:
    """With comm/cum_bytes_*: x_r = cum_up_r + cum_down_r as logged. Without: the sum over
    rounds 1..r of bytes_up + bytes_down. Round 0 costs 0; a round with no value stays NaN."""
    rounds = np.array([1, 2, 4])
    logged = {
        "comm/cum_bytes_up": (rounds, np.array([10.0, 25.0, 70.0])),
        "comm/cum_bytes_down": (rounds, np.array([1.0, 2.0, 4.0])),
    }
    per_round = {
        "comm/bytes_up": (rounds, np.array([10.0, 15.0, 45.0])),
        "comm/bytes_down": (rounds, np.array([1.0, 1.0, 2.0])),
        "time/round_s": (rounds, np.ones(3)),
    }

    np.testing.assert_array_equal(cost_curve(logged, "bytes", 4), [0.0, 11.0, 27.0, np.nan, 74.0])
    np.testing.assert_array_equal(cost_curve(per_round, "bytes", 4), [0.0, 11.0, 27.0, np.nan, 74.0])
    np.testing.assert_array_equal(cost_curve(per_round, "time", 4), [0.0, 1.0, 2.0, np.nan, 3.0])
    assert cost_curve({}, "time", 4) is None


def test_axis_labels_are_words_not_keys() -> None:
    assert axis_label("eval/accuracy") == "eval accuracy (%)"
    assert axis_label("eval/dist_to_opt") == "eval distance to optimum"
    assert axis_label("eval/macro_f1") == "eval macro F1 (%)"
    assert axis_label("train/loss") == "train loss"
