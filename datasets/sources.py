"""Shared plumbing of the data loaders: where data lives, checksums, explicit downloads.

Data that does not ship with fedcli is read from `TaskOptions.data_dir`, or else from the
default cache folder `~/.cache/fedcli/<name>`. Nothing is ever downloaded unless the user
asks (`TaskOptions.download=True`); a missing file is a DataError that names the folder,
the files expected there and how to get them.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tarfile
import urllib.request
from pathlib import Path

import numpy as np

from fedcli.datasets.tasks import TaskOptions
from fedcli.errors import DataError

log = logging.getLogger(__name__)


def data_dir(options: TaskOptions, name: str) -> Path:
    """Return options.data_dir, or the default cache folder of `name`: ~/.cache/fedcli/<name>."""
    return (
        Path(options.data_dir)
        if options.data_dir is not None
        else Path("~/.cache/fedcli").expanduser() / name
    )


def missing_data(name: str, folder: Path, expected: str, how: str) -> DataError:
    """Build the DataError for data that is not where the loader looks."""
    return DataError(f"{name} data not found in {folder} (expected {expected}); {how}")


def first_existing(folder: Path, *names: str) -> Path | None:
    """Return the first of folder/name (also tried with .gz appended) that exists."""
    candidates = (path for name in names for path in (folder / name, folder / f"{name}.gz"))
    return next((path for path in candidates if path.exists()), None)


def download(url: str, dest: Path, *, md5: str | None = None) -> Path:
    """Fetch url to dest atomically (temp + rename); DataError on a network or checksum failure."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    log.info("downloading %s -> %s", url, dest)
    try:
        with urllib.request.urlopen(url, timeout=60) as response, tmp.open("wb") as fh:  # noqa: S310
            shutil.copyfileobj(response, fh)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise DataError(
            f"cannot download {url}: {exc}; check the network or fetch the file by hand into {dest.parent}."
        ) from None
    if md5 is not None and hashlib.md5(tmp.read_bytes()).hexdigest() != md5:  # noqa: S324 - publisher's checksum
        tmp.unlink(missing_ok=True)
        raise DataError(f"download of {url} has the wrong MD5 (expected {md5}); try again.")
    tmp.replace(dest)
    return dest


def extract_tar(archive: Path, folder: Path) -> None:
    """Unpack a .tar(.gz|.bz2) archive into folder, refusing members that escape it."""
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(folder, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise DataError(f"cannot unpack {archive}: {exc}; delete it and download again.") from None


def align_clients(
    names: list[str], test_names: list[str], test_indices: list[np.ndarray]
) -> list[np.ndarray]:
    """Per training client (in `names` order), its test example indices; empty if it has none."""
    by_name = dict(zip(test_names, test_indices, strict=True))
    return [np.asarray(by_name.get(n, np.zeros(0, dtype=np.int64)), dtype=np.int64) for n in names]


def holdout(n: int, num_test: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) indices of n examples: the test ones are the last num_test of the fixed
    permutation `np.random.default_rng(0).permutation(n)`, the same split on every run."""
    order = np.random.default_rng(0).permutation(n)
    return np.sort(order[: n - num_test]), np.sort(order[n - num_test :])


def consecutive(sizes: list[int] | np.ndarray) -> list[np.ndarray]:
    """Client k -> the k-th run of consecutive indices, for clients stored one after another."""
    sizes = np.asarray(sizes, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return [np.arange(s, s + n) for s, n in zip(starts, sizes, strict=True)]
