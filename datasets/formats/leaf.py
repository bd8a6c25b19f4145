"""LEAF JSON loader (FEMNIST, Shakespeare, Sent140 share the format).

Caldas et al. LEAF: A Benchmark for Federated Settings. arXiv:1812.01097. A LEAF file is
one JSON object ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...],
"y": [...]}}}``, optionally gzip-compressed. This is the only data I/O for LEAF data.

`stream_leaf_store` writes a split folder's users into a disk store (datasets/formats/diskstore.py) one
file at a time, so a full LEAF federation never sits in memory as Python lists at once: each
file's users are encoded to arrays and appended, then the rows are put in sorted-user order (the
in-memory loaders' order, so that the store holds the same arrays and fingerprint).
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

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
        raise DataError(
            f"LEAF file {path} is nested too deeply to read; a LEAF file is one object of "
            "users/num_samples/user_data: re-download or re-generate it with LEAF's "
            "preprocess.sh."
        ) from exc
    except (OSError, EOFError, ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, DataError):
            raise
        raise DataError(
            f"LEAF file {path} is not valid (gzipped) JSON: {_one_line(exc)}{_where_stopped(path, exc)}; "
            "re-download or re-generate it with LEAF's preprocess.sh."
        ) from exc
    if not isinstance(doc, dict) or not {"users", "num_samples", "user_data"} <= doc.keys():
        raise DataError(
            f"LEAF file {path} lacks the keys users/num_samples/user_data; is it a LEAF train/test JSON?"
        )
    _check_types(path, doc)
    if len(doc["users"]) != len(doc["num_samples"]):
        raise DataError(
            f"LEAF file {path} lists {len(doc['users'])} users but {len(doc['num_samples'])} "
            "num_samples; the file is truncated or edited."
        )
    for user, count in zip(doc["users"], doc["num_samples"], strict=True):
        record = doc["user_data"].get(user)
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("x"), list)
            or not isinstance(record.get("y"), list)
        ):
            raise DataError(
                f"LEAF file {path}: user {user!r} has no x/y lists in user_data; the file is "
                "truncated or edited."
            )
        if len(record["x"]) != len(record["y"]) or (exact_counts and len(record["x"]) != count):
            raise DataError(
                f"LEAF file {path}: user {user!r} does not have num_samples={count} "
                "examples in user_data; the file is truncated or edited."
            )
    if not exact_counts:
        doc["num_samples"] = [len(doc["user_data"][u]["x"]) for u in doc["users"]]
    return doc


def read_leaf_dir(directory: Path, *, exact_counts: bool = True) -> dict[str, dict[str, list[Any]]]:
    """Merge every *.json / *.json.gz file of a LEAF split folder: user -> {x, y}."""
    return {user: record for _, user, record in iter_leaf_users(directory, exact_counts=exact_counts)}


class _DuplicateKey(DataError, ValueError):
    """A key given twice in one JSON object (json keeps the last silently)."""


def _unique_keys(path: Path) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        doc = dict(pairs)
        if len(doc) != len(pairs):
            seen: set[str] = set()
            twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise _DuplicateKey(
                f"LEAF file {path} gives key {twice!r} twice in one object; the file is edited "
                "or corrupt: re-download or re-generate it with LEAF's preprocess.sh."
            )
        return doc

    return hook


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _check_types(path: Path, doc: dict[str, Any]) -> None:
    """users: a list of distinct names, num_samples: a list of integers, user_data: an object."""
    users, counts, data = doc["users"], doc["num_samples"], doc["user_data"]
    where = f"LEAF file {path}"
    if not isinstance(users, list) or not all(isinstance(u, str) for u in users):
        raise DataError(
            f"{where}: users must be a list of user names (strings); the file is truncated or edited."
        )
    if len(set(users)) != len(users):
        seen: set[str] = set()
        twice = next(u for u in users if u in seen or seen.add(u))  # type: ignore[func-returns-value]
        raise DataError(f"{where} lists user {twice!r} twice; the file is truncated or edited.")
    if not isinstance(counts, list) or not all(type(c) is int and c >= 0 for c in counts):
        raise DataError(
            f"{where}: num_samples must be a list of example counts (integers >= 0); the file is "
            "truncated or edited."
        )
    if not isinstance(data, dict):
        raise DataError(
            f"{where}: user_data must be an object of user -> {{x, y}}; the file is truncated or edited."
        )


_USER_RECORD = re.compile(r'"((?:[^"\\]|\\.)*)"\s*:\s*\{\s*"[xy]"')  # "<user>": {"x" (or "y") in user_data


def _where_stopped(path: Path, exc: BaseException) -> str:
    """ ", reading stopped at user 'u'" where a truncated or broken file's last user record starts."""
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":  # as much as decompresses
            raw = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(raw)
        text = raw.decode("utf-8", errors="replace")
    except (OSError, zlib.error):
        return ""
    pos = getattr(exc, "pos", None)
    matches = deque(_USER_RECORD.finditer(text, 0, pos if isinstance(pos, int) else len(text)), maxlen=1)
    last = matches[0] if matches else None
    if last is None:
        return ", before its first user's examples"
    return f", reading stopped at user {last.group(1)!r}"


