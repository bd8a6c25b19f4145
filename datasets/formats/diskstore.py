"""The disk store: a task's examples as memory-mapped arrays, built once per source and reused.

A store is one folder under the cache root (``$FEDCLI_DATA_CACHE``, default
``~/.cache/fedcli/datastore``) named by a key: a sha256 over the source's fingerprint
(`file_fingerprint`: size, mtime and a hash of the first and last MiB of each source file; or
the content fingerprint of data already in memory), the loader's options and
`STORE_VERSION`, the preprocessing version. A source file that changes gets a new key, so the
old store is never reused. Inside the folder:

    meta.json                      names, dtypes and shapes of the arrays, client names, fingerprint
    x.bin, y.bin                   training examples, C-order rows in their stored dtype
    test_x.bin, test_y.bin         test examples
    clients.bin, client_offsets.bin          client k's example indices are clients[off[k]:off[k+1]]
    test_clients.bin, test_client_offsets.bin   the same for the test split (when the task has one)

Each ``*.bin`` is opened with `numpy.memmap` (copy-on-write, never written back), so only
the pages a cohort reads are resident. A build writes into a temporary sibling folder, fsyncs
every file, writes meta.json last and renames the folder into place under a file lock
(`filelock`): two processes building the same store build it once (the second waits, then
reuses it), a killed build leaves only a temporary folder that no reader opens (the next build
of that key removes it), and a full disk is one `DataError` naming the folder.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, overload

import numpy as np
import torch

from fedcli.errors import DataError

STORE_VERSION = 1  # bump when what a loader writes into a store changes (preprocessing, layout)
HEAD_TAIL = 1 << 20  # bytes of a source file's head and tail that its fingerprint hashes
FULL_HASH_BELOW = 16 << 20  # smaller files are hashed whole
META = "meta.json"
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def cache_root() -> Path:
    """The folder stores are built in: $FEDCLI_DATA_CACHE, default ~/.cache/fedcli/datastore."""
    env = os.environ.get("FEDCLI_DATA_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedcli" / "datastore"


def file_fingerprint(paths: Sequence[Path]) -> str:
    """sha256 over each file's name, size, mtime and content (whole below 16 MiB, else its first
    and last MiB): a file that changes after its store was built gets a different store."""
    digest = hashlib.sha256()
    for path in paths:
        stat = path.stat()
        digest.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        with path.open("rb") as fh:
            if stat.st_size <= FULL_HASH_BELOW:
                digest.update(fh.read())
            else:
                digest.update(fh.read(HEAD_TAIL))
                fh.seek(-HEAD_TAIL, os.SEEK_END)
                digest.update(fh.read(HEAD_TAIL))
    return digest.hexdigest()


def wants_disk(options: Any, paths: Sequence[Path]) -> bool:
    """A streaming loader's choice: --data-store disk, or auto with source files above AUTO_DISK_BYTES."""
    from fedcli.datasets.federated import AUTO_DISK_BYTES

    return options.data_store == "disk" or (
        options.data_store == "auto" and sum(p.stat().st_size for p in paths) > AUTO_DISK_BYTES
    )


def store_key(*parts: Any) -> str:
    """The folder name of a store: sha256 of the parts and STORE_VERSION (first 32 hex digits)."""
    text = json.dumps([STORE_VERSION, *[str(p) for p in parts]])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# ----------------------------------------------------------------------------- writing


