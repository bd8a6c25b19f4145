"""Partition files: write one atomically as canonical JSON with a content hash, read one back checked.

Part of datasets/partition/ (`make.make_partition` builds what this module saves). A file holds the
clients, the PartitionSpec, the data set's name and fingerprint and its label histograms; every
problem on reading is one ConfigError naming the file and the fix (`fedcli partition ... --out`).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np

from fedcli.datasets.partition.spec import PartitionSpec
from fedcli.datasets.partition.summary import label_histograms
from fedcli.errors import ConfigError

FORMAT = "fedcli-partition"
FORMAT_VERSION = 1
_NONE = object()  # no bad index found


def _canonical(doc: dict[str, Any]) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def save_partition(
    path: Path,
    clients: Sequence[np.ndarray],
    *,
    spec: PartitionSpec,
    dataset: str,
    fingerprint: str,
    labels: np.ndarray,
) -> None:
    """Write a partition file atomically (temp file + rename): clients, spec, checks, hash.

    The file is canonical JSON (sorted keys, no whitespace), so the same partition always
    gives the same bytes. `content_sha256` covers every other field.
    """
    hist = label_histograms(clients, labels)
    doc: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "dataset": dataset,
        "fingerprint": fingerprint,
        "spec": asdict(spec),
        "num_examples": int(len(labels)),
        "num_clients": len(clients),
        "clients": [[int(i) for i in c] for c in clients],
        "label_histograms": None if hist is None else hist.tolist(),
    }
    doc["content_sha256"] = hashlib.sha256(_canonical(doc).encode()).hexdigest()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as fh:
            fh.write(_canonical(doc) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a partition file is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_partition(path: Path, *, dataset: str, fingerprint: str) -> tuple[list[np.ndarray], PartitionSpec]:
    """Read and check a partition file; ConfigError naming the file and the fix on any problem."""
    path = Path(path)
    doc = _read_partition(path, dataset=dataset)
    if doc.get("fingerprint") != fingerprint:
        raise ConfigError(
            f"partition file {path} was made for different {dataset!r} data (fingerprint "
            f"{str(doc.get('fingerprint'))[:12]}… ≠ {fingerprint[:12]}…): the data files, --data-dir "
            f"or the seed of generated data differ; {_redo(path, dataset)}."
        )
    return _parse_clients(path, doc), _parse_spec(path, doc)


def check_partition_file(path: Path, *, dataset: str | None) -> None:
    """Every check of `load_partition` that needs no data (all but the fingerprint); ConfigError."""
    doc = _read_partition(Path(path), dataset=dataset)
    _parse_clients(path, doc)
    _parse_spec(path, doc)


def _redo(path: Path, dataset: str | None) -> str:
    return f"regenerate it with `fedcli partition --dataset {dataset or 'NAME'} ... --out {path}`"


def _read_partition(path: Path, *, dataset: str | None) -> dict[str, Any]:
    """The checked JSON document of a partition file (format, version, content hash, dataset name)."""
    redo = _redo(path, dataset)
    if path.is_dir():
        raise ConfigError(
            f"partition.file must be a partition file; got the directory {str(path)!r}. "
            "Pass the .json file `fedcli partition --out` wrote."
        )
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read partition file {path}: {exc.strerror or exc}.") from None
    except (ValueError, UnicodeDecodeError):
        raise ConfigError(
            f"partition file {path} is not valid JSON (truncated or not a partition file); {redo}."
        ) from None
    except RecursionError:  # [[[[...]]]] thousands deep: json's parser recurses per level
        raise ConfigError(
            f"partition file {path} is nested too deeply to be a partition file (clients are "
            f"lists of example indices); {redo}."
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a fedcli partition file; write one with `fedcli partition`.")
    version = doc.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ConfigError(
            f"partition file {path} has format version {version!r}; this fedcli reads versions "
            f"<= {FORMAT_VERSION}. Upgrade fedcli or {redo}."
        )
    claimed = doc.pop("content_sha256", None)
    try:
        actual = hashlib.sha256(_canonical(doc).encode()).hexdigest()
    except (RecursionError, ValueError):  # nested deeper than json.dumps writes, or a non-finite number
        actual = None
    if claimed != actual:
        raise ConfigError(
            f"partition file {path} fails its content hash: it was edited or corrupted; {redo}."
        )
    if dataset is not None and doc.get("dataset") != dataset:
        raise ConfigError(
            f"partition file {path} was made for dataset {doc.get('dataset')!r}, not {dataset!r}; "
            f"use --task {doc.get('dataset')} or {redo}."
        )
    return doc


def _parse_clients(path: Path, doc: dict[str, Any]) -> list[np.ndarray]:
    """Client k -> int64 indices; each index must be a JSON integer in 0..num_examples-1 (12.5, "3",
    true or 1e30 are refused, never truncated or cast)."""
    n = doc.get("num_examples")
    redo = _redo(path, doc.get("dataset"))
    raw = doc.get("clients")
    if not isinstance(raw, list) or not raw or not all(isinstance(c, list) for c in raw):
        raise ConfigError(
            f"partition file {path} must hold a non-empty list of clients, each a list of example "
            f"indices; {redo}."
        )
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ConfigError(f"partition file {path} has num_examples {n!r}, not a count of examples; {redo}.")
    for k, client in enumerate(raw):
        bad = next((i for i in client if type(i) is not int or not 0 <= i < n), _NONE)
        if bad is not _NONE:
            what = f"outside 0..{n - 1}" if type(bad) is int else "not an integer"
            raise ConfigError(
                f"partition file {path} has example index {_short(bad)} in client {k} ({what}); "
                f"indices must be integers in 0..{n - 1}; {redo}."
            )
    clients = [np.asarray(c, dtype=np.int64) for c in raw]
    flat = np.concatenate(clients)
    if len(np.unique(flat)) != len(flat):
        raise ConfigError(
            f"partition file {path} assigns some example to two clients; {_redo(path, doc.get('dataset'))}."
        )
    return clients


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _parse_spec(path: Path, doc: dict[str, Any]) -> PartitionSpec:
    raw = doc.get("spec")
    known = {f.name for f in fields(PartitionSpec)}
    if not isinstance(raw, dict) or not set(raw) <= known:
        raise ConfigError(f"partition file {path} has a malformed 'spec' section.")
    return PartitionSpec(**raw)
