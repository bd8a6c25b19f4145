"""TensorFlow Federated h5 files: read them, fetch them, stream them into a disk store.

The files `tff.simulation.datasets.*.load_data` downloads from
https://storage.googleapis.com/tff-datasets-public/ hold one HDF5 group per client,
`/examples/<client_id>/<field>`: EMNIST `pixels` float32 [n, 28, 28] (1.0 = white
background, as LEAF) and `label`; CIFAR-100 `image` uint8 [n, 32, 32, 3], `label` (fine) and
`coarse_label`; StackOverflow `tokens`, `title`, `tags` (UTF-8 byte strings; tags joined by
'|'), plus `stackoverflow.word_count` (lines "word<TAB>count", most frequent first) and
`stackoverflow.tag_count` (a JSON object tag -> count, most frequent first).

Clients are read in sorted-id order; `TaskOptions.max_clients` keeps the first N. With
`--data-store disk` (or `auto` when the h5 files exceed 1 GiB) the loaders do not build the
federation in memory: they stream the h5 files client by client (h5py), preprocess a batch of
clients at a time and write a disk store (datasets/scale/diskstore.py) once per source
fingerprint; later runs open it in a second. The tasks over these files:
datasets/scale/tff_images.py (EMNIST, CIFAR-100) and datasets/scale/stackoverflow.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedcli.datasets.formats.diskstore import wants_disk
from fedcli.datasets.sources import align_clients, consecutive, download, extract_tar
from fedcli.datasets.tasks import TaskData, TaskOptions, fingerprint
from fedcli.errors import DataError

TFF_URL = "https://storage.googleapis.com/tff-datasets-public/"


def read_tff_h5(
    path: Path, fields: tuple[str, ...], *, max_clients: int | None = None, keep: set[str] | None = None
) -> tuple[list[str], list[dict[str, np.ndarray]]]:
    """Read /examples/<client>/<field> for clients in sorted id order (the first max_clients,
    or those in `keep`); DataError if malformed."""
    with open_tff(path) as h5:
        ids = tff_ids(h5, max_clients=max_clients, keep=keep)
        return ids, [read_client(h5, path, cid, fields) for cid in ids]


@contextlib.contextmanager
def open_tff(path: Path) -> Iterator[Any]:
    """An open TFF h5 file with an /examples group; DataError naming the file if it is not one."""
    import h5py

    if not path.exists():
        raise DataError(f"TFF file {path} does not exist.")
    try:
        h5 = h5py.File(path, "r")
    except OSError as exc:
        raise DataError(
            f"TFF file {path} cannot be read as HDF5 ({_one_line(exc)}); it is truncated or corrupted "
            "before its first client: download it again."
        ) from None
    with h5:
        if "examples" not in h5:
            raise DataError(f"{path} has no /examples group; is it a TFF federated h5 file?")
        yield h5


def tff_ids(h5: Any, *, max_clients: int | None = None, keep: set[str] | None = None) -> list[str]:
    """Client ids in sorted order: the first max_clients, or those in `keep`."""
    return [c for c in sorted(h5["examples"].keys()) if keep is None or c in keep][:max_clients]


def read_client(h5: Any, path: Path, cid: str, fields: tuple[str, ...]) -> dict[str, np.ndarray]:
    """One client's fields; DataError naming the file and the client where reading stopped."""
    try:
        group = h5["examples"][cid]
        missing = [f for f in fields if f not in group]
        if missing:
            raise DataError(f"{path}: client {cid!r} lacks field(s) {', '.join(missing)}.")
        return {f: group[f][()] for f in fields}
    except (OSError, KeyError, RuntimeError) as exc:
        raise DataError(
            f"TFF file {path} is truncated or corrupted: reading stopped at client {cid!r} "
            f"({_one_line(exc)}); download it again."
        ) from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


# ----------------------------------------------------------------------------- the disk store


CLIENT_BATCH = 1024  # clients read and preprocessed together when streaming into a disk store


Encode = Callable[[list[dict[str, np.ndarray]]], dict[str, np.ndarray]]


