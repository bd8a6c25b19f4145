"""Reading and checking user input: YAML and KEY=VALUE parsing, typed sections, tracking checks (docs/style.md rule 11).

Part of the package fedcli.config (fedcli/config/__init__.py). Every
user-facing check of a config raises `ConfigError` in the format of docs/style.md rule 11:
value types and ranges (`coerce`), the algorithm's hyperparameters (`make_hyperparameters`),
the tracking section (`validate_tracking`), names (`check_name`) and stores that must exist
(`require_store`). The cross-field checks of a whole config (`validate`, `validate_partition`)
are in fedcli/config/validation.py. Imports only `sections` of fedcli.config.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pydantic
import yaml

from fedcli.algorithms.base import HyperparameterError
from fedcli.config.sections import (
    TrackingConfig,
)
from fedcli.errors import ConfigError
from fedcli.tracking.urls import is_masked, mask_url


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping that gives one key twice (PyYAML keeps the last silently)."""

    def __init__(self, key: Any, first: yaml.Mark, again: yaml.Mark) -> None:
        super().__init__(None, None, f"key {key!r} is given twice", again)
        self.key, self.first_line, self.line = key, first.line + 1, again.line + 1


class UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping (merge keys `<<` may still be overridden)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: the base class says so
                break
            if first is not key_node.start_mark:
                raise DuplicateKeyError(key, first, key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, source: str) -> Any:
    """Parse YAML safely: one ConfigError line naming `source` for a duplicate key, bad syntax or deep nesting.

    Every YAML a user writes (config files, sweep specs, recipes, `--hp KEY={...}` values) is read here.
    """
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except DuplicateKeyError as exc:
        raise ConfigError(
            f"{source} gives key {exc.key!r} twice (lines {exc.first_line} and {exc.line}); "
            "keep one (YAML would silently use the last)."
        ) from None
    except RecursionError:
        raise ConfigError(
            f"{source} is nested too deeply to read; a config is a few levels of mappings and lists."
        ) from None
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{source} is not valid YAML: {first}") from None


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping; ConfigError naming the file when it is malformed."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"config file {path} is not valid YAML: {first}") from exc
    doc = load_yaml(text, f"config file {path}")
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {path} must be a mapping of sections; got {type(doc).__name__}.")
    return doc


