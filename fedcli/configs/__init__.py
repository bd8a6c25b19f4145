"""Run configs shipped with fedcli: `fedcli train --config NAME` and `fedcli demo` find them by name.

`demo.yaml` is `make demo`'s run (FedPA on the bundled FEMNIST writers); it is the same file as
examples/fedpa-femnist-demo.yaml, the copy a user edits (tests/api/test_packaged_config.py checks
they agree). The files are package data (pyproject.toml), so an installed wheel has them.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def config_names() -> list[str]:
    """The names of the shipped configs (file names without `.yaml`), sorted."""
    return sorted(p.stem for p in HERE.glob("*.yaml"))


def packaged_config(name: str) -> Path:
    """The file of the shipped config `name` (see `config_names`)."""
    return HERE / f"{name}.yaml"
