"""Task registry: every data module listed here exports `TASKS: tuple[Task, ...]`; plugins add theirs.

A plugin package declares an entry point in the group ``fedcli.tasks`` whose value is a `Task`
record (fedcli/datasets/tasks.py), e.g. in its pyproject.toml (docs/bring-your-own.md, "Plugins")::

    [project.entry-points."fedcli.tasks"]
    mytask = "my_package.tasks:MYTASK"

A plugin that fails to load, is not a `Task` or reuses a name is left out with one warning
naming it (a built-in task keeps its name); `TASK_SOURCES` names each task's package.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from importlib import import_module
from importlib.metadata import entry_points
from types import MappingProxyType

from fedcli.datasets.tasks import Task

log = logging.getLogger(__name__)

_TASK_MODULES = tuple(
    f"bundled.{name}"
    for name in (
        "femnist",
        "synthetic",
        "garnet",
        "mnist",
        "torchvision_sources",
        "tff_images",
        "stackoverflow",
        "shakespeare",
        "sent140",
        "mulan",
        "har",
        "vehicle",
        "fedprox_synthetic",
        "quadratic",
    )
)


# The partition a run of a task without natural clients gets when it names neither --scheme nor
# --partition (Task.default_partition; recorded with the run as fedcli.recommended). Bundled tasks only:
# the other tasks without natural clients read full data sets whose users choose their own split.
DEFAULT_PARTITIONS: Mapping[str, tuple[Mapping[str, object], str]] = MappingProxyType(
    {
        "mnist": (
            {"scheme": "dirichlet", "alpha": 0.3, "num_clients": 100},
            "the README's MNIST split, on which its client lr 0.1 was measured (docs/architecture.md §5)",
        ),
        "bibtex": (
            {"scheme": "dirichlet", "alpha": 0.3, "num_clients": 100},
            "as mnist, over each example's primary tag (datasets/partition/schemes.py class_labels)",
        ),
    }
)


def _load() -> tuple[Mapping[str, Task], Mapping[str, str]]:
    records: dict[str, Task] = {}
    sources: dict[str, str] = {}
    for module in _TASK_MODULES:
        for task in import_module(f"fedcli.datasets.{module}").TASKS:
            if task.name in DEFAULT_PARTITIONS and task.default_partition is None:
                spec, why = DEFAULT_PARTITIONS[task.name]
                task = replace(
                    task, default_partition=MappingProxyType(dict(spec)), default_partition_why=why
                )
            records[task.name] = task
            sources[task.name] = "fedcli"
    for ep in entry_points(group="fedcli.tasks"):
        package = ep.dist.name if ep.dist is not None else ep.value.split(":")[0]
        try:
            record = ep.load()
        except Exception as err:  # noqa: BLE001 - a broken plugin must not stop fedcli: one line, left out
            log.warning(
                "task plugin %r of %s is left out: loading %s failed (%s: %s)",
                ep.name,
                package,
                ep.value,
                type(err).__name__,
                (str(err).splitlines() or [""])[0][:160],
            )
            continue
        if not isinstance(record, Task) or record.name in records:
            why = (
                "is not a fedcli Task record"
                if not isinstance(record, Task)
                else f"reuses the name {record.name!r}"
            )
            log.warning("task plugin %r of %s is left out: %s %s", ep.name, package, ep.value, why)
            continue
        records[record.name] = record
        sources[record.name] = package
    return MappingProxyType(dict(sorted(records.items()))), MappingProxyType(sources)


# every task by name, and task name -> the package that provides it ("fedcli" for built-ins)
TASKS, TASK_SOURCES = _load()


def resolve_task(task: str, model: str | None, data_file: str | None, model_args: str | None = None) -> Task:
    """Return the named task, or the bring-your-own task of `data_file` (--data FILE --model M).

    A user model reference (`pkg.mod:factory`, `/abs/file.py:factory`: datasets/yours/model.py) is
    added to the task's models, built with the keyword arguments `model_args` (the JSON a run
    records as data.model_args; None: none).
    """
    from fedcli.datasets.yours.model import decode_args, is_reference, with_model

    own = is_reference(model)
    if data_file is not None:
        from pathlib import Path

        from fedcli.datasets.yours.files import byo_task

        resolved = byo_task(Path(data_file), "mlp" if own or model is None else model)
    else:
        resolved = TASKS[task]
    return with_model(resolved, str(model), decode_args(model_args)) if own else resolved
