"""The checks of the Python API's arguments (fedcli/api.py: `fedcli.train`, `load_run`, `report`), before
anything runs: one `ConfigError` line naming the argument, its type and the fix (docs/python-api.md,
"Errors, stops and resume"), where a wrong type used to surface as a bare TypeError or ValueError, or
was str()-ed into a value the run then used.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedcli.errors import ConfigError

SECTIONS = ("train", "tracking", "partition")  # settings that may be given as a mapping of the section's keys


def number_list(name: str, values: Any, kind: type) -> tuple[Any, ...]:
    """`report`'s `at` (integers >= 1, never truncated) or `thresholds` (finite numbers), checked as the CLI does."""
    import math
    import numbers

    items = list(values) if isinstance(values, (list, tuple)) else [values]
    for value in items:
        whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        real = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
        if (kind is int and not (whole and value >= 1)) or (kind is float and not real):
            what = "round numbers (integers >= 1)" if kind is int else "finite numbers"
            raise ConfigError(f"{name} must be a list of {what}; got {kind_of(value)} in {name}={values!r}.")
    return tuple(kind(v) for v in items)


def check_bool(name: str, value: Any) -> None:
    """A switch argument must be True or False."""
    if not isinstance(value, bool):  # a str "no" is truthy
        raise ConfigError(f"{name} must be True or False; got {kind_of(value)}.")


def path_argument(name: str, value: Any) -> str | None:
    """A path argument (`root`, `output`) as text: a str or a Path, not empty; an int or a list was str()-ed."""
    import os

    from fedcli.runs.outputs import check_path_value

    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or isinstance(os.fspath(value), bytes):
        raise ConfigError(f"{name} must be a path (str or pathlib.Path); got {kind_of(value)}.")
    check_path_value(name, value)  # "" (an unset variable): the CLI's line, not the working folder
    return str(os.fspath(value))


def store_settings(store: Any, root: Any) -> dict[str, Any]:
    """`store=` / `root=` of load_run and report as tracking overrides, checked as `train`'s are."""
    if store is not None and not isinstance(store, str):  # a Path is no URL: it was str()-ed, then refused
        raise ConfigError(
            f"store must be a SQLAlchemy URL (str) such as 'sqlite:////abs/path/fedcli.db'; got "
            f"{kind_of(store)}. Pass root= for the store of a folder."
        )
    if store is not None and not store.strip():
        raise ConfigError(
            f"tracking.store must be a SQLAlchemy URL; got {store!r}. Pass --store a value, or leave it "
            "out for the default."
        )
    return {"tracking.store": store, "tracking.root": path_argument("root", root)}


def check_names(name: str, value: Any) -> None:
    """A name or a list of names (str): an int was iterated (TypeError) or a list's int str()-ed."""
    if value is None or isinstance(value, str):
        return
    bad = (
        next((v for v in value if not isinstance(v, str)), None)
        if isinstance(value, (list, tuple))
        else value
    )
    if bad is not None:
        raise ConfigError(f"{name} must be a name (str) or a list of names; got {kind_of(bad)}.")


def check_report_arguments(
    *,
    experiment: Any,
    where: Any,
    group_by: Any,
    metric: Any,
    columns: Any,
    include_unfinished: Any,
    partition_heatmap: Any,
) -> None:
    """`report`'s arguments other than runs/at/thresholds/window/smooth: one ConfigError line naming the
    argument (an int experiment or group_by was a TypeError, a str where= an AttributeError)."""
    for name, value in (("experiment", experiment), ("group_by", group_by), ("columns", columns)):
        check_names(name, value)
    if metric is not None and not isinstance(metric, str):
        raise ConfigError(f"metric must be a metric name (str) such as 'accuracy'; got {kind_of(metric)}.")
    if where is not None:
        if not isinstance(where, Mapping):
            raise ConfigError(
                f"where must be a mapping such as where={{'algo': 'fedpa'}}; got {kind_of(where)}."
            )
        for key, value in where.items():
            if not isinstance(key, str):
                raise ConfigError(f"where keys must be config keys (str) such as 'algo'; got {kind_of(key)}.")
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):  # a list was str()-ed
                raise ConfigError(f"where[{key!r}] must be a str or a number; got {kind_of(value)}.")
    check_bool("include_unfinished", include_unfinished)
    check_bool("partition_heatmap", partition_heatmap)


def kind_of(value: Any) -> str:
    """A value for an error line: its type and its repr, cut at 60 characters (`int 5`)."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def check_train_arguments(
    *,
    algo: Any,
    task: Any,
    config: Any,
    hp: Any,
    data_options: Any,
    resume: Any,
    mlflow_optional: Any,
    progress: Any,
    trust_code: Any,
    settings: Mapping[str, Any],
) -> None:
    """The types of `train`'s arguments, before anything runs: one ConfigError line naming the argument
    (a str `hp="rho=0.1"` was a bare "dictionary update sequence" ValueError, a str `progress` a
    "'str' object is not callable" TypeError once the run had started)."""
    for name, value, kinds, what in (
        ("algo", algo, str, "a name (str)"),
        ("task", task, str, "a name (str)"),
        (
            "config",
            config,
            (str, Path, Mapping),
            "a YAML file, a shipped config's name or a mapping of sections",
        ),
    ):
        if value is not None and not isinstance(value, kinds):
            raise ConfigError(f"{name} must be {what}; got {kind_of(value)}.")
    for name, value, example in (
        ("hp", hp, "hp={'rho': 0.1}"),
        ("data_options", data_options, "data_options={'client': 'writer_id'}"),
    ):
        if value is not None and not isinstance(value, Mapping):
            raise ConfigError(f"{name} must be a mapping such as {example}; got {kind_of(value)}.")
        bad = next((k for k in value or {} if not isinstance(k, str)), None)
        if bad is not None:
            raise ConfigError(f"{name} keys must be names (str); got {kind_of(bad)}.")
    if resume is not None and not isinstance(resume, str):  # fedcli.train passes a Run as its id
        raise ConfigError(
            f"resume must be a run id, id prefix or name (str), or a Run; got {kind_of(resume)}."
        )
    check_bool("mlflow_optional", mlflow_optional)
    if not isinstance(progress, bool) and not callable(progress):
        raise ConfigError(
            f"progress must be True, False or a function f(round, metrics); got {kind_of(progress)}."
        )
    check_bool("trust_code", trust_code)  # trust_code="no" was truthy: a resumed run's code ran
    for name in SECTIONS:
        if name == "partition" and isinstance(settings.get(name), (str, Path)):
            continue  # `partition="p.json"`: the --partition file
        if name in settings and settings[name] is not None and not isinstance(settings[name], Mapping):
            raise ConfigError(
                f"{name}= must be a mapping of the {name} section's config keys, such as "
                f"{name}={{...}}; got {kind_of(settings[name])}."
            )


def split_settings(settings: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keyword settings -> (options by name, dotted overrides from the section mappings)."""
    options: dict[str, Any] = {}
    sections: dict[str, Any] = {}
    for name, value in settings.items():
        if name in SECTIONS and isinstance(value, Mapping):
            sections.update({f"{name}.{key}": v for key, v in value.items()})
        else:
            options[name] = value
    return options, sections
