"""The cross-field checks of a whole run config, before anything is built or written (docs/style.md rule 11).

Part of the package fedcli.config (fedcli/config/__init__.py): `validate` (train ranges and
choices, the data file or task, the model, the partition, the tracking names and URIs),
`validate_partition` (a partition file excludes the scheme options), `require_max_clients_support`
and `record_model_source` (a user model reference made canonical, with its source's sha256). The
per-value parsing and coercion and the tracking and store checks they use are in
fedcli/config/checks.py. Imports only `sections` and `checks` of fedcli.config.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from fedcli.algorithms.base import HyperparameterError
from fedcli.config.checks import suggest, validate_tracking
from fedcli.config.sections import (
    DataConfig,
    PartitionConfig,
    RunConfig,
)
from fedcli.datasets.yours.model import is_reference, model_reference
from fedcli.datasets.yours.plugins import model_plugins
from fedcli.errors import ConfigError


def validate(cfg: RunConfig) -> None:
    """Cross-field and range checks that do not need data; ConfigError on the first problem."""
    from fedcli.datasets.registry import TASKS

    t = cfg.train  # types, bounds and choices: checked as the sections were built (checks.py `validated`)
    if not (t.device in ("auto", "cpu", "cuda", "mps") or t.device.startswith("cuda:")):
        raise ConfigError(f"train.device must be auto, cpu, cuda, cuda:N or mps; got {t.device!r}.")
    try:
        t.optim(default_client_lr=1.0)  # constructing validates the settings (a task's own lr is > 0)
    except HyperparameterError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.data.data_dir is not None and not cfg.data.data_dir.strip():  # `--data-dir "$DIR"` with DIR unset
        raise ConfigError(
            f"data.data_dir must be a folder; got {cfg.data.data_dir!r}. Pass --data-dir a folder, or "
            "leave it out for the default."
        )
    if cfg.data.file is not None:
        from fedcli.datasets.yours.data import is_data_ref
        from fedcli.datasets.yours.files import MODELS, SUFFIXES, has_client

        reference = is_data_ref(
            cfg.data.file
        )  # an object or a function (docs/your-data.md): built by the set-up
        if reference:
            source = cfg.data.file.rpartition(":")[0]
            if source.endswith(".py") and not Path(source).is_file():
                raise ConfigError(
                    f"data.file {cfg.data.file!r} names a file that does not exist; give "
                    "path/to/file.py:function or pkg.module:function."
                )
        elif not Path(cfg.data.file).is_file():
            raise ConfigError(
                f"data.file {cfg.data.file!r} does not exist; pass an .npz/.csv/.parquet file to --data."
            )
        elif Path(cfg.data.file).suffix not in SUFFIXES:
            raise ConfigError(
                f"data.file must be a {', '.join(SUFFIXES)} file; got {cfg.data.file!r}. "
                "Save your arrays with numpy.savez or your table as CSV/Parquet."
            )
        defaults = DataConfig()
        for key, flag in (
            ("task", "--task"),
            ("data_dir", "--data-dir"),
            ("download", "--download"),
            ("max_clients", "--max-clients"),
        ):
            if getattr(cfg.data, key) != getattr(defaults, key):
                raise ConfigError(
                    f"data.{key} must be left unset with data.file; got data.{key}="
                    f"{getattr(cfg.data, key)!r} and data.file={cfg.data.file!r}. Drop {flag}: "
                    "--data is the whole data set."
                )
        if (
            cfg.data.model is not None
            and cfg.data.model not in MODELS
            and not is_reference(cfg.data.model)
            and cfg.data.model not in model_plugins()
        ):
            raise ConfigError(
                f"data.model must be one of {', '.join(MODELS)} with --data; got {cfg.data.model!r}"
                f"{suggest(cfg.data.model, MODELS)}."
            )
        if (
            not reference
            and cfg.partition.file is None
            and cfg.partition.scheme == "natural"
            and has_client(Path(cfg.data.file)) is False
        ):
            raise ConfigError(
                f"partition.scheme 'natural' needs a client array or column in {Path(cfg.data.file).name};"
                " got none. Pass --scheme iid --clients N (or dirichlet, shards, ...), or add `client`."
            )
    elif cfg.data.task not in TASKS:
        raise ConfigError(
            f"unknown task {cfg.data.task!r}{suggest(cfg.data.task, list(TASKS))}; "
            f"choose one of: {', '.join(TASKS)}."
        )
    task = TASKS.get(cfg.data.task)
    if task is not None and cfg.data.file is None:
        require_max_clients_support(task, cfg.data.max_clients)
    if (
        task is not None
        and cfg.data.file is None
        and cfg.data.model is not None
        and cfg.data.model not in task.models
        and not is_reference(cfg.data.model)
        and cfg.data.model not in model_plugins()
    ):
        raise ConfigError(
            f"data.model must be one of {', '.join([*task.models, *model_plugins()])} for task "
            f"{task.name}, or your own 'module:factory' / 'file.py:factory'; got {cfg.data.model!r}."
        )
    if cfg.data.augment is not None:
        from fedcli.datasets.augment import parse

        parse(cfg.data.augment)  # the names and numbers; the data's shape is checked by the set-up
    validate_partition(cfg.partition, cfg.data)
    validate_tracking(cfg.tracking)


def record_model_source(cfg: RunConfig) -> RunConfig:
    """A user model reference made canonical (a file path absolute) with its source's sha256 filled in.

    A config that already records a sha256 (a resumed or evaluated run's) keeps it: engine/setup.py
    compares it with the source as it is now (docs/bring-your-own.md, "When the model's code changes").
    Built-in model names pass unchanged.

    Raises:
        ConfigError: the module or file cannot be found (one line with the fix).
    """
    from fedcli.datasets.registry import TASKS
    from fedcli.datasets.yours.files import MODELS
    from fedcli.datasets.yours.user_code import source_sha256

    own = (
        MODELS if cfg.data.file is not None else TASKS[cfg.data.task].models if cfg.data.task in TASKS else {}
    )
    plugin = cfg.data.model  # None (the task's default model) is never a plugin's name
    if plugin is not None and plugin in model_plugins() and plugin not in own:  # recorded by reference
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, model=model_plugins()[plugin][0]))
    if not is_reference(cfg.data.model):
        if cfg.data.model_sha256 is not None or cfg.data.model_args is not None:
            raise ConfigError(
                f"data.model_sha256 and data.model_args belong to your own model ('module:factory'); "
                f"got them with data.model={cfg.data.model!r}. Remove them."
            )
        return cfg
    ref = model_reference(cfg.data.model)
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(
            cfg.data, model=ref, model_sha256=cfg.data.model_sha256 or source_sha256(ref)
        ),
    )


def require_max_clients_support(task: Any, max_clients: int | None) -> None:
    """--max-clients only for tasks whose loader reads it (else it would be ignored without a word)."""
    from fedcli.datasets.registry import TASKS

    if max_clients is None or task.reads_max_clients:
        return
    readers = ", ".join(name for name, t in TASKS.items() if t.reads_max_clients)
    raise ConfigError(
        f"data.max_clients is not used by task {task.name!r}; got {max_clients!r}. Drop --max-clients "
        f"(it applies to {readers}); --clients N keeps the first N natural clients of any task."
    )


# CLI flag of each partition field; a partition file fixes all of them.
PARTITION_FLAGS = {
    "scheme": "--scheme",
    "num_clients": "--clients",
    "alpha": "--alpha",
    "shards_per_client": "--shards-per-client",
    "labels_per_client": "--labels-per-client",
    "sigma": "--sigma",
    "size_alpha": "--size-alpha",
    "balanced": "--balanced",
    "min_size": "--min-size",
}


def validate_partition(part: PartitionConfig, data: DataConfig) -> None:
    """A partition file excludes the scheme options; otherwise the scheme's options must fit it.

    Without this check `--partition p.json --scheme iid --clients 5` trained on the file's
    partition but stored `scheme: iid, num_clients: 5` with the run.
    """
    from fedcli.datasets.partition.files import check_partition_file
    from fedcli.datasets.partition.spec import check_unused_defaults

    defaults = PartitionConfig()
    if part.file is not None:
        given = [k for k in PARTITION_FLAGS if getattr(part, k) != getattr(defaults, k)]
        if given:
            values = ", ".join(f"partition.{k}={getattr(part, k)!r}" for k in given)
            raise ConfigError(
                f"partition.{given[0]} must be left unset with partition.file; got {values} and "
                f"partition.file={part.file!r}. Drop {'/'.join(PARTITION_FLAGS[k] for k in given)}: "
                "the partition file fixes them."
            )
        check_partition_file(Path(part.file), dataset=data.task if data.file is None else None)
        return
    check_unused_defaults(part.spec())
