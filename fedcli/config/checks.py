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
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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


def parse_value(text: str, flag: str = "value") -> Any:
    """Parse a CLI value ('0.1', 'true', '[1,2]') as YAML; fall back to the string.

    Raises:
        ConfigError: a mapping that gives a key twice (`{a: 1, a: 2}`), or nesting too deep to read.
    """
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except (DuplicateKeyError, RecursionError):
        return load_yaml(text, f"{flag} {text[:60]!r}")  # raises the one line
    except yaml.YAMLError:
        return text


def parse_assignments(items: list[str], flag: str) -> dict[str, Any]:
    """Parse ['key=value', ...] into {key: typed value}; ConfigError on a malformed item."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag} must be KEY=VALUE; got {item!r}.")
        if key.strip() in out:
            raise ConfigError(
                f"{flag} {key.strip()} must be given once; got {key.strip()}={out[key.strip()]!r} and "
                f"{item!r}. Keep one."
            )
        out[key.strip()] = parse_value(value.strip(), flag)
    return out


INT_MAX = (
    2**31 - 1
)  # the largest integer setting: the stores keep seeds and rounds as 32-bit integers on PostgreSQL
NAME_MAX_BYTES = 200  # experiment and run names (UTF-8): both stores and MLflow keep them; a report file is named after one
THREADS_MAX = 1024  # train.threads and train.workers: more is a typo, not a machine


def coerce(key: str, annotation: object, value: Any) -> Any:
    """Check `value` against a dataclass field annotation (as written); int -> float is allowed.

    Numbers must also be storable: a float finite, an int within +-INT_MAX (docs/architecture.md §8).
    """
    checked = _coerce(key, annotation, value)
    if isinstance(checked, float) and not math.isfinite(checked):
        raise ConfigError(f"{key} must be a finite number; got {value!r}.")
    if isinstance(checked, int) and not isinstance(checked, bool) and abs(checked) > INT_MAX:
        raise ConfigError(f"{key} must be at most {INT_MAX} (2**31 - 1) in size; got {value!r}.")
    return checked


def _coerce(key: str, annotation: object, value: Any) -> Any:
    text = str(annotation)
    if value is None:
        if "None" in text:
            return None
        raise ConfigError(f"{key} must be set; got None.")
    kinds = {part.strip() for part in text.split("|")}
    if isinstance(value, bool):
        if "bool" in kinds:
            return value
    elif isinstance(value, int) and ("int" in kinds or "float" in kinds):
        return value if "int" in kinds else float(value)
    elif isinstance(value, float) and "float" in kinds:
        return value
    elif isinstance(value, str) and "float" in kinds and _is_number(value):
        return float(value)  # YAML 1.1 reads 5e-5 (no dot) as a string
    elif isinstance(value, str) and "str" in kinds:
        return value
    elif isinstance(value, Mapping) and any(k.startswith("Mapping") or k.startswith("dict") for k in kinds):
        return dict(value)
    elif "tuple[str, ...]" in kinds and isinstance(value, (str, list, tuple)):  # a list, or "a,b" on the CLI
        items = value.split(",") if isinstance(value, str) else value
        if all(isinstance(v, str) for v in items):  # data.augment: [crop:4, flip] in YAML
            return tuple(v.strip() for v in items if v.strip()) or None
    expected = " or ".join(sorted(k for k in kinds if k != "None"))
    raise ConfigError(f"{key} must be {expected}; got {value!r}.")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def build_section(name: str, cls: type, values: Mapping[str, Any]) -> Any:
    """Construct one frozen section from a mapping, naming unknown keys and bad types."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"unknown config key '{name}.{key}'{suggest(key, list(known))}.")
        kwargs[key] = coerce(f"{name}.{key}", known[key].type, value)
    try:
        return cls(**kwargs)
    except HyperparameterError as exc:
        raise ConfigError(str(exc)) from None


def make_hyperparameters(algo_name: str, values: Mapping[str, Any]) -> Any:
    """Build the algorithm's hyperparameter dataclass from user values (keys without 'hp.')."""
    from fedcli.algorithms import ALGORITHMS

    if algo_name not in ALGORITHMS:
        raise ConfigError(
            f"unknown algorithm {algo_name!r}{suggest(algo_name, list(ALGORITHMS))}; "
            f"choose one of: {', '.join(ALGORITHMS)}."
        )
    cls = ALGORITHMS[algo_name].config_cls
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            valid = ", ".join(known) or "none"
            raise ConfigError(
                f"unknown hyperparameter 'hp.{key}' for {algo_name}{suggest(key, list(known))}; "
                f"valid: {valid}."
            )
        kwargs[key] = coerce(f"hp.{key}", known[key].type, value)
    try:
        return cls(**kwargs)
    except HyperparameterError as exc:
        raise ConfigError(str(exc)) from None
    except TypeError as exc:  # a required hyperparameter is missing
        raise ConfigError(f"{algo_name}: {exc}; pass it with --hp KEY=VALUE.") from None


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


def in_memory_sqlite(url: str) -> bool:
    """`sqlite://`, `sqlite:///`, `sqlite:///:memory:`, `?mode=memory`: a database each connection sees empty."""
    if not url.lower().startswith("sqlite"):
        return False
    database = url.split("://", 1)[-1].removeprefix("/").split("?", 1)[0]
    return database in ("", ":memory:") or "mode=memory" in url.lower()


def check_not_in_memory(key: str, url: str | None, source: str) -> None:
    """An in-memory SQLite URL keeps nothing past its connection (a run trained, then failed on "no such table")."""
    if url and in_memory_sqlite(url):
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
    what = "a directory" if path.is_dir() else "no such file"
    raise ConfigError(
        f"tracking.store must be an existing results store; got {url!r} ({what}). Train a run "
        "into it first (fedcli train), or pass --store / set FEDCLI_STORE to the store you trained into."
    )
