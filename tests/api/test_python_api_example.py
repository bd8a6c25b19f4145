"""examples/python_api.py, run as a user runs it: `python examples/python_api.py` in a folder of theirs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_example_trains_fedavg_and_fedpa_and_reports_them(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "python_api.py"),
            "--rounds",
            "3",
            "--root",
            "runs",
            "--no-mlflow",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    accuracy = [
        float(m[1]) for line in lines if (m := re.search(r"test accuracy (\S+) after 3 rounds", line))
    ]
    assert [line.split()[0] for line in lines[:2]] == ["fedavg", "fedpa"] and len(accuracy) == 2
    assert all(0.0 < a <= 1.0 for a in accuracy)
    assert "logits of shape (4, 62)" in out.stdout  # FEMNIST's 62 classes
    report = (tmp_path / "runs" / "python-api-report.md").read_text()
    assert "fedavg" in report and "fedpa" in report
    assert list((tmp_path / "runs").glob("*.png")), "the report's curves are written beside it"
