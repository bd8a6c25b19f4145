"""Studies: recipes that are a computation on closed-form problems, not a training sweep.

A paper claim such as "the FedPA delta's bias shrinks with rho" (FedPA Fig. 3) or "the client
update costs O(l^2 d)" (FedPA Table 1) is checked by computing the quantity itself on a
problem whose exact answer is known, not by training runs. Each study module exposes

    run(out: Path, *, smoke: bool = False) -> None

which writes the markdown report `out` and its figures beside it (`<out stem>-<name>.png`,
plus .svg), with the paper's claim, the numbers, a check computed from them and the
command that regenerates it. `smoke=True` is the seconds-long version `make test` runs so
the recipes do not rot. `fedcli sweep --recipe NAME` runs them (fedcli/recipes/NAME.yaml
names the module under `study:`); docs/reproductions.md lists them.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import Protocol


class Study(Protocol):
    def __call__(self, out: Path, *, smoke: bool = False) -> None: ...


def load_study(module: str) -> Study:
    """Return `run` of fedcli.studies.<module>."""
    return import_module(f"fedcli.studies.{module}").run