def suggest(name: str, options: list[str] | tuple[str, ...]) -> str:
    """Return ' (did you mean 'x'?)' for the closest option, or ''."""
    match = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def parse_assignments(items: list[str], flag: str) -> dict[str, Any]:
    """Parse ['key=value', ...] into {key: typed value}; ConfigError on a malformed item.

    Each value is read as YAML ('0.1', 'true', '[1,2]'), falling back to the string; a mapping that
    gives a key twice (`{a: 1, a: 2}`) or nesting too deep to read is a ConfigError.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ConfigError(f"{flag} must be KEY=VALUE; got {item!r}.")
        if key in out:
            raise ConfigError(
                f"{flag} {key} must be given once; got {key}={out[key]!r} and {item!r}. Keep one."
            )
        try:
            out[key] = yaml.load(value, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
        except (DuplicateKeyError, RecursionError):
            out[key] = load_yaml(value, f"{flag} {value[:60]!r}")  # raises the one line
        except yaml.YAMLError:
            out[key] = value
    return out


INT_MAX = (
    2**31 - 1
)  # the largest integer setting: the stores keep seeds and rounds as 32-bit integers on PostgreSQL
NAME_MAX_BYTES = 200  # experiment and run names (UTF-8): both stores and MLflow keep them; a report file is named after one


@functools.cache
def _adapter(cls: type) -> pydantic.TypeAdapter[Any]:
    return pydantic.TypeAdapter(cls)


def validated(prefix: str, cls: type, values: Mapping[str, Any]) -> Any:
    """`cls(**values)` for a config dataclass (a section, an algorithm's hyperparameters), validated by
    pydantic against the fields' types and the bounds in their metadata (sections.py `opt`).

    The one validation path of a config's values; the keys must be fields of `cls` (the callers name
    an unknown key). On top of pydantic's checks, a value is never cast: int -> float is allowed, and
    a number written as text ('5e-5', which YAML 1.1 reads as a string) for a float, but '5' or 5.0
    for an int, or 1 for a bool, are refused. A number must be storable: a float finite, an int within
    +-INT_MAX (docs/architecture.md §8). A field's `choices` (metadata) are checked last.

    Raises:
        ConfigError: the first problem as one line (`config_error`).
    """
    for key, value in values.items():  # before the class's own checks (__post_init__) see a NaN
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}.{key} must be a finite number; got {value!r}.")
    try:
        out = _adapter(cls).validate_python(dict(values))
    except pydantic.ValidationError as exc:
        raise config_error(prefix, cls, exc, values) from None
    for item in dataclasses.fields(cls):
        if item.name not in values:
            continue
        key, value, checked = f"{prefix}.{item.name}", values[item.name], getattr(out, item.name)
        if _cast(value, checked):
            raise ConfigError(f"{key} must be {type(checked).__name__}; got {value!r}.")
        if isinstance(checked, float) and not math.isfinite(checked):
            raise ConfigError(f"{key} must be a finite number; got {value!r}.")
        if isinstance(checked, int) and not isinstance(checked, bool) and abs(checked) > INT_MAX:
            raise ConfigError(f"{key} must be at most {INT_MAX} (2**31 - 1) in size; got {value!r}.")
        choices = item.metadata.get("choices")
        if choices and checked not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {checked!r}.")
    return out


# a validated value's type -> the types it may be given as (a float also as text, '5e-5'); others: any
GIVEN_AS: tuple[tuple[type, type | tuple[type, ...]], ...] = (
    (int, int),
    (float, (int, float, str)),
    (str, str),
)


def _cast(value: Any, checked: Any) -> bool:
    """Whether pydantic's lax mode turned `value` into `checked` by a cast fedcli refuses."""
    if isinstance(checked, bool) or isinstance(value, bool):
        return type(value) is not type(checked)
    allowed = next((given for kind, given in GIVEN_AS if isinstance(checked, kind)), object)
    return not isinstance(value, allowed)


BOUNDS = {"greater_than_equal": ">=", "less_than_equal": "<=", "greater_than": ">", "less_than": "<"}


def config_error(
    prefix: str, cls: type, exc: pydantic.ValidationError, values: Mapping[str, Any]
) -> ConfigError:
    """The first error of a pydantic validation of `cls` as the one line of docs/style.md rule 11:
    `{prefix}.{key} must be ...; got {value!r}.` (the value as given), or the message of the
    HyperparameterError the class's own checks raised."""
    first = exc.errors()[0]
    name = str(first["loc"][0]) if first["loc"] else ""
    key, ctx = f"{prefix}.{name}", first.get("ctx") or {}
    if isinstance(ctx.get("error"), HyperparameterError):
        return ConfigError(str(ctx["error"]))
    if isinstance(ctx.get("error"), Exception) and not first["loc"]:  # another ValueError of __post_init__
        return ConfigError(f"{prefix}: {ctx['error']}")
    if first["type"] == "missing":
        flag = f"--hp {name}=VALUE" if prefix == "hp" else f"`{name}: VALUE` in the {prefix} section"
        return ConfigError(f"{key} must be given (it has no default); got none. Pass it with {flag}.")
    value = values.get(name)
    if first["type"] in BOUNDS:
        if _not_finite(value):  # 'inf' given as text, past a bound
            return ConfigError(f"{key} must be a finite number; got {value!r}.")
        names = type_names(cls, name)  # a cast value out of bounds ('0' or 0.0 for an int): its type first
        if isinstance(value, bool) or isinstance(value, (str, float)) and "float" not in names:
            return ConfigError(f"{key} must be {names}; got {value!r}.")
        meta: Mapping[str, Any] = next((f.metadata for f in dataclasses.fields(cls) if f.name == name), {})
        name_of_bound = next(iter(ctx))  # ge, le, gt, lt: as declared (pydantic gives 0.0 for a float's 0)
        bound = meta.get(name_of_bound, ctx[name_of_bound])
        fix = meta.get("fix", "") if first["type"] == "less_than_equal" else ""  # what to do past the top
        return ConfigError(
            f"{key} must be {BOUNDS[first['type']]} {bound}; got {value!r}." + (f" {fix}" if fix else "")
        )
    if value is None:
        return ConfigError(f"{key} must be set; got None.")
    return ConfigError(f"{key} must be {type_names(cls, name)}; got {value!r}.")