def load_tff(
    what: str,
    train: Path,
    test: Path,
    fields: tuple[str, ...],
    encode: Encode,
    extra: tuple[Path, ...],
    options: TaskOptions,
    num_classes: int,
    ragged: tuple[str, ...] = (),
    dtypes: dict[str, Any] | None = None,
) -> TaskData:
    """A TFF train/test pair as TaskData: the train clients in sorted-id order (the first max_clients)
    and the test records of the same clients, each batch of clients' records turned into arrays of
    rows by `encode`. Streamed into a disk store (`stream_to_store`) with --data-store disk (auto:
    source files above AUTO_DISK_BYTES), else held in memory as `dtypes` (name -> the dtype an
    array is held in; None: as encoded)."""
    if wants_disk(options, [train, test]):
        return stream_to_store(what, train, test, fields, encode, extra, options, num_classes, ragged, dtypes)
    ids, train_records = read_tff_h5(train, fields, max_clients=options.max_clients)
    test_ids, test_records = read_tff_h5(test, fields, keep=set(ids))

    def tensors(records: list[dict[str, np.ndarray]]) -> tuple[Tensor, Tensor, list[np.ndarray]]:
        rows = encode(records)
        x, y = (
            torch.from_numpy(np.ascontiguousarray(rows[k], dtype=(dtypes or {}).get(k))) for k in ("x", "y")
        )
        return x, y, stack_field(records, fields[0])[1]

    x, y, natural = tensors(train_records)
    test_x, test_y, test_natural = tensors(test_records)
    return TaskData(
        x=x,
        y=y,
        client_indices=natural,
        client_names=ids,
        test_x=test_x,
        test_y=test_y,
        fingerprint=fingerprint(x, y),
        num_classes=num_classes,
        test_client_indices=align_clients(ids, test_ids, test_natural),
    )


def stream_to_store(
    what: str,
    train: Path,
    test: Path,
    fields: tuple[str, ...],
    encode: Encode,
    extra: tuple[Path, ...],
    options: TaskOptions,
    num_classes: int,
    ragged: tuple[str, ...] = (),
    fingerprint_as: dict[str, Any] | None = None,
) -> TaskData:
    """Stream a TFF train/test pair into a disk store (built once per fingerprint) and open it.

    `encode(records)` turns a batch of clients' records into arrays of rows ({"x": .., "y": ..});
    `ragged` names arrays whose rows have different widths per batch: they are padded with -1 to
    the widest row of the split (as the in-memory loader does). `fingerprint_as`: the dtype the
    in-memory loader holds the arrays in, so that the recorded fingerprint is the same.
    """
    from fedcli.datasets.formats import diskstore

    key = diskstore.store_key(what, diskstore.file_fingerprint([train, test, *extra]), options.max_clients)

    def fill(writer: diskstore.StoreWriter) -> dict[str, Any]:
        with open_tff(train) as h5:
            ids = tff_ids(h5, max_clients=options.max_clients)
            train_sizes = _stream_split(h5, train, ids, fields, encode, writer, "", ragged, what)
        with open_tff(test) as h5:
            present = set(tff_ids(h5, keep=set(ids)))
            test_ids = [c for c in ids if c in present]
            test_sizes = dict(
                zip(
                    test_ids,
                    _stream_split(h5, test, test_ids, fields, encode, writer, "test_", ragged, what),
                    strict=True,
                )
            )
        diskstore.write_consecutive(writer, "", train_sizes)
        diskstore.write_consecutive(writer, "test_", [test_sizes.get(c, 0) for c in ids])
        for name in encode([]):  # a split without examples still has its arrays
            for split in ("", "test_"):
                if name not in ragged:
                    empty = encode([])[name]
                    writer.declare(f"{split}{name}", empty.dtype, empty.shape[1:])
        for name in ragged:
            for split in ("", "test_"):
                writer.pad_ragged(f"{split}{name}")
        return {
            "client_names": ids,
            "num_classes": num_classes,
            "source": what,
            "fingerprint": diskstore.stream_fingerprint(
                writer.folder, writer.specs(), as_dtype=fingerprint_as
            ),
        }

    opened = diskstore.open_store(diskstore.build_store(key, what, fill))
    return diskstore.task_data_of(opened)


def _stream_split(
    h5: Any,
    path: Path,
    ids: list[str],
    fields: tuple[str, ...],
    encode: Encode,
    writer: Any,
    prefix: str,
    ragged: tuple[str, ...],
    what: str,
) -> list[int]:
    """Read, encode and append `ids`' records a batch at a time, with a progress bar; rows per client."""
    from fedcli.datasets.formats.diskstore import progress

    sizes: list[int] = []
    with progress(len(ids), f"{what}: {path.name}") as advance:
        for start in range(0, len(ids), CLIENT_BATCH):
            records = [read_client(h5, path, cid, fields) for cid in ids[start : start + CLIENT_BATCH]]
            rows = encode(records)
            sizes.extend(len(r[fields[0]]) for r in records)
            for name, array in rows.items():
                if name in ragged:
                    writer.append_ragged(f"{prefix}{name}", array)
                else:
                    writer.append(f"{prefix}{name}", array)
            advance(len(records))
    return sizes


def stack_field(records: list[dict[str, np.ndarray]], field: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """Concatenate a field over clients; return it and client -> example indices."""
    parts = [r[field] for r in records]
    return np.concatenate(parts), consecutive([len(p) for p in parts])


def ensure_files(
    options: TaskOptions, folder: Path, files: tuple[str, ...], archives: tuple[str, ...]
) -> bool:
    """True when every file is present (downloading the archives first if asked)."""
    if options.download and not all((folder / f).exists() for f in files):
        for archive in archives:
            extract_tar(download(TFF_URL + archive, folder / archive), folder)
    return all((folder / f).exists() for f in files)
