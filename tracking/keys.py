"""Metric-key and metric-value checks shared by both sinks, and config flattening.

docs/style.md rule 15: metric keys are `<split>/<name>` made of `[A-Za-z0-9_./ -]`, with no
`//` and no leading `/`; NaN and inf are never logged. The SQL store calls
`check_metrics` on every round it writes, so a key or value MLflow would reject (or silently
mangle) never reaches the mirror's copy, and the two stores never disagree.

This module imports no MLflow and no SQLAlchemy.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping

__all__ = [
    "MAX_KEY_LENGTH",
    "NonFiniteMetricsError",
    "check_metric_key",
    "check_metrics",
    "flatten_config",
]

MAX_KEY_LENGTH = 250  # MLflow's limit on metric/param/tag keys (mlflow.utils.validation)
_METRIC_KEY_RE = re.compile(r"^[A-Za-z0-9_./ -]+$")


class NonFiniteMetricsError(ValueError):
    """Some metric values are NaN or infinite; nothing of that call was logged.

    Attributes:
        keys: The offending keys, sorted.
        round_idx: The round the values belong to, when known.
    """

    def __init__(self, keys: Iterable[str], values: Mapping[str, float], round_idx: int | None) -> None:
        self.keys = tuple(sorted(keys))
        self.round_idx = round_idx
        where = "" if round_idx is None else f" at round {round_idx}"
        shown = ", ".join(f"{key}={values[key]!r}" for key in self.keys)
        super().__init__(f"non-finite metric values{where}: {shown}; the run diverged.")


def check_metric_key(key: str) -> str:
    """Check one metric key against the house rules and MLflow's limits.

    Args:
        key: A metric key such as `eval/accuracy`.

    Returns:
        The key, unchanged.

    Raises:
        ValueError: If the key is empty, too long, has a character outside
            `[A-Za-z0-9_./ -]`, contains `//` or starts with `/`.
    """
    if not isinstance(key, str) or not _METRIC_KEY_RE.match(key):
        raise ValueError(f"metric key must be made of [A-Za-z0-9_./ -] (e.g. 'eval/accuracy'); got {key!r}.")
    if "//" in key or key.startswith("/"):
        raise ValueError(f"metric key must not contain '//' or start with '/'; got {key!r}.")
    if len(key) > MAX_KEY_LENGTH:
        raise ValueError(f"metric key must be at most {MAX_KEY_LENGTH} characters; got {len(key)}: {key!r}.")
    return key


def check_metrics(metrics: Mapping[str, float], round_idx: int | None = None) -> dict[str, float]:
    """Validate keys and values of one batch of metrics and convert values to `float`.

    Args:
        metrics: Metric key -> value (Python numbers, NumPy or 0-d tensor scalars).
        round_idx: The round, only used in the error message.

    Returns:
        A new dict of key -> float, in the input's order.

    Raises:
        ValueError: For a bad key (see `check_metric_key`) or a value that is not a real
            number.
        NonFiniteMetricsError: If any value is NaN or infinite; it lists every such key.
    """
    checked: dict[str, float] = {}
    for key, value in metrics.items():
        check_metric_key(key)
        try:
            checked[key] = float(value)
        except (TypeError, ValueError) as err:
            raise ValueError(f"metric {key!r} must be a real number; got {value!r}.") from err
    bad = [key for key, value in checked.items() if not math.isfinite(value)]
    if bad:
        raise NonFiniteMetricsError(bad, checked, round_idx)
    return checked


def flatten_config(cfg: Mapping[str, object], prefix: str = "") -> dict[str, str]:
    """Flatten a nested config mapping into dot-joined keys with string values.

    Nested mappings are descended into (`{"algorithm": {"rho": 0.1}}` ->
    `{"algorithm.rho": "0.1"}`); lists and tuples are written as JSON
    (`[1, 2]` -> `"[1,2]"`); `None` becomes `"None"`; everything else is `str()`'d.
    An empty nested mapping is kept as `"{}"` so that its key is not lost.

    Args:
        cfg: The resolved config as plain data (what `canonical_json` accepts).
        prefix: Key prefix used by the recursion; leave empty.

    Returns:
        Flat key -> string value, keys sorted.
    """
    flat: dict[str, str] = {}
    for key in sorted(cfg, key=str):
        value = cfg[key]
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, prefix=f"{name}."))
        elif isinstance(value, Mapping):
            flat[name] = "{}"
        elif isinstance(value, (list, tuple)):
            flat[name] = json.dumps(list(value), separators=(",", ":"), sort_keys=True, default=str)
        else:
            flat[name] = str(value)
    return dict(sorted(flat.items()))