def _not_finite(value: Any) -> bool:
    try:
        return not math.isfinite(float(value))
    except (TypeError, ValueError, OverflowError):
        return False


def type_names(cls: type, name: str) -> str:
    """A field's type as written, None left out: `int`, `tuple[str, ...]`, `Mapping[str, Any]`."""
    try:
        hint = typing.get_type_hints(cls)[name]
    except (NameError, KeyError, TypeError):  # annotations that do not resolve: pydantic named the problem
        return "a valid value"
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kinds = [k for k in (typing.get_args(hint) if union else (hint,)) if k is not type(None)]
    names = (k.__name__ if isinstance(k, type) else str(k) for k in kinds)
    return " or ".join(sorted(n.replace("collections.abc.", "").replace("typing.", "") for n in names))


def build_section(name: str, cls: type, values: Mapping[str, Any]) -> Any:
    """Construct one frozen section from a mapping, naming unknown keys and bad types (`validated`)."""
    known = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in known:
            raise ConfigError(f"unknown config key '{name}.{key}'{suggest(str(key), known)}.")
    return validated(name, cls, values)


def make_hyperparameters(algo_name: str, values: Mapping[str, Any]) -> Any:
    """Build the algorithm's hyperparameter dataclass from user values (keys without 'hp.')."""
    from fedcli.algorithms import ALGORITHMS

    if algo_name not in ALGORITHMS:
        raise ConfigError(
            f"unknown algorithm {algo_name!r}{suggest(algo_name, list(ALGORITHMS))}; "
            f"choose one of: {', '.join(ALGORITHMS)}."
        )
    cls = ALGORITHMS[algo_name].config_cls
    known = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in known:
            raise ConfigError(
                f"unknown hyperparameter 'hp.{key}' for {algo_name}{suggest(str(key), known)}; "
                f"valid: {', '.join(known) or 'none'}."
            )
    return validated("hp", cls, values)


def check_name(key: str, value: str, flag: str) -> None:
    """An experiment, run or trial name: 1 to NAME_MAX_BYTES bytes of UTF-8, no control characters.

    One limit for every store: PostgreSQL and MLflow refuse longer names where SQLite would keep
    them, a report file is named after the experiment (255 bytes per file name), and PostgreSQL
    refuses NUL characters.
    """
    if not value.strip():
        raise ConfigError(
            f"{key} must be a non-empty name; got {value!r}. Pass {flag} NAME, or leave it out."
        )
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > NAME_MAX_BYTES:
        raise ConfigError(
            f"{key} must be at most {NAME_MAX_BYTES} bytes (UTF-8); got {size} bytes "
            f"({value[:40]!r}...). Pass {flag} a shorter name."
        )
    bad = sorted({c for c in value if ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) <= 0xDFFF})
    if bad:
        raise ConfigError(
            f"{key} must not hold control characters; got {value!r} (with {bad[0]!r}). "
            f"Pass {flag} a name of printable characters."
        )


MLFLOW_SCHEMES = (
    "sqlite",
    "postgresql",
    "mysql",
    "mssql",
    "http",
    "https",
    "databricks",
)  # MLflow's SQL and REST stores


