"""Federated EMNIST and CIFAR-100 (500 clients) from TFF h5 files, else torchvision's files.

The `emnist` and `cifar100` tasks read the TFF files (datasets/scale/tff_h5.py) when they are
in --data-dir (natural writers / 500 LDA clients), else torchvision's files (no natural
clients), else (only with download=True) fetch the TFF archive.

Deviations: Paper: images randomly cropped to 24x24 (CIFAR-100; Reddi et al. 2021). Here: full
32x32, no augmentation (prepare is deterministic).
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import numpy as np

from fedcli.datasets import models
from fedcli.datasets.bundled.femnist import grey_images
from fedcli.datasets.bundled.mnist import image_task_data
from fedcli.datasets.bundled.torchvision_sources import (
    CIFAR100_DIR,
    cifar_images,
    load_cifar,
    load_emnist_torchvision,
)
from fedcli.datasets.formats.tff_h5 import (
    Encode,
    ensure_files,
    load_tff,
)
from fedcli.datasets.sources import data_dir, missing_data
from fedcli.datasets.tasks import Task, TaskData, TaskOptions

# ----------------------------------------------------------------------------- EMNIST


def _load_emnist(options: TaskOptions) -> TaskData:
    folder = data_dir(options, "emnist")
    files = ("fed_emnist_train.h5", "fed_emnist_test.h5")
    if not all((folder / f).exists() for f in files) and any(
        folder.glob("*/raw/emnist-byclass-train-images-idx3-ubyte*")  # torchvision's EMNIST
    ):
        return load_emnist_torchvision(folder)
    if not ensure_files(options, folder, files, ("fed_emnist.tar.bz2",)):
        raise missing_data(
            "EMNIST",
            folder,
            "fed_emnist_train.h5 and fed_emnist_test.h5 (TFF, 3,400 writers) "
            "or torchvision's EMNIST/raw/emnist-byclass-*",
            "pass --data-dir or add --download.",
        )
    return load_tff(
        "emnist",
        folder / files[0],
        folder / files[1],
        ("pixels", "label"),
        _image_rows("pixels", _ink, (28, 28)),
        (),
        options,
        62,
    )


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
    if not ensure_files(options, folder, files, ("fed_cifar100.tar.bz2",)):
        raise missing_data(
            "CIFAR-100",
            folder,
            "fed_cifar100_train.h5 / fed_cifar100_test.h5 (TFF, 500 clients) "
            f"or torchvision's {CIFAR100_DIR}/",
            "pass --data-dir or add --download.",
        )
    return load_tff(
        "cifar100",
        folder / files[0],
        folder / files[1],
        ("image", "label"),
        _image_rows("image", _chw, (32, 32, 3)),
        (),
        options,
        100,
    )


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

TASKS = (EMNIST, CIFAR100)
