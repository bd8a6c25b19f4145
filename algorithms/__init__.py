"""Algorithm registry: the built-in algorithm records plus third-party plugins.

A plugin package declares an entry point in the group ``fedcli.algorithms`` whose value
is an `Algorithm` record (see `fedcli.algorithms.base`), e.g. in its pyproject.toml::

    [project.entry-points."fedcli.algorithms"]
    myalgo = "my_package.myalgo:ALGORITHM"
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from importlib.metadata import entry_points
from types import MappingProxyType

from fedcli.algorithms.base import Algorithm

_BUILTIN_MODULES = (
    "fedavg",
    "fedpa",
    "fola",
    "fola_offline",
    "fedcurv",
    "fedprox",
    "fedsparse",
    "scaffold",
    "fedlsa",
    "scafflsa",
    "fedadmm",
    "bayesadmm",
    "bayesadmm_iso",
    "bayesadmm_full",
    "feddyn",
    "fedlap",
)


def _load() -> Mapping[str, Algorithm]:
    builtin = [import_module(f"fedcli.algorithms.{module}").ALGORITHM for module in _BUILTIN_MODULES]
    records: dict[str, Algorithm] = {record.name: record for record in builtin}
    for ep in entry_points(group="fedcli.algorithms"):
        record = ep.load()
        if isinstance(record, Algorithm) and record.name not in records:
            records[record.name] = record
    return MappingProxyType(dict(sorted(records.items())))


ALGORITHMS: Mapping[str, Algorithm] = _load()
