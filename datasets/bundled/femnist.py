"""FEMNIST (LEAF): handwritten digits and letters, one natural client per writer.

The bundled sample (datasets/data/femnist, see its README for source, licence and
checksums) has 105 writers with 14,708 training and 1,685 test images, 62 classes
(0-9, A-Z, a-z). The full LEAF FEMNIST (3,597 writers) loads the same way from LEAF's
``data/femnist/data/{train,test}`` folders (--data-dir).

Images are stored as uint8 with ink = 255 and background = 0 (LEAF stores 1.0 = white
background; we invert, as MNIST and the TFF EMNIST pipeline of Reddi et al. do).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch
from torch import Tensor

from fedcli.datasets import models
from fedcli.datasets.formats import diskstore
from fedcli.datasets.formats.leaf import read_leaf_dir, stream_leaf_store
from fedcli.datasets.tasks import Task, TaskData, TaskOptions, fingerprint
from fedcli.errors import DataError

log = logging.getLogger(__name__)

BUNDLED_DIR = Path(__file__).parents[1] / "data" / "femnist"


@dataclass(frozen=True)
class FemnistArrays:
    """Decoded FEMNIST: images uint8 [N, 28, 28], labels int64 [N], writer per example."""

    train_x: np.ndarray
    train_y: np.ndarray
    train_writer: np.ndarray  # [N] int, index into writers
    test_x: np.ndarray
    test_y: np.ndarray
    test_writer: np.ndarray
    writers: list[str]  # sorted writer ids; client k = writers[k]


def verify_checksums(directory: Path) -> None:
    """Check every file listed in directory/SHA256SUMS; DataError on a mismatch."""
    sums = directory / "SHA256SUMS"
    if not sums.exists():
        return
    for line in sums.read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        path = directory / name.strip()
        if not path.exists():
            raise DataError(f"bundled data file {path} is missing; reinstall fedcli.")
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise DataError(
                f"bundled data file {path} fails its SHA-256 check; it is corrupted. "
                "Reinstall fedcli or restore the file from git."
            )


CACHE_DIR = Path("~/.cache/fedcli/femnist").expanduser()


def load_femnist(directory: Path = BUNDLED_DIR, cache_dir: Path | None = CACHE_DIR) -> FemnistArrays:
    """Load LEAF FEMNIST from directory/{train,test}; writers sorted by id.

    Decoding the JSON takes seconds, so the decoded arrays are cached as an .npz keyed by the
    sha256 of the folder's file names, sizes and modification times (bundled data: of its
    SHA256SUMS); a corrupt or stale cache entry is ignored and rewritten.
    """
    if not directory.exists():
        raise DataError(
            f"FEMNIST folder {directory} does not exist; pass --data-dir with LEAF's "
            "data/femnist/data folder (it holds train/ and test/)."
        )
    verify_checksums(directory)
    cache = None if cache_dir is None else cache_dir / f"{_folder_digest(directory)}.npz"
    if cache is not None and cache.exists():
        try:
            with np.load(cache, allow_pickle=False) as npz:
                return FemnistArrays(
                    npz["train_x"],
                    npz["train_y"],
                    npz["train_writer"],
                    npz["test_x"],
                    npz["test_y"],
                    npz["test_writer"],
                    [str(w) for w in npz["writers"]],
                )
        except (OSError, ValueError, KeyError):
            log.warning("ignoring unreadable FEMNIST cache %s", cache)
    arrays = _decode(directory)
    if cache is not None:
        _write_cache(cache, arrays)
    return arrays


def _folder_digest(directory: Path) -> str:
    sums = directory / "SHA256SUMS"
    digest = hashlib.sha256()
    if sums.exists():
        digest.update(sums.read_bytes())
    else:
        for path in sorted(directory.rglob("*.json*")):
            stat = path.stat()
            digest.update(f"{path.relative_to(directory)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:24]


def _write_cache(cache: Path, arrays: FemnistArrays) -> None:
    """Write the cache atomically; a read-only home only costs speed."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(
            tmp,
            train_x=arrays.train_x,
            train_y=arrays.train_y,
            train_writer=arrays.train_writer,
            test_x=arrays.test_x,
            test_y=arrays.test_y,
            test_writer=arrays.test_writer,
            writers=np.array(arrays.writers),
        )
        os.replace(tmp, cache)
    except OSError as exc:
        log.warning("could not cache decoded FEMNIST at %s: %s", cache, exc)


