"""Python run from the checkout's root finds the Hugging Face `datasets`, not fedcli's datasets/ folder.

The folder Python puts first on sys.path for a script run from the root (`python -c`, a script read
from stdin: the working directory, as for a script saved there) holds fedcli's datasets/ folder,
installed as fedcli.datasets. Its __init__.py hands the top-level name to the next `datasets` on
sys.path (docs/architecture.md, "The datasets folder and the `datasets` name"); fedcli.datasets in
the same process is still fedcli's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
from pathlib import Path
from datasets import Dataset  # the Hugging Face class a user's script asks for
import datasets
import fedcli.datasets.registry
print(sys.path[0] in ("", str(Path.cwd())))
print(Path(datasets.__file__).resolve())
print(Dataset.from_dict({"x": [1, 2, 3]}).num_rows)
print(Path(fedcli.datasets.registry.__file__).resolve())
print("mnist" in fedcli.datasets.registry.TASKS)
"""


def hugging_face_installed() -> bool:
    probe = "import importlib.util; print(importlib.util.find_spec('datasets').origin)"
    out = subprocess.run([sys.executable, "-c", probe], cwd="/", capture_output=True, text=True, timeout=120)
    return out.returncode == 0 and "site-packages" in out.stdout


@pytest.mark.skipif(
    not hugging_face_installed(), reason="needs the Hugging Face datasets package (pip install datasets)"
)
@pytest.mark.parametrize("form", ["-c", "stdin"])
def test_a_script_run_from_the_root_gets_hugging_face_datasets(form: str) -> None:
    argv, stdin = ([sys.executable, "-c", SCRIPT], None) if form == "-c" else ([sys.executable, "-"], SCRIPT)
    out = subprocess.run(argv, cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    first_on_path, hf_file, rows, registry_file, has_mnist = out.stdout.split("\n")[:5]
    assert first_on_path == "True"  # the root's folder came first, as for a script saved there
    assert Path(hf_file) != ROOT / "datasets" / "__init__.py"
    assert Path(hf_file).parts[-3:] == ("site-packages", "datasets", "__init__.py"), hf_file
    assert rows == "3"
    assert Path(registry_file).parts[-2:] == ("datasets", "registry.py")  # fedcli's own, alongside
    assert has_mnist == "True"


def test_without_hugging_face_the_name_is_one_clear_error() -> None:
    # -S: no site-packages, so no other `datasets` anywhere on sys.path but the checkout's folder
    out = subprocess.run(
        [sys.executable, "-S", "-c", "import datasets"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: No module named 'datasets' outside fedcli's checkout"), last
    assert "pip install datasets" in last
