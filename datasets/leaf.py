"""LEAF JSON loader (FEMNIST, Shakespeare, Sent140 share the format).

Caldas et al. LEAF: A Benchmark for Federated Settings. arXiv:1812.01097. A LEAF file is
one JSON object ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...],
"y": [...]}}}``, optionally gzip-compressed. This is the only data I/O for LEAF data.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from fedcli.errors import DataError


def read_leaf_file(path: Path, *, exact_counts: bool = True) -> dict[str, Any]:
    """Parse one LEAF JSON(.gz) file and check its structure; DataError if malformed.

    exact_counts=False accepts files whose `num_samples` disagree with the stored examples
    (LEAF Shakespeare test files overstate it by 79, the window length - 1); then only
    len(x) == len(y) is required, and num_samples is rewritten to the true counts.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:  # type: ignore[operator]
            doc = json.load(fh, object_pairs_hook=_unique_keys(path))
    except RecursionError as exc:  # json's C decoder recurses once per nesting level
        raise DataError(f"LEAF file {path} is nested too deeply to read; a LEAF file is one object of "
                        "users/num_samples/user_data: re-download or re-generate it with LEAF's "
                        "preprocess.sh.") from exc
    except (OSError, EOFError, ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, DataError):
            raise
        raise DataError(f"LEAF file {path} is not valid (gzipped) JSON: {_one_line(exc)}; "
                        "re-download or re-generate it with LEAF's preprocess.sh.") from exc
    if not isinstance(doc, dict) or not {"users", "num_samples", "user_data"} <= doc.keys():
        raise DataError(f"LEAF file {path} lacks the keys users/num_samples/user_data; "
                        "is it a LEAF train/test JSON?")
    _check_types(path, doc)
    if len(doc["users"]) != len(doc["num_samples"]):
        raise DataError(f"LEAF file {path} lists {len(doc['users'])} users but {len(doc['num_samples'])} "
                        "num_samples; the file is truncated or edited.")
    for user, count in zip(doc["users"], doc["num_samples"], strict=True):
        record = doc["user_data"].get(user)
        if not isinstance(record, dict) or not isinstance(record.get("x"), list) or not isinstance(record.get("y"), list):
            raise DataError(f"LEAF file {path}: user {user!r} has no x/y lists in user_data; the file is "
                            "truncated or edited.")
        if len(record["x"]) != len(record["y"]) or (exact_counts and len(record["x"]) != count):
            raise DataError(f"LEAF file {path}: user {user!r} does not have num_samples={count} "
                            "examples in user_data; the file is truncated or edited.")
    if not exact_counts:
        doc["num_samples"] = [len(doc["user_data"][u]["x"]) for u in doc["users"]]
    return doc


def read_leaf_dir(directory: Path, *, exact_counts: bool = True) -> dict[str, dict[str, list[Any]]]:
    """Merge every *.json / *.json.gz file of a LEAF split folder: user -> {x, y}."""
    files = sorted(list(directory.glob("*.json")) + list(directory.glob("*.json.gz")))
    if not files:
        raise DataError(f"no LEAF *.json or *.json.gz files in {directory}; "
                        "point --data-dir at LEAF's data/<task>/data folder.")
    merged: dict[str, dict[str, list[Any]]] = {}
    for path in files:
        doc = read_leaf_file(path, exact_counts=exact_counts)
        for user in doc["users"]:
            if user in merged:
                raise DataError(f"user {user!r} appears in two files of {directory}.")
            merged[user] = doc["user_data"][user]
    return merged


class _DuplicateKey(DataError, ValueError):
    """A key given twice in one JSON object (json keeps the last silently)."""


def _unique_keys(path: Path) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        doc = dict(pairs)
        if len(doc) != len(pairs):
            seen: set[str] = set()
            twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise _DuplicateKey(f"LEAF file {path} gives key {twice!r} twice in one object; the file is edited "
                                "or corrupt: re-download or re-generate it with LEAF's preprocess.sh.")
        return doc
    return hook


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _check_types(path: Path, doc: dict[str, Any]) -> None:
    """users: a list of distinct names, num_samples: a list of integers, user_data: an object."""
    users, counts, data = doc["users"], doc["num_samples"], doc["user_data"]
    where = f"LEAF file {path}"
    if not isinstance(users, list) or not all(isinstance(u, str) for u in users):
        raise DataError(f"{where}: users must be a list of user names (strings); the file is truncated or edited.")
    if len(set(users)) != len(users):
        seen: set[str] = set()
        twice = next(u for u in users if u in seen or seen.add(u))  # type: ignore[func-returns-value]
        raise DataError(f"{where} lists user {twice!r} twice; the file is truncated or edited.")
    if not isinstance(counts, list) or not all(type(c) is int and c >= 0 for c in counts):
        raise DataError(f"{where}: num_samples must be a list of example counts (integers >= 0); the file is "
                        "truncated or edited.")
    if not isinstance(data, dict):
        raise DataError(f"{where}: user_data must be an object of user -> {{x, y}}; the file is truncated or "
                        "edited.")
