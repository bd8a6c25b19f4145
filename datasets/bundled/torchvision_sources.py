"""Full image data sets in the layouts torchvision downloads: FashionMNIST, EMNIST, CIFAR-10/100.

Read from `TaskOptions.data_dir` (default ~/.cache/fedcli/<name>) with fedcli's own decoders
of the publishers' formats, so torchvision is needed only to download (`download=True`;
FashionMNIST and CIFAR-10 here, CIFAR-100 and EMNIST fetch the TFF files, see tff_images.py):

- FashionMNIST (Xiao et al. 2017): `<dir>/FashionMNIST/raw/{train,t10k}-*-ubyte(.gz)`, IDX.
- EMNIST ByClass (Cohen et al. 2017; 62 classes = "EMNIST-62"):
  `<dir>/EMNIST/raw/emnist-byclass-{train,test}-*-ubyte(.gz)`, IDX. NIST stores EMNIST images
  transposed; the loader transposes them back so digits read upright like MNIST.
- CIFAR-10 / CIFAR-100 (Krizhevsky 2009): `<dir>/cifar-10-batches-py/{data_batch_1..5,
  test_batch}` and `<dir>/cifar-100-python/{train,test}`, Python pickles of {data: uint8
  [n, 3072] channel-major, labels | fine_labels}. The unpickler accepts only the numpy array
  reconstruction these files need, so a tampered file cannot run code.

None of these has natural clients; partition them with --scheme iid/dirichlet/shards/...
"""

from __future__ import annotations

import pickle
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedcli.datasets import models
from fedcli.datasets.bundled.femnist import grey_images
from fedcli.datasets.bundled.mnist import (
    MNIST_MODELS,
    find_idx_split,
    image_task_data,
    load_idx_dataset,
    torchvision_download,
)
from fedcli.datasets.sources import data_dir, missing_data
from fedcli.datasets.tasks import Task, TaskData, TaskOptions
from fedcli.errors import DataError

CIFAR10_DIR = "cifar-10-batches-py"
CIFAR100_DIR = "cifar-100-python"
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("_codecs", "encode"),
}


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickler that resolves only numpy's array reconstruction (the CIFAR files need no more)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")
        return super().find_class(module, name)


def read_cifar_batch(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    """Decode one CIFAR python batch: images uint8 [n, 3, 32, 32] and labels int64 [n]."""
    try:
        with path.open("rb") as fh:
            batch = _ArrayUnpickler(fh, encoding="bytes").load()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError) as exc:
        raise DataError(
            f"CIFAR batch {path} cannot be unpickled ({type(exc).__name__}: {exc}); it is "
            "truncated or corrupted: download it again."
        ) from None
    batch = {k.decode() if isinstance(k, bytes) else k: v for k, v in dict(batch).items()}
    if "data" not in batch or label_key not in batch:
        raise DataError(f"CIFAR batch {path} lacks 'data' or {label_key!r}; is it a CIFAR python batch?")
    data = np.asarray(batch["data"], dtype=np.uint8)
    labels = np.asarray(batch[label_key], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3072 or len(data) != len(labels):
        raise DataError(
            f"CIFAR batch {path} has data {data.shape} and {len(labels)} labels; expected "
            "[n, 3072] with n labels."
        )
    return data.reshape(-1, 3, 32, 32), labels


def load_cifar(folder: Path, *, num_classes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Read CIFAR-10 (num_classes=10) or CIFAR-100 from torchvision's extracted folder."""
    if num_classes == 10:
        root, train_files, test_files, key = (
            folder / CIFAR10_DIR,
            [f"data_batch_{i}" for i in range(1, 6)],
            ["test_batch"],
            "labels",
        )
    else:
        root, train_files, test_files, key = folder / CIFAR100_DIR, ["train"], ["test"], "fine_labels"
    missing = [f for f in train_files + test_files if not (root / f).exists()]
    if missing:
        raise missing_data(
            f"CIFAR-{num_classes}",
            root,
            ", ".join(train_files + test_files),
            f"missing {', '.join(missing)}; pass --data-dir holding {root.name}/ or add --download.",
        )
    train = [read_cifar_batch(root / f, key) for f in train_files]
    test = [read_cifar_batch(root / f, key) for f in test_files]
    return (
        np.concatenate([x for x, _ in train]),
        np.concatenate([y for _, y in train]),
        np.concatenate([x for x, _ in test]),
        np.concatenate([y for _, y in test]),
    )


def cifar_images(x: Tensor) -> Tensor:
    """uint8 [..., 3, 32, 32] -> float32 in [0, 1] (ToTensor only, as Bayes-ADMM's code does)."""
    return x.to(torch.float32) / 255.0


def _load_cifar10(options: TaskOptions) -> TaskData:
    """CIFAR-10 from data_dir (torchvision layout), downloading only if asked."""
    folder = data_dir(options, "cifar10")
    if options.download and not (folder / CIFAR10_DIR).exists():
        torchvision_download("CIFAR10", folder)
    return image_task_data(*load_cifar(folder, num_classes=10), num_classes=10)


def load_emnist_torchvision(folder: Path) -> TaskData:
    """EMNIST-62 without writers, from torchvision's layout under folder; images transposed back to upright."""
    train_x, train_y, test_x, test_y = load_idx_dataset(
        folder, name="EMNIST ByClass", train="emnist-byclass-train", test="emnist-byclass-test"
    )
    return image_task_data(
        train_x.transpose(0, 2, 1), train_y, test_x.transpose(0, 2, 1), test_y, num_classes=62
    )


def _load_fashion(options: TaskOptions) -> TaskData:
    folder = data_dir(options, "fashion-mnist")
    if options.download and find_idx_split(folder, "train") is None:
        torchvision_download("FashionMNIST", folder)
    return image_task_data(*load_idx_dataset(folder, name="FashionMNIST"), num_classes=10)


FASHION_MNIST = Task(
    name="fashion-mnist",
    description="FashionMNIST, 10 classes, no natural clients (Bayes-ADMM's FMNIST benchmarks)",
    source="torchvision FashionMNIST IDX files in --data-dir (default ~/.cache/fedcli/fashion-mnist)",
    offline=False,
    kind="classification",
    models=MNIST_MODELS,
    default_model="bayes-mlp",
    load=_load_fashion,
    prepare=grey_images,
)

CIFAR10 = Task(
    name="cifar10",
    description="CIFAR-10, 10 classes, no natural clients",
    source="torchvision cifar-10-batches-py in --data-dir (default ~/.cache/fedcli/cifar10)",
    offline=False,
    kind="classification",
    models=MappingProxyType(
        {
            "lenet5": lambda: models.LeNet5(10),
            "zenke-cnn": lambda: models.ZenkeCNN(10),  # Bayes-ADMM "CNN from Zenke et al."
            "acar-cnn": lambda: models.AcarCNN(10),  # Bayes-ADMM "CNN from Acar et al."
        }
    ),
    default_model="lenet5",
    load=_load_cifar10,
    prepare=cifar_images,
)

TASKS = (FASHION_MNIST, CIFAR10)