def leaf_files(directory: Path) -> list[Path]:
    """A LEAF split folder's *.json / *.json.gz files, sorted; DataError if there are none."""
    files = sorted(list(directory.glob("*.json")) + list(directory.glob("*.json.gz")))
    if not files:
        raise DataError(
            f"no LEAF *.json or *.json.gz files in {directory}; "
            "point --data-dir at LEAF's data/<task>/data folder."
        )
    return files


def iter_leaf_users(
    directory: Path, *, exact_counts: bool = True
) -> Iterator[tuple[Path, str, dict[str, Any]]]:
    """(file, user, {x, y}) of a split folder, one file in memory at a time; a user in two files is refused."""
    seen: set[str] = set()
    for path in leaf_files(directory):
        doc = read_leaf_file(path, exact_counts=exact_counts)
        for user in doc["users"]:
            if user in seen:
                raise DataError(f"user {user!r} appears in two files of {directory}.")
            seen.add(user)
            yield path, user, doc["user_data"][user]
        del doc


UserRows = Callable[[dict[str, Any], str], dict[str, np.ndarray]]  # (record, where) -> {"x": rows, "y": rows}


def stream_leaf_store(
    what: str,
    folder: Path,
    encode: UserRows,
    *,
    num_classes: int | None,
    max_clients: int | None = None,
    exact_counts: bool = True,
    key_parts: tuple[Any, ...] = (),
    fingerprint_as: dict[str, Any] | None = None,
) -> Any:
    """folder/{train,test} into a disk store (built once per fingerprint of the files) and the TaskData over it.

    Users are sorted by id (the first max_clients kept), test users aligned to them, as the
    in-memory loaders do; `encode(record, where)` turns one user's record into row arrays.
    """
    from fedcli.datasets.formats import diskstore

    train_files, test_files = leaf_files(folder / "train"), leaf_files(folder / "test")
    key = diskstore.store_key(
        what, diskstore.file_fingerprint(train_files + test_files), max_clients, *key_parts
    )

    def split(writer: diskstore.StoreWriter, name: str, prefix: str, keep: list[str] | None) -> list[str]:
        ranges: dict[str, tuple[int, int]] = {}
        total, wanted = 0, None if keep is None else set(keep)
        with diskstore.progress(len(leaf_files(folder / name)), f"{what}: {name}/ files") as advance:
            last = None
            for path, user, record in iter_leaf_users(folder / name, exact_counts=exact_counts):
                if path != last and last is not None:
                    advance(1)
                last = path
                if wanted is not None and user not in wanted:
                    continue
                rows = encode(record, f"{path} user {user}")
                for array, values in rows.items():
                    writer.append(f"raw_{prefix}{array}", values)
                ranges[user] = (total, len(rows["y"]))
                total += len(rows["y"])
            advance(1)
        users = sorted(ranges)[:max_clients] if keep is None else [u for u in keep if u in ranges]
        specs = writer.specs()
        for array in ("x", "y"):
            raw = diskstore.open_array(writer.folder, f"raw_{prefix}{array}", specs[f"raw_{prefix}{array}"])
            writer.declare(f"{prefix}{array}", raw.dtype, raw.shape[1:])
            for user in users:  # the in-memory order: users sorted, each user's rows in file order
                start, count = ranges[user]
                writer.append(f"{prefix}{array}", np.asarray(raw[start : start + count]))
            del raw
            writer.drop(f"raw_{prefix}{array}")
        sizes = {u: ranges[u][1] for u in users}  # test users: the train users' order, 0 for one without
        diskstore.write_consecutive(
            writer, prefix, [sizes.get(u, 0) for u in (users if keep is None else keep)]
        )
        return users

    def fill(writer: diskstore.StoreWriter) -> dict[str, Any]:
        users = split(writer, "train", "", None)
        split(writer, "test", "test_", users)
        return {
            "client_names": users,
            "num_classes": num_classes,
            "source": what,
            "fingerprint": diskstore.stream_fingerprint(
                writer.folder, writer.specs(), as_dtype=fingerprint_as
            ),
        }

    return diskstore.task_data_of(diskstore.open_store(diskstore.build_store(key, what, fill)))
