"""Task registry: every data module listed here exports `TASKS: tuple[Task, ...]`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from importlib import import_module
from types import MappingProxyType

from fedcli.datasets.tasks import Task

_TASK_MODULES = ("femnist", "synthetic", "garnet", "mnist", "torchvision_sources", "tff_h5", "shakespeare", "sent140",
                 "mulan", "har", "vehicle", "fedprox_synthetic", "quadratic")


# The partition a run of a task without natural clients gets when it names neither --scheme nor
# --partition (Task.default_partition; recorded with the run as fedcli.recommended). Bundled tasks only:
# the other tasks without natural clients read full data sets whose users choose their own split.
DEFAULT_PARTITIONS: Mapping[str, tuple[Mapping[str, object], str]] = MappingProxyType({
    "mnist": ({"scheme": "dirichlet", "alpha": 0.3, "num_clients": 100},
              "the README's MNIST split, on which its client lr 0.1 was measured (docs/architecture.md §5)"),
    "bibtex": ({"scheme": "dirichlet", "alpha": 0.3, "num_clients": 100},
               "as mnist, over each example's primary tag (datasets/partition.py class_labels)"),
})


def _load() -> Mapping[str, Task]:
    records: dict[str, Task] = {}
    for module in _TASK_MODULES:
        for task in import_module(f"fedcli.datasets.{module}").TASKS:
            if task.name in DEFAULT_PARTITIONS and task.default_partition is None:
                spec, why = DEFAULT_PARTITIONS[task.name]
                task = replace(task, default_partition=MappingProxyType(dict(spec)), default_partition_why=why)
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
