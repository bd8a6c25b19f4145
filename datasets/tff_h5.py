"""TensorFlow Federated h5 files: federated EMNIST, CIFAR-100 (500 clients), StackOverflow.

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
clients at a time (vectorised with pyarrow for StackOverflow's tokenising) and write a disk
store (datasets/diskstore.py) once per source fingerprint; later runs open it in a second.
Token ids are stored as int16 there (images stay uint8) and widened per batch by the task.
The `emnist` and `cifar100` tasks read the TFF files when they are in --data-dir (natural
writers / 500 LDA clients), else torchvision's files (no natural clients), else (only with
download=True) fetch the TFF archive.

Preprocessing follows Reddi et al. 2021 (ICLR, arXiv:2003.00295) / the google-research
`federated` code: StackOverflow NWP keeps the 10,000 most frequent words, ids pad = 0,
words 1..10000, OOV = 10001, BOS = 10002, EOS = 10003, sequences of 20 tokens
(x = ids[:20], y = ids[1:21] of [BOS, tokens[:20], EOS] padded); StackOverflow LR uses the
10,000-word mean bag of words of "tokens title" and the 500 most frequent tags (multi-hot).
Deviations: Paper: images randomly cropped to 24x24 (CIFAR-100). Here: full 32x32, no
augmentation (prepare is deterministic).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedcli.datasets import models
from fedcli.datasets.metrics import MetricFns, next_token
from fedcli.datasets.mnist import grey_images, image_task_data
from fedcli.datasets.sources import align_clients, data_dir, download, extract_tar, missing_data
from fedcli.datasets.tasks import Task, TaskData, TaskOptions, fingerprint
from fedcli.datasets.torchvision_sources import (
    CIFAR100_DIR,
    cifar_images,
    load_cifar,
    load_emnist_torchvision,
)
from fedcli.errors import DataError

TFF_URL = "https://storage.googleapis.com/tff-datasets-public/"
NWP_VOCAB, NWP_LENGTH = 10000, 20  # Reddi et al. Table 7
PAD, OOV, BOS, EOS = 0, NWP_VOCAB + 1, NWP_VOCAB + 2, NWP_VOCAB + 3
LR_VOCAB, LR_TAGS = 10000, 500


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


def wants_disk(options: TaskOptions, paths: Sequence[Path]) -> bool:
    """--data-store disk, or auto with source files above AUTO_DISK_BYTES (docs/scaling.md)."""
    from fedcli.datasets.diskstore import wants_disk as disk

    return disk(options, paths)


Encode = Callable[[list[dict[str, np.ndarray]]], dict[str, np.ndarray]]


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
    from fedcli.datasets import diskstore

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
                    writer.declare_like(f"{split}{name}", encode([])[name])
        for name in ragged:
            for split in ("", "test_"):
                writer.pad_ragged(f"{split}{name}")
        writer.flush()
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
    from fedcli.datasets.diskstore import progress

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


def _stack(records: list[dict[str, np.ndarray]], field: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """Concatenate a field over clients; return it and client -> example indices."""
    parts = [r[field] for r in records]
    sizes = np.array([len(p) for p in parts])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return np.concatenate(parts), [np.arange(s, s + n) for s, n in zip(starts, sizes, strict=True)]


def _fetch_tff(folder: Path, archive: str) -> None:
    path = download(TFF_URL + archive, folder / archive)
    extract_tar(path, folder)


def _ensure(options: TaskOptions, folder: Path, files: tuple[str, ...], archives: tuple[str, ...]) -> bool:
    """True when every file is present (downloading the archives first if asked)."""
    if all((folder / f).exists() for f in files):
        return True
    if options.download:
        for archive in archives:
            _fetch_tff(folder, archive)
        return all((folder / f).exists() for f in files)
    return False


# ----------------------------------------------------------------------------- EMNIST


def _load_emnist(options: TaskOptions) -> TaskData:
    folder = data_dir(options, "emnist")
    files = ("fed_emnist_train.h5", "fed_emnist_test.h5")
    has_torchvision = any(folder.glob("*/raw/emnist-byclass-train-images-idx3-ubyte*"))
    if not all((folder / f).exists() for f in files) and has_torchvision:
        return load_emnist_torchvision(folder)
    if not _ensure(options, folder, files, ("fed_emnist.tar.bz2",)):
        raise missing_data(
            "EMNIST",
            folder,
            "fed_emnist_train.h5 and fed_emnist_test.h5 (TFF, 3,400 writers) "
            "or torchvision's EMNIST/raw/emnist-byclass-*",
            "pass --data-dir or add --download.",
        )
    if wants_disk(options, [folder / f for f in files]):
        return stream_to_store(
            "emnist",
            folder / files[0],
            folder / files[1],
            ("pixels", "label"),
            _image_rows("pixels", _ink, (28, 28)),
            (),
            options,
            62,
        )
    ids, train, test_ids, test = _read_pair(folder, "fed_emnist", ("pixels", "label"), options.max_clients)
    x, natural = _stack(train, "pixels")
    test_x, test_natural = _stack(test, "pixels")
    data = image_task_data(
        _ink(x),
        _stack(train, "label")[0],
        _ink(test_x),
        _stack(test, "label")[0],
        num_classes=62,
        natural=natural,
        names=ids,
    )
    return dataclasses.replace(data, test_client_indices=align_clients(ids, test_ids, test_natural))


def _image_rows(field: str, convert: Callable[[np.ndarray], np.ndarray], shape: tuple[int, ...]) -> Encode:
    """Encode a batch of image clients as the in-memory loader does: converted images, int64 labels."""

    def encode(records: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        if not records:
            return {"x": convert(np.zeros((0, *shape), np.uint8)), "y": np.zeros(0, np.int64)}
        return {
            "x": convert(np.concatenate([r[field] for r in records])),
            "y": np.concatenate([r["label"] for r in records]).astype(np.int64),
        }

    return encode


def _ink(pixels: np.ndarray) -> np.ndarray:
    """TFF/LEAF pixels (1.0 = white background) -> uint8 with ink = 255, background = 0."""
    return np.rint((1.0 - pixels) * 255.0).clip(0, 255).astype(np.uint8)


def _read_pair(
    folder: Path, stem: str, fields: tuple[str, ...], max_clients: int | None
) -> tuple[list[str], list[dict[str, np.ndarray]], list[str], list[dict[str, np.ndarray]]]:
    """Train clients (first max_clients by id) and the test records of those clients."""
    ids, train = read_tff_h5(folder / f"{stem}_train.h5", fields, max_clients=max_clients)
    test_ids, test = read_tff_h5(folder / f"{stem}_test.h5", fields, keep=set(ids))
    return ids, train, test_ids, test


EMNIST = Task(
    name="emnist",
    description="EMNIST-62: TFF federated EMNIST (3,400 writers) or torchvision EMNIST ByClass",
    source="fed_emnist_*.h5 (TFF) or EMNIST/raw (torchvision) in --data-dir (default ~/.cache/fedcli/emnist)",
    offline=False,
    kind="classification",
    models=MappingProxyType(
        {"cnn": lambda: models.ReddiCNN(62), "mlp": lambda: models.MLP(784, (200, 200), 62)}
    ),
    default_model="cnn",
    load=_load_emnist,
    prepare=grey_images,
    reads_max_clients=True,  # the loader keeps the first --max-clients clients
)


# ----------------------------------------------------------------------------- CIFAR-100


def _load_cifar100(options: TaskOptions) -> TaskData:
    folder = data_dir(options, "cifar100")
    files = ("fed_cifar100_train.h5", "fed_cifar100_test.h5")
    if not all((folder / f).exists() for f in files) and (folder / CIFAR100_DIR).exists():
        return image_task_data(*load_cifar(folder, num_classes=100), num_classes=100)
    if not _ensure(options, folder, files, ("fed_cifar100.tar.bz2",)):
        raise missing_data(
            "CIFAR-100",
            folder,
            "fed_cifar100_train.h5 / fed_cifar100_test.h5 (TFF, 500 clients) "
            f"or torchvision's {CIFAR100_DIR}/",
            "pass --data-dir or add --download.",
        )
    if wants_disk(options, [folder / f for f in files]):
        return stream_to_store(
            "cifar100",
            folder / files[0],
            folder / files[1],
            ("image", "label"),
            _image_rows("image", _chw, (32, 32, 3)),
            (),
            options,
            100,
        )
    ids, train, test_ids, test = _read_pair(folder, "fed_cifar100", ("image", "label"), options.max_clients)
    x, natural = _stack(train, "image")
    test_x, test_natural = _stack(test, "image")
    data = image_task_data(
        _chw(x),
        _stack(train, "label")[0],
        _chw(test_x),
        _stack(test, "label")[0],
        num_classes=100,
        natural=natural,
        names=ids,
    )
    return dataclasses.replace(data, test_client_indices=align_clients(ids, test_ids, test_natural))


def _chw(images: np.ndarray) -> np.ndarray:
    """uint8 [n, H, W, C] -> [n, C, H, W]."""
    return np.ascontiguousarray(images.astype(np.uint8).transpose(0, 3, 1, 2))


CIFAR100 = Task(
    name="cifar100",
    description="CIFAR-100: TFF federated CIFAR-100 (500 clients) or torchvision CIFAR-100 (no clients)",
    source="fed_cifar100_*.h5 (TFF) or cifar-100-python (torchvision) in --data-dir (default ~/.cache/fedcli/cifar100)",
    offline=False,
    kind="classification",
    models=MappingProxyType({"resnet18-gn": lambda: models.ResNet18GN(100)}),
    default_model="resnet18-gn",
    load=_load_cifar100,
    prepare=cifar_images,
    reads_max_clients=True,  # the loader keeps the first --max-clients clients
)


# ----------------------------------------------------------------------------- StackOverflow

SO_FILES = (
    "stackoverflow_train.h5",
    "stackoverflow_test.h5",
    "stackoverflow.word_count",
    "stackoverflow.tag_count",
)
SO_ARCHIVES = ("stackoverflow.tar.bz2", "stackoverflow.word_count.tar.bz2", "stackoverflow.tag_count.tar.bz2")


def read_word_count(path: Path, size: int) -> dict[str, int]:
    """Top `size` words of stackoverflow.word_count -> rank 0..size-1."""
    words: list[str] = []
    try:
        with path.open(encoding="utf-8") as fh:
            for line in fh:
                if len(words) == size:
                    break
                if line.strip():
                    words.append(line.split()[0])
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read word counts {path}: {exc}") from None
    return {w: i for i, w in enumerate(words)}


def read_tag_count(path: Path, size: int) -> dict[str, int]:
    """Top `size` tags of stackoverflow.tag_count (JSON, most frequent first) -> rank."""
    try:
        tags = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read tag counts {path} as JSON ({exc}); download it again.") from None
    if not isinstance(tags, dict):
        raise DataError(f"{path} must be a JSON object tag -> count.")
    return {t: i for i, t in enumerate(list(tags)[:size])}


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def nwp_ids(tokens: str, vocab: dict[str, int]) -> np.ndarray:
    """[BOS, w_1..w_20, EOS] padded to 21 ids (pad 0, words 1..V, OOV V+1); TFF to_ids."""
    words = tokens.split(" ")[:NWP_LENGTH]
    ids = [BOS] + [vocab[w] + 1 if w in vocab else OOV for w in words] + [EOS]
    ids = ids[: NWP_LENGTH + 1]
    return np.array(ids + [PAD] * (NWP_LENGTH + 1 - len(ids)), dtype=np.int64)


def _so_records(
    options: TaskOptions, fields: tuple[str, ...]
) -> tuple[Path, list[str], list[dict[str, np.ndarray]], list[str], list[dict[str, np.ndarray]]]:
    """Train clients (first max_clients by id) and the test records of the same users."""
    folder = data_dir(options, "stackoverflow")
    if not _ensure(options, folder, SO_FILES, SO_ARCHIVES):
        raise missing_data(
            "StackOverflow",
            folder,
            ", ".join(SO_FILES),
            "pass --data-dir holding the TFF files "
            f"(from {TFF_URL}stackoverflow*.tar.bz2) or add --download (several GB).",
        )
    ids, train = read_tff_h5(folder / SO_FILES[0], fields, max_clients=options.max_clients)
    test_ids, test = read_tff_h5(folder / SO_FILES[1], fields, keep=set(ids))
    return folder, ids, train, test_ids, test


def _so_folder(options: TaskOptions) -> Path:
    folder = data_dir(options, "stackoverflow")
    if not _ensure(options, folder, SO_FILES, SO_ARCHIVES):
        raise missing_data(
            "StackOverflow",
            folder,
            ", ".join(SO_FILES),
            "pass --data-dir holding the TFF files "
            f"(from {TFF_URL}stackoverflow*.tar.bz2) or add --download (several GB).",
        )
    return folder


def _words(texts: list[Any]) -> Any:
    """pyarrow: each text split on single spaces (Python's str.split(" "), empty words kept)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.split_pattern(pa.array(texts, type=pa.binary()), pattern=b" ")


def _lookup(words: Any, vocab: dict[str, int]) -> np.ndarray:
    """Rank of each word of a flat pyarrow array in `vocab`, -1 where it is not there."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = pa.array([w.encode("utf-8") for w in vocab], type=pa.binary())
    return pc.index_in(words, value_set=table).fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)


def nwp_rows(texts: list[Any], vocab: dict[str, int]) -> np.ndarray:
    """`nwp_ids` of many sentences at once (vectorised with pyarrow): [n, 21] int16."""
    import pyarrow.compute as pc

    n = len(texts)
    out = np.zeros((n, NWP_LENGTH + 1), dtype=np.int16)
    if n == 0:
        return out
    words = pc.list_slice(_words(texts), 0, NWP_LENGTH)
    lengths = pc.list_value_length(words).to_numpy(zero_copy_only=False).astype(np.int64)
    rank = _lookup(pc.list_flatten(words), vocab)
    ids = np.where(rank >= 0, rank + 1, OOV)
    rows = np.repeat(np.arange(n), lengths)
    cols = np.arange(len(rows)) - np.repeat(np.cumsum(lengths) - lengths, lengths) + 1
    out[:, 0] = BOS
    out[rows, cols] = ids
    ends = lengths + 1
    short = ends <= NWP_LENGTH
    out[np.arange(n)[short], ends[short]] = EOS
    return out


def _stream_nwp(folder: Path, options: TaskOptions) -> TaskData:
    vocab = read_word_count(folder / SO_FILES[2], NWP_VOCAB)

    def encode(records: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        seqs = nwp_rows([t for r in records for t in r["tokens"]], vocab)
        return {"x": seqs[:, :-1], "y": seqs[:, 1:]}

    return stream_to_store(
        "stackoverflow-nwp",
        folder / SO_FILES[0],
        folder / SO_FILES[1],
        ("tokens",),
        encode,
        (folder / SO_FILES[2],),
        options,
        EOS + 1,
        fingerprint_as={"x": np.int64, "y": np.int64},
    )


def _load_nwp(options: TaskOptions) -> TaskData:
    folder = _so_folder(options)
    if wants_disk(options, [folder / SO_FILES[0], folder / SO_FILES[1]]):
        return _stream_nwp(folder, options)
    folder, ids, train, test_ids, test = _so_records(options, ("tokens",))
    vocab = read_word_count(folder / SO_FILES[2], NWP_VOCAB)

    def encode(records: list[dict[str, np.ndarray]]) -> tuple[Tensor, list[np.ndarray]]:
        seqs = [[nwp_ids(_text(t), vocab) for t in r["tokens"]] for r in records]
        flat, natural = _stack(
            [{"s": np.stack(s) if s else np.zeros((0, NWP_LENGTH + 1), np.int64)} for s in seqs], "s"
        )
        return torch.from_numpy(flat), natural

    train_seqs, natural = encode(train)
    test_seqs, test_natural = encode(test)
    x, y = train_seqs[:, :-1].contiguous(), train_seqs[:, 1:].contiguous()
    return TaskData(
        x=x,
        y=y,
        client_indices=natural,
        client_names=ids,
        test_x=test_seqs[:, :-1].contiguous(),
        test_y=test_seqs[:, 1:].contiguous(),
        fingerprint=fingerprint(x, y),
        num_classes=EOS + 1,
        test_client_indices=align_clients(ids, test_ids, test_natural),
    )


def token_ids(x: Tensor) -> Tensor:
    """Stored token ids (int64 in memory, int16 in a disk store) as int64 (no copy when they are)."""
    return x.long()


def next_token_loss(output: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """Per-sequence mean token cross-entropy over non-pad targets: [B, T, V], [B, T] -> [B]."""
    y = y.long()
    nll = torch.nn.functional.cross_entropy(output.flatten(0, -2), y.flatten(), reduction="none").view_as(y)
    real = (y != PAD).to(output.dtype)
    return (nll * real).sum(dim=-1) / real.sum(dim=-1).clamp_min(1.0)


def bag_of_words(x: Tensor, vocab_size: int = LR_VOCAB) -> Tensor:
    """Mean one-hot over tokens (OOV = vocab_size counts in the mean, then dropped); -1 = pad."""
    x = x.long()  # int16 ids in a disk store
    valid = (x >= 0).to(torch.float32)  # [B, L]
    counts = torch.zeros(x.shape[0], vocab_size + 1, device=x.device).scatter_add(1, x.clamp_min(0), valid)
    return counts[:, :vocab_size] / valid.sum(dim=-1, keepdim=True).clamp_min(1.0)


def lr_example(
    tokens: str, title: str, tags: str, vocab: dict[str, int], tag_ids: dict[str, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of "tokens title" (OOV = V) and the multi-hot of the known tags."""
    words = f"{tokens} {title}".split(" ")
    ids = np.array([vocab.get(w, LR_VOCAB) for w in words], dtype=np.int64)
    target = np.zeros(LR_TAGS, dtype=np.float32)
    target[[tag_ids[t] for t in tags.split("|") if t in tag_ids]] = 1.0
    return ids, target


def lr_rows(
    tokens: list[Any], titles: list[Any], tags: list[Any], vocab: dict[str, int], tag_ids: dict[str, int]
) -> tuple[np.ndarray, np.ndarray]:
    """`lr_example` of many examples at once (pyarrow): ids [n, widest] int16 padded with -1, multi-hot
    tags [n, 500] uint8."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(tokens)
    if n == 0:
        return np.full((0, 1), -1, np.int16), np.zeros((0, LR_TAGS), np.uint8)
    joined = pc.binary_join_element_wise(
        pa.array(tokens, type=pa.binary()), pa.array(titles, type=pa.binary()), b" "
    )
    words = pc.split_pattern(joined, pattern=b" ")
    lengths = pc.list_value_length(words).to_numpy(zero_copy_only=False).astype(np.int64)
    rank = _lookup(pc.list_flatten(words), vocab)
    x = np.full((n, max(int(lengths.max()), 1)), -1, dtype=np.int16)
    rows = np.repeat(np.arange(n), lengths)
    x[rows, np.arange(len(rows)) - np.repeat(np.cumsum(lengths) - lengths, lengths)] = np.where(
        rank >= 0, rank, LR_VOCAB
    )
    tag_words = pc.split_pattern(pa.array(tags, type=pa.binary()), pattern=b"|")
    tag_lengths = pc.list_value_length(tag_words).to_numpy(zero_copy_only=False).astype(np.int64)
    tag_rank = _lookup(pc.list_flatten(tag_words), tag_ids)
    y = np.zeros((n, LR_TAGS), dtype=np.uint8)
    tag_rows = np.repeat(np.arange(n), tag_lengths)
    y[tag_rows[tag_rank >= 0], tag_rank[tag_rank >= 0]] = 1
    return x, y


def _stream_lr(folder: Path, options: TaskOptions) -> TaskData:
    vocab, tag_ids = (
        read_word_count(folder / SO_FILES[2], LR_VOCAB),
        read_tag_count(folder / SO_FILES[3], LR_TAGS),
    )

    def encode(records: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        x, y = lr_rows(
            [t for r in records for t in r["tokens"]],
            [t for r in records for t in r["title"]],
            [t for r in records for t in r["tags"]],
            vocab,
            tag_ids,
        )
        return {"x": x, "y": y}

    return stream_to_store(
        "stackoverflow-lr",
        folder / SO_FILES[0],
        folder / SO_FILES[1],
        ("tokens", "title", "tags"),
        encode,
        (folder / SO_FILES[2], folder / SO_FILES[3]),
        options,
        LR_TAGS,
        ragged=("x",),
        fingerprint_as={"x": np.int64, "y": np.float32},
    )


def _load_lr(options: TaskOptions) -> TaskData:
    folder = _so_folder(options)
    if wants_disk(options, [folder / SO_FILES[0], folder / SO_FILES[1]]):
        return _stream_lr(folder, options)
    folder, ids, train, test_ids, test = _so_records(options, ("tokens", "title", "tags"))
    vocab, tag_ids = (
        read_word_count(folder / SO_FILES[2], LR_VOCAB),
        read_tag_count(folder / SO_FILES[3], LR_TAGS),
    )

    def encode(records: list[dict[str, np.ndarray]]) -> tuple[Tensor, Tensor, list[np.ndarray]]:
        rows = [
            lr_example(_text(a), _text(b), _text(c), vocab, tag_ids)
            for r in records
            for a, b, c in zip(r["tokens"], r["title"], r["tags"], strict=True)
        ]
        width = max((len(w) for w, _ in rows), default=1)
        x = np.full((len(rows), width), -1, dtype=np.int64)
        for i, (w, _) in enumerate(rows):
            x[i, : len(w)] = w
        y = np.stack([t for _, t in rows]) if rows else np.zeros((0, LR_TAGS), np.float32)
        natural = _stack([{"t": r["tags"]} for r in records], "t")[1]
        return torch.from_numpy(x), torch.from_numpy(y), natural

    x, y, natural = encode(train)
    test_x, test_y, test_natural = encode(test)
    return TaskData(
        x=x,
        y=y,
        client_indices=natural,
        client_names=ids,
        test_x=test_x,
        test_y=test_y,
        fingerprint=fingerprint(x, y),
        num_classes=LR_TAGS,
        test_client_indices=align_clients(ids, test_ids, test_natural),
    )


def multilabel_loss(output: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """Per-example BCE-with-logits summed over labels: [B, L] -> [B]."""
    return torch.nn.functional.binary_cross_entropy_with_logits(
        output, y.to(output.dtype), reduction="none"
    ).sum(-1)


_NWP_METRICS = next_token(pad_id=PAD, special_ids=(OOV, BOS, EOS))  # Reddi et al.: no special tokens

STACKOVERFLOW_NWP = Task(
    name="stackoverflow-nwp",
    description="StackOverflow next-word prediction (TFF), 10k vocabulary, natural clients = users",
    source="TFF stackoverflow_*.h5 + word counts in --data-dir (default ~/.cache/fedcli/stackoverflow)",
    offline=False,
    kind="next_token",
    models=MappingProxyType({"lstm": lambda: models.WordLSTM(EOS + 1)}),
    default_model="lstm",
    load=_load_nwp,
    prepare=token_ids,
    example_loss=next_token_loss,
    metrics=MetricFns(stats=lambda out, y: _NWP_METRICS.stats(out, y.long()), finish=_NWP_METRICS.finish),
    reads_max_clients=True,  # the loader keeps the first --max-clients clients
)

STACKOVERFLOW_LR = Task(
    name="stackoverflow-lr",
    description="StackOverflow tag prediction (TFF): 10k-word bag of words -> 500 tags, multi-label",
    source="TFF stackoverflow_*.h5 + word/tag counts in --data-dir (default ~/.cache/fedcli/stackoverflow)",
    offline=False,
    kind="multilabel",
    models=MappingProxyType({"logreg": lambda: models.Linear(LR_VOCAB, LR_TAGS)}),
    default_model="logreg",
    load=_load_lr,
    prepare=bag_of_words,
    example_loss=multilabel_loss,
    reads_max_clients=True,  # the loader keeps the first --max-clients clients
)

TASKS = (EMNIST, CIFAR100, STACKOVERFLOW_NWP, STACKOVERFLOW_LR)
