"""The wheel carries every module and the bundled data, and building it prints no setuptools warning.

pyproject.toml lists the installed packages by hand (the top-level folders install under
`fedcli.`), the bundled data folders included: a folder left out is missing from the wheel, and
setuptools warns "Package would be ignored" for a data folder that is not listed. The first test
checks the list against the tree (quick); the second builds the wheel from a copy of the working
tree as `pip wheel . --no-deps` does (without build isolation: this environment's setuptools, no
package index) and checks its contents and pip's verbose output.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = {
    "fedcli": "fedcli",
    "algorithms": "fedcli.algorithms",
    "datasets": "fedcli.datasets",
    "tracking": "fedcli.tracking",
}  # folder -> installed name (pyproject's package-dir)


def source_files() -> list[str]:
    """The working tree's files git would add (tracked, or new and not ignored)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    return sorted(name for name in out.split("\0") if name and (ROOT / name).is_file())


def package_files() -> dict[str, str]:
    """{path in the wheel: path in the tree} of every file under the installed folders."""
    out = {}
    for name in source_files():
        top, _, rest = name.partition("/")
        if top in INSTALLED and rest and not name.endswith(".pyc"):
            out[INSTALLED[top].replace(".", "/") + "/" + rest] = name
    return out


def test_every_folder_of_the_installed_tree_is_a_listed_package() -> None:
    from setuptools.config.pyprojecttoml import read_configuration  # reads TOML on Python 3.10 too

    config = read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]
    assert config["package-dir"] == {name: folder for folder, name in INSTALLED.items()}
    folders = {
        ".".join(Path(path).parent.parts[:depth])
        for path in package_files()
        for depth in range(1, len(Path(path).parent.parts) + 1)
    }  # with the folders between

    assert folders - set(config["packages"]) == set(), "add these to [tool.setuptools] packages"
    assert set(config["packages"]) - folders == set(), "listed packages without files"


@pytest.mark.timeout(600)
def test_the_wheel_holds_every_file_and_its_build_prints_no_warning(tmp_path: Path) -> None:
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
            "-v",
            "-w",
            str(tmp_path / "dist"),
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("fedcli-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    output = built.stdout + built.stderr

    missing = sorted(path for path in package_files() if path not in names)
    assert not missing, f"{len(missing)} files not in the wheel, e.g. {missing[:5]}"
    assert any(n.startswith("fedcli/datasets/data/femnist/train/") for n in names)
    for noise in ("BuildBackendWarning", "SetuptoolsDeprecationWarning", "would be ignored", "is deprecated"):
        assert noise not in output, output[output.find(noise) - 500 : output.find(noise) + 500]
