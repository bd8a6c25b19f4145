"""Task registry: every data module listed here exports `TASKS: tuple[Task, ...]`."""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from types import MappingProxyType

from fedcli.datasets.tasks import Task

_TASK_MODULES = ("femnist", "synthetic", "garnet", "mnist", "torchvision_sources", "tff_h5", "shakespeare", "sent140",
                 "mulan", "har", "vehicle", "fedprox_synthetic", "quadratic")


def _load() -> Mapping[str, Task]:
    records: dict[str, Task] = {}
    for module in _TASK_MODULES:
        for task in import_module(f"fedcli.datasets.{module}").TASKS:
            records[task.name] = task
    return MappingProxyType(dict(sorted(records.items())))


TASKS: Mapping[str, Task] = _load()