def check_blank_tracking(track: TrackingConfig) -> None:
    """An empty root, store or MLflow URI (e.g. `--store "$STORE"` with STORE unset) is refused, not the default."""
    for key, flag, what in (
        ("root", "--root", "a folder"),
        ("store", "--store", "a SQLAlchemy URL"),
        ("tracking_uri", "--tracking-uri", "an MLflow URI"),
    ):
        value = getattr(track, key)
        if value is not None and not value.strip():
            raise ConfigError(
                f"tracking.{key} must be {what}; got {value!r}. Pass {flag} a value, or leave it out "
                "for the default."
            )


def check_not_in_memory(key: str, url: str | None, source: str) -> None:
    """An in-memory SQLite URL keeps nothing past its connection (a run trained, then failed on "no such table"):
    `sqlite://`, `sqlite:///`, `sqlite:///:memory:`, `?mode=memory`, a database each connection sees empty."""
    if not url or not url.lower().startswith("sqlite"):
        return
    database = url.split("://", 1)[-1].removeprefix("/").split("?", 1)[0]
    if database in ("", ":memory:") or "mode=memory" in url.lower():
        raise ConfigError(
            f"{key} must be a database that outlives the command; got {mask_url(url)!r} (from "
            f"{source}), an in-memory SQLite database. Pass a file such as sqlite:////abs/path/fedcli.db, "
            "or leave it out for the default."
        )


def validate_tracking(track: TrackingConfig) -> None:
    """Names, and an MLflow URI MLflow can write, before anything is (docs/architecture.md §8)."""
    check_name("tracking.experiment", track.experiment, "--experiment")
    if track.run_name is not None:
        check_name("tracking.run_name", track.run_name, "--run-name")
    check_blank_tracking(track)
    check_not_in_memory(
        "tracking.store",
        track.store or os.environ.get("FEDCLI_STORE"),
        "--store" if track.store else "FEDCLI_STORE",
    )
    if not track.use_mlflow:
        return
    check_not_in_memory(
        "tracking.tracking_uri",
        track.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"),
        "--tracking-uri" if track.tracking_uri else "MLFLOW_TRACKING_URI",
    )
    # a stored config's URI has its password masked (given_url asks for it when MLflow is used): check its scheme
    uri = track.tracking_uri if track.tracking_uri and is_masked(track.tracking_uri) else track.mlflow_uri
    source = "--tracking-uri" if track.tracking_uri else "MLFLOW_TRACKING_URI"
    scheme = (
        uri.partition(":")[0].partition("+")[0].lower()
        if "://" in uri or uri.startswith("databricks")
        else ""
    )
    if scheme in MLFLOW_SCHEMES:
        return
    if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("1", "true") and scheme in ("", "file"):
        return  # MLflow's folder store, allowed by the user (MLflow 3 refuses it otherwise)
    raise ConfigError(
        f"tracking.tracking_uri must be an MLflow store URI such as sqlite:///PATH/mlflow.db, "
        f"postgresql://HOST/DB or http://HOST:PORT; got {mask_url(uri)!r} (from {source}). Fix {source}, "
        "or pass --no-mlflow."
    )


def store_file(url: str) -> Path | None:
    """The database file of a SQLite store URL; None for other databases and in-memory SQLite."""
    if not url.startswith("sqlite:///"):
        return None
    database = url.removeprefix("sqlite:///").split("?", 1)[0]
    return (
        None if database in ("", ":memory:") or database.startswith("file:") else Path(database).expanduser()
    )


def require_store(url: str) -> None:
    """For commands that only read runs: the store must exist (opening a missing SQLite file creates it)."""
    check_not_in_memory("tracking.store", url, "--store or FEDCLI_STORE")
    path = store_file(url)
    if path is None or path.is_file():
        return
    raise ConfigError(
        f"tracking.store must be an existing results store; got {url!r} "
        f"({'a directory' if path.is_dir() else 'no such file'}). Train a run "
        "into it first (fedcli train), or pass --store / set FEDCLI_STORE to the store you trained into."
    )
