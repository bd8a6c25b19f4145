"""No third-party noise in normal use: torch's CPU-only CUDA probe line is dropped (fedcli/__init__.py).

torch.utils.cpp_extension logs "No CUDA runtime is found, using CUDA_HOME=..." when it is imported
(`--compile` imports it in every process that compiles) on a machine with a CUDA toolkit and no
usable GPU. The tests make that machine: CUDA_HOME points at an empty folder and
CUDA_VISIBLE_DEVICES hides any GPU. Without fedcli the line appears (the control); with it, it
does not, in the CLI's process or its `--executor process` worker; another record of the same
logger still goes out.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = "No CUDA runtime is found"


def cpu_only_with_a_toolkit(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")}
    return {**env, "CUDA_HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_the_probe_line_is_dropped_and_other_records_are_kept(tmp_path: Path) -> None:
    env = cpu_only_with_a_toolkit(tmp_path)

    control = python("import torch.utils.cpp_extension", env)
    quiet = python("import fedcli, torch.utils.cpp_extension", env)
    other = python(
        "import logging, fedcli; logging.getLogger('torch.utils.cpp_extension').warning('compiler mismatch')",
        env,
    )

    assert control.returncode == 0 and PROBE in control.stderr, control.stderr[-2000:]
    assert quiet.returncode == 0 and PROBE not in quiet.stderr, quiet.stderr[-2000:]
    assert "compiler mismatch" in other.stderr


@pytest.mark.timeout(400)
def test_compiled_training_in_worker_processes_prints_no_probe_line(tmp_path: Path) -> None:
    """The issue's case: `--compile` on a CPU printed the line once per compiling process."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            "--task",
            "lsq",
            "--executor",
            "process",
            "--workers",
            "2",
            "--compile",
            "--rounds",
            "1",
            "--clients-per-round",
            "4",
            "--root",
            str(tmp_path / "runs"),
            "--no-mlflow",
        ],
        capture_output=True,
        text=True,
        env=cpu_only_with_a_toolkit(tmp_path),
        timeout=360,
    )

    assert proc.returncode == 0, proc.stderr[-3000:]
    assert PROBE not in proc.stderr and proc.stderr == "", proc.stderr[-3000:]