class StoreWriter:
    """Appends rows to the arrays of a store being built (in its temporary folder)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files: dict[str, Any] = {}
        self.shapes: dict[str, tuple[str, list[int], int]] = {}  # name -> (dtype, row shape, rows)
        self.ragged: dict[str, list[tuple[int, int, str]]] = {}  # name -> (width, rows, dtype) per append

    def append(self, name: str, rows: np.ndarray) -> None:
        """Append rows (same dtype and row shape as earlier rows of `name`)."""
        rows = np.ascontiguousarray(rows)
        if name not in self.files:
            self.files[name] = (self.folder / f"{name}.bin").open("wb")
            self.shapes[name] = (rows.dtype.str, list(rows.shape[1:]), 0)
        dtype, shape, count = self.shapes[name]
        if rows.dtype.str != dtype or list(rows.shape[1:]) != shape:
            raise ValueError(f"store array {name}: rows {rows.dtype}{rows.shape[1:]} after {dtype}{shape}")
        if rows.size:
            self.files[name].write(rows.data)  # C-contiguous: its bytes in row order
        self.shapes[name] = (dtype, shape, count + len(rows))

    def declare(self, name: str, dtype: np.dtype[Any] | type, row_shape: tuple[int, ...]) -> None:
        """Create `name` with no rows yet (an array that may stay empty)."""
        if name not in self.files:
            self.append(name, np.zeros((0, *row_shape), dtype=dtype))

    def append_ragged(self, name: str, rows: np.ndarray) -> None:
        """Append rows [n, w] whose width w varies between calls; `pad_ragged` pads them to the widest."""
        rows = np.ascontiguousarray(rows)
        part = f"{name}.ragged"
        self.append(part, rows.reshape(-1))
        self.ragged.setdefault(name, []).append(
            (rows.shape[1] if rows.ndim == 2 else 0, len(rows), rows.dtype.str)
        )

    def pad_ragged(self, name: str, fill: int = -1, block: int = 1 << 16) -> None:
        """Rewrite `name`'s ragged parts as one [N, widest] array padded with `fill`, block by block."""
        parts = self.ragged.pop(name, [])
        width = max([w for w, _, _ in parts], default=1) or 1
        dtype = np.dtype(parts[0][2]) if parts else np.dtype(np.int16)
        self.declare(name, dtype, (width,))
        if not parts:
            return
        self.flush()
        flat = np.memmap(self.folder / f"{name}.ragged.bin", dtype=dtype, mode="r")
        at = 0
        for w, n, _ in parts:
            for start in range(0, n, block):
                rows = min(block, n - start)
                out = np.full((rows, width), fill, dtype=dtype)
                out[:, :w] = flat[at + start * w : at + (start + rows) * w].reshape(rows, w)
                self.append(name, out)
            at += n * w
        del flat
        self.files.pop(f"{name}.ragged").close()
        del self.shapes[f"{name}.ragged"]
        (self.folder / f"{name}.ragged.bin").unlink()

    def drop(self, name: str) -> None:
        """Remove array `name` (a scratch array of the build) from the store being built."""
        self.files.pop(name).close()
        del self.shapes[name]
        (self.folder / f"{name}.bin").unlink()

    def flush(self) -> None:
        for fh in self.files.values():
            fh.flush()

    def specs(self) -> dict[str, Any]:
        """The arrays written so far (flushed): name -> dtype and shape, as meta.json holds them."""
        self.flush()
        return {name: {"dtype": d, "shape": [n, *s]} for name, (d, s, n) in self.shapes.items()}

    def close(self) -> dict[str, Any]:
        """Flush and fsync every array; return their dtypes and shapes for meta.json."""
        specs = self.specs()
        for fh in self.files.values():
            os.fsync(fh.fileno())
            fh.close()
        return specs

    def abort(self) -> None:
        for fh in self.files.values():
            with contextlib.suppress(OSError):
                fh.close()


