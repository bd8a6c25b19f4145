"""The built wheel, installed into a fresh virtual environment outside the repository, runs the demo.

What a user does with `pip install fedcli-*.whl`, offline: the wheel is built from a copy of the
working tree (as tests/test_packaging.py builds it), a venv is made in a temporary folder
(`python -m venv --without-pip`), and the venv's own Python installs the wheel with pip
(`--no-deps --no-index`: nothing is downloaded). Its dependencies (torch, MLflow, ...) come from
this repository's .venv through a `.pth` file that puts .venv's site-packages on the path as a
plain folder: .venv's own `.pth` files (the editable install of this checkout among them) are not
run, so `import fedcli` finds the wheel's copy only. Then, from another temporary folder, the
installed `fedcli demo` trains a round on the FEMNIST writers bundled in the wheel, and a script
trains through the Python API.

About a minute (the build, the install, a FEMNIST round): marked `soak`, so `make test` leaves it
out; run it with `.venv/bin/python -m pytest -m soak tests/test_wheel_install.py` (docs/testing.md).
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.test_packaging import ROOT, source_files


@pytest.mark.soak
@pytest.mark.timeout(900)
def test_the_wheel_installed_in_a_fresh_venv_outside_the_repository_runs_the_demo(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    for name in source_files():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_bytes((ROOT / name).read_bytes())
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(tree),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("fedcli-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    (Path(purelib) / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "OMP_NUM_THREADS": "1",
        "PIP_NO_INDEX": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    installed = subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--ignore-installed",
            "-q",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]

    work = tmp_path / "elsewhere"
    work.mkdir()
    where = subprocess.run(
        [str(python), "-c", "import fedcli, fedcli.datasets; print(fedcli.__file__)"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(purelib) and not where.stdout.strip().startswith(str(ROOT))

    demo = subprocess.run(
        [str(venv / "bin" / "fedcli"), "-q", "demo", "--rounds", "1", "--no-mlflow"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    run_id = demo.stdout.strip()
    assert (work / "fedcli-runs" / "runs" / run_id / "model.pt").is_file()
    listed = subprocess.run(
        [str(venv / "bin" / "fedcli"), "list", "runs", "--json"],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert listed.returncode == 0 and f'"{run_id}"' in listed.stdout and '"fedpa"' in listed.stdout, (
        listed.stderr
    )

    api = subprocess.run(
        [
            str(python),
            "-c",
            "import fedcli; run = fedcli.train(task='lsq', rounds=2, no_mlflow=True,"
            " root='api'); print(run.status, len(run.metrics()))",
        ],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "PYTHONPATH": ""},
    )
    assert api.returncode == 0, api.stderr[-3000:]
    assert api.stdout.split() == ["finished", "3"]
