"""The MLflow UI as a browser shows it: scripts/ui_screenshots.py on a small real store.

A 2-round `fedcli train` and a two-trial `fedcli sweep` (lsq) fill a tmp root, `fedcli ui`
serves it, and headless Chromium photographs the first visit (a new browser, nothing seeded) at
the URL `fedcli ui` printed and without its saved view, the runs table, a run, a metric chart and
the sweep. The PNGs must be full-size, non-blank pictures, and each page's DOM must hold the run
names (the model-training layout, not MLflow's GenAI screen). The first visit at the printed URL
must show fedcli's columns (a metric, a param) under MLflow's shared-view banner; without the
view, MLflow's defaults (no metric column). Independently of the script's DevTools driving,
plain `chromium --dump-dom` of the URL `fedcli ui` printed must list the run.

Skips only when no Chromium binary is installed (Debian: apt-get install chromium).
About 2-4 minutes on 2 busy cores: three fedcli processes, the MLflow server's start and five
page loads.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ui_screenshots", REPO / "scripts" / "ui_screenshots.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


UI = _script()
BINARY = UI.chromium_binary()

pytestmark = pytest.mark.skipif(
    BINARY is None,
    reason="no Chromium binary installed (apt-get install chromium, "
    "or set CHROMIUM=/path/to/chrome): the MLflow UI screenshot test needs a browser",
)


@pytest.mark.timeout(900)
def test_screenshots_show_the_runs_table_a_run_a_metric_chart_and_the_sweep(tmp_path: Path) -> None:
    from PIL import Image

    plan = UI.plan_for("lsq", 2)
    root = tmp_path / "runs"
    UI.make_store(root, plan)

    with UI.fedcli_ui(root, plan.experiment) as url:
        assert url.endswith("/runs?workflowType=machine_learning&viewStateShareKey=fedcli-compare")
        shots = UI.photograph(url, plan, tmp_path / "png", BINARY)
        dumped = subprocess.run(
            [
                BINARY,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--dump-dom",
                "--window-size=1600,1000",
                "--virtual-time-budget=30000",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )

    assert sorted(shots) == [
        "first-visit",
        "first-visit-mlflow-defaults",
        "metric-chart",
        "run-page",
        "runs-table",
        "sweep",
    ]
    for shot in shots.values():
        with Image.open(shot.png) as image:
            assert image.size == (1600, 1000), shot.name
            colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
        assert shot.png.stat().st_size > 20_000 and (colours is None or len(colours) > 50), (
            f"{shot.name} looks blank"
        )
        assert "Judges" not in shot.text and "Evaluation runs" not in shot.text, f"{shot.name}: GenAI layout"
        assistant = "Ask questions about your experiments" in shot.text
        assert assistant == shot.name.startswith("first-visit"), (
            f"{shot.name}: Assistant panel open: {assistant}"
        )

    first, default = shots["first-visit"].text, shots["first-visit-mlflow-defaults"].text
    assert "You're viewing a shared view" in first and plan.metric in first and "algorithm.name" in first
    assert "shared view" not in default and plan.metric not in default and "Source" in default
    assert plan.metric in shots["runs-table"].text and "algorithm.name" in shots["runs-table"].text

    assert plan.run_name in shots["runs-table"].dom and "Parameters" in shots["runs-table"].dom
    page = shots["run-page"].text
    assert plan.run_name in page and "fedcli.algorithm" in page and plan.metric in page
    sweep = shots["sweep"].text
    assert f"sweep {plan.sweep_experiment}" in sweep and "fedavg s0" in sweep and "scaffold s0" in sweep
    assert "fedavg s0" in shots["metric-chart"].text and "scaffold s0" in shots["metric-chart"].text
    assert dumped.returncode == 0 and plan.run_name in dumped.stdout, dumped.stderr[-2000:]