def build_store(
    key: str, what: str, fill: Callable[[StoreWriter], dict[str, Any]], root: Path | None = None
) -> Path:
    """The folder of store `key`, built by `fill` (which appends the arrays and returns meta) if absent.

    Atomic and locked: see the module docstring. `what` names the data in messages.
    """
    from filelock import FileLock

    root = cache_root() if root is None else root
    folder = root / key
    if (folder / META).exists():
        return folder
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(root / f".{key}.lock"))
        lock.acquire()
    except OSError as exc:
        raise _disk_error(exc, root, what) from None
    try:
        if (folder / META).exists():  # another process built it while this one waited
            return folder
        for stale in root.glob(f".{key}.tmp-*"):  # a killed build's leftovers (the lock says none is running)
            shutil.rmtree(stale, ignore_errors=True)
        if folder.exists():  # no meta.json: not a store (never renamed into place by a build)
            shutil.rmtree(folder, ignore_errors=True)
        tmp = root / f".{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        writer = StoreWriter(tmp)
        try:
            tmp.mkdir()
            meta = fill(writer)
            meta = {
                **meta,
                "arrays": writer.close(),
                "version": STORE_VERSION,
                "key": key,
                "built_by": os.getpid(),
            }
            with (tmp / META).open("w", encoding="utf-8") as fh:
                json.dump(meta, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.rename(tmp, folder)
            _fsync_dir(root)
        except BaseException as exc:
            writer.abort()
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, OSError):
                raise _disk_error(exc, root, what) from None
            raise
    finally:
        lock.release()
    return folder


def _disk_error(exc: OSError, root: Path, what: str) -> DataError:
    if exc.errno in NO_SPACE:
        return DataError(
            f"no space left in {root} while building the disk store of {what}; free space there "
            "or point FEDCLI_DATA_CACHE at a folder with room (or use --data-store memory)."
        )
    return DataError(
        f"cannot write the disk store of {what} in {root}: {exc.strerror or exc}; "
        "point FEDCLI_DATA_CACHE at a writable folder (or use --data-store memory)."
    )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_clients(writer: StoreWriter, prefix: str, indices: Sequence[np.ndarray]) -> None:
    """Write client -> example indices as one flat array plus offsets ([C + 1] int64)."""
    writer.declare(f"{prefix}clients", np.int64, ())
    for ix in indices:
        writer.append(f"{prefix}clients", np.asarray(ix, dtype=np.int64))
    sizes = np.array([len(ix) for ix in indices], dtype=np.int64)
    writer.append(f"{prefix}client_offsets", np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))


def write_consecutive(writer: StoreWriter, prefix: str, sizes: Sequence[int]) -> None:
    """Client k owns the k-th run of consecutive rows (sizes[k] of them): the flat index is 0..N-1."""
    offsets = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))]).astype(np.int64)
    writer.declare(f"{prefix}clients", np.int64, ())
    for start in range(0, int(offsets[-1]), 1 << 22):
        writer.append(
            f"{prefix}clients", np.arange(start, min(start + (1 << 22), int(offsets[-1])), dtype=np.int64)
        )
    writer.append(f"{prefix}client_offsets", offsets)


def stream_fingerprint(
    folder: Path,
    arrays: dict[str, Any],
    names: tuple[str, ...] = ("x", "y"),
    chunk_bytes: int = 64 << 20,
    as_dtype: dict[str, Any] | None = None,
) -> str:
    """`datasets.tasks.fingerprint` of the stored arrays, read in chunks (never whole in memory);
    `as_dtype`: name -> the dtype the in-memory loader holds it in (e.g. int64 token ids stored as int16)."""
    digest, dtypes = hashlib.sha256(), as_dtype or {}
    for name in names:
        array = open_array(folder, name, arrays[name])
        digest.update(str(tuple(array.shape)).encode())
        rows = max(1, chunk_bytes // max(1, array[:1].nbytes * 8))
        for start in range(0, len(array), rows):
            block = np.ascontiguousarray(array[start : start + rows])
            digest.update((block.astype(dtypes[name]) if name in dtypes else block).tobytes())
    return digest.hexdigest()


@contextlib.contextmanager
def progress(total: int, what: str) -> Iterator[Callable[[int], None]]:
    """A rich progress bar with an ETA on stderr (nothing when stderr is not a terminal); yields advance(n)."""
    import sys

    if not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("clients"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)


# ----------------------------------------------------------------------------- reading


def open_array(folder: Path, name: str, spec: dict[str, Any]) -> np.ndarray:
    """One array of a store (or of one being built) as a copy-on-write memory map (never written back)."""
    shape = tuple(spec["shape"])
    if shape[0] == 0:
        return np.zeros(shape, dtype=np.dtype(spec["dtype"]))
    return np.memmap(folder / f"{name}.bin", dtype=np.dtype(spec["dtype"]), mode="c", shape=shape)


class ClientIndex(Sequence[np.ndarray]):
    """client k -> its example indices, read from a store's flat index on demand (no per-client arrays);
    iteration and truth value come from `Sequence` (`__getitem__` and `__len__`)."""

    def __init__(self, flat: np.ndarray, offsets: np.ndarray) -> None:
        self.flat, self.offsets = flat, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, k: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, k: slice) -> ClientIndex: ...

    def __getitem__(self, k: int | slice) -> np.ndarray | ClientIndex:
        if isinstance(k, slice):
            start, stop, step = k.indices(len(self))
            if step != 1:
                raise IndexError("ClientIndex slices take consecutive clients")
            return ClientIndex(self.flat, self.offsets[start : max(start, stop) + 1])
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(k)
        return np.asarray(self.flat[self.offsets[k] : self.offsets[k + 1]], dtype=np.int64)

    def sizes(self) -> np.ndarray:
        """Every client's example count, from the offsets alone (federated.DiskData reads it)."""
        return np.diff(self.offsets).astype(np.int64)