def _decode(directory: Path) -> FemnistArrays:
    train = read_leaf_dir(directory / "train")
    test = read_leaf_dir(directory / "test")
    writers = sorted(train)
    train_x, train_y, train_w = _stack(train, writers)
    test_writers = [w for w in writers if w in test]
    test_x, test_y, test_w_local = _stack(test, test_writers)
    index = {w: i for i, w in enumerate(writers)}
    test_w = np.array([index[test_writers[i]] for i in test_w_local], dtype=np.int64)
    return FemnistArrays(train_x, train_y, train_w, test_x, test_y, test_w, writers)


def _stack(
    split: dict[str, dict[str, list[object]]], writers: list[str]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    xs, ys, ws = [], [], []
    for k, writer in enumerate(writers):
        rows = _user_rows(split[writer], writer)
        xs.append(rows["x"])
        ys.append(rows["y"])
        ws.append(np.full(len(rows["y"]), k, dtype=np.int64))
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(ws)


def _user_rows(record: dict[str, list[object]], where: str) -> dict[str, np.ndarray]:
    """One writer's LEAF record: images uint8 with ink = 255, labels int64 (`_stack`, and the disk store:
    datasets/formats/leaf.py stream_leaf_store)."""
    x = np.asarray(record["x"], dtype=np.float32).reshape(-1, 28, 28)
    return {
        "x": np.rint((1.0 - x) * 255.0).clip(0, 255).astype(np.uint8),
        "y": np.asarray(record["y"], dtype=np.int64),
    }


def _load_femnist(options: TaskOptions) -> TaskData:
    directory = Path(options.data_dir or BUNDLED_DIR)
    if directory.exists() and diskstore.wants_disk(options, sorted(directory.rglob("*.json*"))):
        verify_checksums(directory)  # a full LEAF FEMNIST: one JSON file in memory at a time
        return stream_leaf_store("femnist", directory, _user_rows, num_classes=None)
    arrays = load_femnist(options.data_dir or BUNDLED_DIR)
    x, y = torch.from_numpy(arrays.train_x), torch.from_numpy(arrays.train_y)
    return TaskData(
        x=x,
        y=y,
        client_indices=[np.flatnonzero(arrays.train_writer == k) for k in range(len(arrays.writers))],
        client_names=arrays.writers,
        test_x=torch.from_numpy(arrays.test_x),
        test_y=torch.from_numpy(arrays.test_y),
        fingerprint=fingerprint(x, y),
        test_client_indices=[np.flatnonzero(arrays.test_writer == k) for k in range(len(arrays.writers))],
    )


def grey_images(x: Tensor) -> Tensor:
    """uint8 [..., 28, 28] -> float32 [..., 1, 28, 28] in [0, 1] (every grey-image task's `prepare`)."""
    return (x.to(torch.float32) / 255.0).unsqueeze(-3)


FEMNIST = Task(
    name="femnist",
    description="LEAF FEMNIST, 62 classes, natural partition by writer (bundled: 105 writers)",
    source="bundled LEAF sample (datasets/data/femnist); full LEAF via --data-dir",
    offline=True,
    kind="classification",
    models=MappingProxyType(
        {
            "mlp": lambda: models.MLP(784, (200, 200), 62),
            "cnn": lambda: models.ReddiCNN(62),
        }
    ),
    default_model="mlp",
    load=_load_femnist,
    prepare=grey_images,
    # 0.1: the top of FedPA's client-lr grid for EMNIST (Al-Shedivat et al. Table 5). The old default 0.01
    # (Table 6, with momentum 0.9) learnt nothing as plain SGD on the default run (docs/architecture.md §5).
    client_lr=0.1,
)

TASKS = (FEMNIST,)
