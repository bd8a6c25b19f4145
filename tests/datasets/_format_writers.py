"""Writers of tiny files in the publishers' real formats, for loader tests without network."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import numpy as np

SHARED_DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
_IDX_CODE = {np.dtype(np.uint8): 0x08, np.dtype(np.int32): 0x0C, np.dtype(np.float32): 0x0D}


def write_idx(path: Path, array: np.ndarray, *, gz: bool = True) -> Path:
    """IDX: 0x0000, type code, ndim, big-endian uint32 dims, big-endian data."""
    array = np.asarray(array)
    header = bytes([0, 0, _IDX_CODE[array.dtype], array.ndim]) + b"".join(
        d.to_bytes(4, "big") for d in array.shape
    )
    raw = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(raw, mtime=0) if gz else raw)
    return path


def write_mnist_folder(
    root: Path, *, prefix_train: str = "train", prefix_test: str = "t10k", n: int = 12, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Four IDX files in torchvision's <root>/MNIST/raw layout; returns the train images/labels."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    y = (np.arange(n) % 10).astype(np.uint8)
    for prefix, images, labels in ((prefix_train, x, y), (prefix_test, x[:4], y[:4])):
        write_idx(root / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(root / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return x, y


def write_cifar_batch(path: Path, data: np.ndarray, labels: list[int], label_key: bytes = b"labels") -> None:
    """A CIFAR python batch as the publisher pickles it: bytes keys, data uint8 [n, 3072]."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        pickle.dump({b"batch_label": b"test", label_key: labels, b"data": data}, fh, protocol=2)


def write_leaf(
    path: Path, users: dict[str, tuple[list[object], list[object]]], *, num_samples_extra: int = 0
) -> None:
    """A LEAF JSON(.gz) file {users, num_samples, user_data}."""
    doc = {
        "users": list(users),
        "num_samples": [len(x) + num_samples_extra for x, _ in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc)
    path.write_bytes(gzip.compress(text.encode(), mtime=0) if path.suffix == ".gz" else text.encode())


def write_tff_h5(path: Path, clients: dict[str, dict[str, np.ndarray]]) -> None:
    """A TFF federated h5 file: /examples/<client>/<field> datasets."""
    import h5py

    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as h5:
        for cid, fields in clients.items():
            group = h5.create_group(f"examples/{cid}")
            for name, value in fields.items():
                group.create_dataset(name, data=value)


def write_stackoverflow(folder: Path) -> None:
    """TFF StackOverflow files: two train clients, one test client, 4-word vocabulary, 2 tags."""
    words = ["the", "a", "python", "error"]  # ranks 0..3 -> NWP ids 1..4
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "stackoverflow.word_count").write_text(
        "".join(f"{w}\t{100 - i}\n" for i, w in enumerate(words))
    )
    (folder / "stackoverflow.tag_count").write_text(json.dumps({"python": 9, "java": 5}))
    encode = lambda items: np.array([s.encode() for s in items], dtype=object)  # noqa: E731
    client = {
        "tokens": encode(["the python error", "a zebra"]),
        "title": encode(["python", "the"]),
        "tags": encode(["python|java", "ruby"]),
    }
    write_tff_h5(folder / "stackoverflow_train.h5", {"u9": client, "u1": client})
    write_tff_h5(folder / "stackoverflow_test.h5", {"u1": client})


def write_task_fixture(task: str, folder: Path) -> Path:
    """Tiny files in the real format for a task that fedcli does not bundle; returns data_dir."""
    import io
    import lzma

    rng = np.random.default_rng(0)
    if task == "fashion-mnist":
        write_mnist_folder(folder / "FashionMNIST" / "raw")
    elif task == "cifar10":
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            write_cifar_batch(
                folder / "cifar-10-batches-py" / name,
                rng.integers(0, 256, (4, 3072), dtype=np.uint8),
                [0, 1, 2, 3],
            )
    elif task == "cifar100":
        client = {
            "image": rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8),
            "label": np.array([0, 5, 99, 5]),
        }
        write_tff_h5(folder / "fed_cifar100_train.h5", {"a": client, "b": client})
        write_tff_h5(folder / "fed_cifar100_test.h5", {"a": client})
    elif task == "emnist":
        client = {"pixels": rng.random((4, 28, 28), dtype=np.float32), "label": np.array([0, 10, 61, 3])}
        write_tff_h5(folder / "fed_emnist_train.h5", {"w1": client, "w2": client})
        write_tff_h5(folder / "fed_emnist_test.h5", {"w1": client})
    elif task.startswith("stackoverflow"):
        write_stackoverflow(folder)
    elif task == "sent140":
        tweet = lambda text: ["1", "date", "NO_QUERY", "user", text]  # noqa: E731
        texts = [tweet("good day"), tweet("bad day !"), tweet("so good"), tweet("meh")]
        write_leaf(folder / "train" / "t.json", {"u1": (texts, [1, 0, 1, 0]), "u2": (texts, [0, 0, 1, 1])})
        write_leaf(folder / "test" / "t.json", {"u1": (texts[:2], [1, 0])})
    elif task == "har":
        for subject in (1, 2):
            buffer = io.BytesIO()
            np.savez(
                buffer,
                x_train=rng.normal(size=(4, 128, 9)).astype(np.float32),
                y_train=np.array([0, 1, 2, 5]),
                x_test=rng.normal(size=(2, 128, 9)).astype(np.float32),
                y_test=np.array([3, 4]),
            )
            (folder / f"subject_{subject:02d}.npz.xz").write_bytes(lzma.compress(buffer.getvalue()))
    elif task == "vehicle":
        rows = rng.normal(size=(4, 100)).tolist()
        write_leaf(folder / "mytrain.json", {"f_0": (rows, [[1], [-1], [1], [-1]]), "f_1": (rows, [[1]] * 4)})
        write_leaf(folder / "mytest.json", {"f_0": (rows[:2], [[1], [-1]])})
    else:
        raise KeyError(task)
    return folder
