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


def resolve_task(task: str, model: str | None, data_file: str | None) -> Task:
    """Return the named task, or the bring-your-own task of `data_file` (--data FILE --model M)."""
    if data_file is not None:
        from pathlib import Path

        from fedcli.datasets.byo import byo_task

        return byo_task(Path(data_file), model or "mlp")
    return TASKS[task]
