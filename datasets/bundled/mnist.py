"""MNIST (IDX format): the bundled 10,000-image test set, or the full set from --data-dir.

LeCun, Cortes, Burges. The MNIST database of handwritten digits. IDX is the publisher's
format: a big-endian header (two zero bytes, a type code, the number of dimensions, one
uint32 per dimension) followed by the raw array; files are usually gzip-compressed.

Bundled (datasets/data/mnist, see its README): the official test set t10k-*, split once
and for all into 8,000 training and 2,000 test images by a fixed permutation
(`np.random.default_rng(0)`), so every run and every partition file sees the same split.
With --data-dir the full 60,000/10,000 set is read from torchvision's layout
(`<dir>/MNIST/raw/`) or from a folder holding the four IDX files directly; with
`download=True` torchvision fetches them. MNIST has no natural clients.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch

from fedcli.datasets import models
from fedcli.datasets.bundled.femnist import grey_images, verify_checksums
from fedcli.datasets.sources import first_existing, holdout, missing_data
from fedcli.datasets.tasks import Task, TaskData, TaskOptions, fingerprint
from fedcli.errors import DataError

BUNDLED_DIR = Path(__file__).parents[1] / "data" / "mnist"
BUNDLED_TRAIN = 8000  # of the 10,000 bundled images; the other 2,000 are the test split
_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """Decode one IDX file (gzip or raw, detected by its magic bytes); DataError if malformed."""
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(
            f"IDX file {path} cannot be read or un-gzipped ({exc}); it is truncated or "
            "corrupted: download it again."
        ) from None
    if len(raw) < 4 or raw[0:2] != b"\x00\x00" or raw[2] not in _IDX_TYPES:
        raise DataError(
            f"{path} is not an IDX file (bad magic {raw[:4].hex()}); expected e.g. "
            "train-images-idx3-ubyte from the MNIST site."
        )
    ndim = raw[3]
    header = 4 + 4 * ndim
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != expected:
        raise DataError(
            f"IDX file {path} holds {len(raw) - header} data bytes but its header "
            f"{shape} needs {expected}; the file is truncated: download it again."
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def read_idx_pair(images: Path, labels: Path) -> tuple[np.ndarray, np.ndarray]:
    """Read an (images, labels) IDX pair and check they have the same length."""
    x, y = read_idx(images), read_idx(labels)
    if len(x) != len(y):
        raise DataError(f"{images} has {len(x)} images but {labels} has {len(y)} labels.")
    return x, y.astype(np.int64)


def find_idx_split(folder: Path, prefix: str) -> tuple[Path, Path] | None:
    """Locate <prefix>-images-idx3-ubyte(.gz) and its labels in folder (or folder/*/raw)."""
    for where in (folder, *sorted(folder.glob("*/raw"))):
        images = first_existing(where, f"{prefix}-images-idx3-ubyte")
        labels = first_existing(where, f"{prefix}-labels-idx1-ubyte")
        if images is not None and labels is not None:
            return images, labels
    return None


def load_idx_dataset(
    folder: Path, *, name: str, train: str = "train", test: str = "t10k"
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Read the train and test IDX pairs of an MNIST-format data set from folder."""
    found = [find_idx_split(folder, prefix) for prefix in (train, test)]
    if found[0] is None or found[1] is None:
        raise missing_data(
            name,
            folder,
            f"{train}/{test}-images-idx3-ubyte(.gz) and -labels-idx1-ubyte(.gz)",
            "pass --data-dir with those files, or --download to fetch them with torchvision.",
        )
    return (*read_idx_pair(*found[0]), *read_idx_pair(*found[1]))


def load_bundled() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The bundled MNIST test set split 8,000 / 2,000 by a fixed permutation."""
    verify_checksums(BUNDLED_DIR)
    x, y = read_idx_pair(BUNDLED_DIR / "t10k-images-idx3-ubyte.gz", BUNDLED_DIR / "t10k-labels-idx1-ubyte.gz")
    train, test = holdout(len(y), len(y) - BUNDLED_TRAIN)
    return x[train], y[train], x[test], y[test]


def torchvision_download(dataset: str, folder: Path) -> None:
    """Let torchvision fetch a data set into folder (only on the user's request)."""
    import torchvision.datasets as tvd

    try:
        for train in (True, False):
            getattr(tvd, dataset)(str(folder), train=train, download=True)
    except (OSError, RuntimeError) as exc:
        raise DataError(f"torchvision could not download {dataset} into {folder}: {exc}") from None


def image_task_data(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    num_classes: int,
    natural: list[np.ndarray] | None = None,
    names: list[str] | None = None,
) -> TaskData:
    """Wrap decoded uint8 images and labels as TaskData (fingerprint over the training tensors)."""
    x, y = torch.from_numpy(np.ascontiguousarray(train_x)), torch.from_numpy(train_y.astype(np.int64))
    return TaskData(
        x=x,
        y=y,
        client_indices=natural or [],
        client_names=names or [],
        test_x=torch.from_numpy(np.ascontiguousarray(test_x)),
        test_y=torch.from_numpy(test_y.astype(np.int64)),
        fingerprint=fingerprint(x, y),
        num_classes=num_classes,
    )


def _load_mnist(options: TaskOptions) -> TaskData:
    if options.data_dir is None:
        return image_task_data(*load_bundled(), num_classes=10)
    folder = Path(options.data_dir)
    if options.download and find_idx_split(folder, "train") is None:
        torchvision_download("MNIST", folder)
    return image_task_data(*load_idx_dataset(folder, name="MNIST"), num_classes=10)


MNIST_MODELS = MappingProxyType(
    {
        "mlp": lambda: models.MLP(784, (200, 200), 10),  # 2NN of McMahan et al. 2017
        "cnn": lambda: models.McMahanCNN(10),  # CNN of McMahan et al. 2017
        "bayes-mlp": lambda: models.SigmoidMLP(784, (200, 100), 10),  # Bayes-ADMM MLP
    }
)

MNIST = Task(
    name="mnist",
    description="MNIST digits, 10 classes, no natural clients (use --scheme iid/dirichlet/shards/...)",
    source="bundled MNIST test set split 8,000/2,000 (datasets/data/mnist); full set via --data-dir",
    offline=True,
    kind="classification",
    models=MNIST_MODELS,
    default_model="mlp",
    load=_load_mnist,
    prepare=grey_images,
    client_lr=0.1,  # as femnist (docs/architecture.md §5: measured on the README's Dirichlet split)
)

TASKS = (MNIST,)