@dataclass(frozen=True)
class Opened:
    """An opened store: its folder, meta and arrays (numpy memmaps)."""

    folder: Path
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]


def open_store(folder: Path) -> Opened:
    """Open a built store's arrays as memory maps; DataError if it is not a complete store."""
    try:
        meta = json.loads((folder / META).read_text(encoding="utf-8"))
        arrays = {name: open_array(folder, name, spec) for name, spec in meta["arrays"].items()}
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(
            f"the disk store {folder} is unreadable ({exc}); delete that folder to rebuild it."
        ) from None
    return Opened(folder, meta, arrays)


def task_data_of(opened: Opened) -> Any:
    """A TaskData whose tensors share the store's memory maps (nothing read until indexed)."""
    from fedcli.datasets.tasks import TaskData

    a, meta = opened.arrays, opened.meta
    test_clients = (
        ClientIndex(a["test_clients"], np.asarray(a["test_client_offsets"]))
        if "test_client_offsets" in a
        else None
    )
    return TaskData(
        x=torch.from_numpy(a["x"]),
        y=torch.from_numpy(a["y"]),
        client_indices=ClientIndex(a["clients"], np.asarray(a["client_offsets"])),
        client_names=list(meta.get("client_names", [])),
        test_x=torch.from_numpy(a["test_x"]),
        test_y=torch.from_numpy(a["test_y"]),
        fingerprint=meta["fingerprint"],
        num_classes=meta.get("num_classes"),
        test_client_indices=test_clients,
        store=str(opened.folder),
    )


def store_task_data(data: Any, what: str, root: Path | None = None) -> Any:
    """Write an in-memory TaskData into a disk store (once per content) and return it reopened from there."""
    if getattr(data, "store", None):
        return data
    if data.optimum is not None:
        raise DataError(f"{what} knows its exact optimum and is small by nature; use --data-store memory.")
    key = store_key(
        "taskdata",
        data.fingerprint,
        tuple(data.test_x.shape),
        tuple(data.test_y.shape),
        str(data.test_x.dtype),
        len(data.client_indices),
        data.test_client_indices is not None,
    )

    def fill(writer: StoreWriter) -> dict[str, Any]:
        for name in ("x", "y", "test_x", "test_y"):
            writer.append(name, getattr(data, name).contiguous().cpu().numpy())
        write_clients(writer, "", data.client_indices)
        if data.test_client_indices is not None:
            write_clients(writer, "test_", data.test_client_indices)
        return {
            "client_names": list(data.client_names),
            "fingerprint": data.fingerprint,
            "num_classes": data.num_classes,
            "source": what,
        }

    opened = open_store(build_store(key, what, fill, root))
    return replace(task_data_of(opened), client_names=list(data.client_names))
