"""UCI HAR: smartphone inertial windows, 6 activities, one natural client per subject.

Anguita, Ghio, Oneto, Parra, Reyes-Ortiz. A Public Domain Dataset for Human Activity
Recognition Using Smartphones. ESANN 2013 (UCI Machine Learning Repository; no commercial
use). Each example is a 2.56 s window, 128 time steps x 9 channels (body_acc xyz, body_gyro
xyz, total_acc xyz), float32 [128, 9]; labels 0-5 = UCI activity id - 1.

Not bundled (23 MB); two layouts are read from --data-dir (default ~/.cache/fedcli/har):

- per-subject files `subject_01.npz.xz` ... `subject_30.npz.xz`, each an xz-compressed npz
  with x_train/y_train/x_test/y_test (the layout of fedcli's shared data folder): 30
  clients, each keeps its own train part; the test split pools every subject's test part.
- UCI's own `UCI HAR Dataset/{train,test}/Inertial Signals/<channel>_<split>.txt` with
  `subject_<split>.txt` and `y_<split>.txt`: UCI's split is by subject, so the clients are
  the 21 training subjects and the test split is the 9 test subjects' windows.

`TaskOptions.max_clients` keeps the first N subjects (in subject order).
"""

from __future__ import annotations

import io
import lzma
import zipfile
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch

from fedcli.datasets import models
from fedcli.datasets.sources import consecutive, data_dir, missing_data
from fedcli.datasets.tasks import Task, TaskData, TaskOptions, fingerprint
from fedcli.errors import DataError

CHANNELS = (
    "body_acc_x",
    "body_acc_y",
    "body_acc_z",
    "body_gyro_x",
    "body_gyro_y",
    "body_gyro_z",
    "total_acc_x",
    "total_acc_y",
    "total_acc_z",
)
WINDOW = 128
ACTIVITIES = ("WALKING", "WALKING_UPSTAIRS", "WALKING_DOWNSTAIRS", "SITTING", "STANDING", "LAYING")


def read_subject_file(path: Path) -> dict[str, np.ndarray]:
    """One subject_XX.npz.xz: x_train/x_test float32 [n, 128, 9], y_train/y_test int64."""
    try:
        archive = np.load(io.BytesIO(lzma.open(path).read()), allow_pickle=False)
        arrays = {k: archive[k] for k in ("x_train", "y_train", "x_test", "y_test")}
    except (OSError, EOFError, lzma.LZMAError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        raise DataError(
            f"HAR file {path} cannot be read ({type(exc).__name__}: {exc}); it is truncated or "
            "corrupted, or lacks x_train/y_train/x_test/y_test."
        ) from None
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.ndim != 3 or x.shape[1:] != (WINDOW, len(CHANNELS)) or len(x) != len(y):
            raise DataError(
                f"HAR file {path}: x_{split} {x.shape} / y_{split} {y.shape}; expected [n, 128, 9] / [n]."
            )
    return {k: v.astype(np.float32) if k.startswith("x") else v.astype(np.int64) for k, v in arrays.items()}


def _read_uci_split(root: Path, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    signals = root / split / "Inertial Signals"
    try:
        channels = [np.loadtxt(signals / f"{c}_{split}.txt", dtype=np.float32, ndmin=2) for c in CHANNELS]
        subject = np.loadtxt(root / split / f"subject_{split}.txt", dtype=np.int64, ndmin=1)
        y = np.loadtxt(root / split / f"y_{split}.txt", dtype=np.int64, ndmin=1) - 1
    except (OSError, ValueError) as exc:
        raise DataError(f"UCI HAR {split} files under {root} cannot be read ({exc}).") from None
    x = np.stack(channels, axis=-1)  # [n, 128, 9]
    if x.shape[1] != WINDOW or not len(x) == len(subject) == len(y):
        raise DataError(
            f"UCI HAR {split} files under {root} disagree: signals {x.shape}, {len(subject)} subjects, "
            f"{len(y)} labels; expected [n, 128] per channel."
        )
    return x, y, subject


def load_har(options: TaskOptions) -> TaskData:
    """UCI HAR from per-subject npz.xz files or from UCI's own text layout."""
    folder = data_dir(options, "har")
    files = sorted(folder.glob("subject_*.npz.xz"))[: options.max_clients]
    if files:
        subjects = [read_subject_file(f) for f in files]
        names = [f.name.split(".")[0] for f in files]
        train_x = [s["x_train"] for s in subjects]
        train_y = np.concatenate([s["y_train"] for s in subjects])
        test_x = np.concatenate([s["x_test"] for s in subjects])
        test_y = np.concatenate([s["y_test"] for s in subjects])
        test_clients: list[np.ndarray] | None = consecutive([len(s["y_test"]) for s in subjects])
    else:
        root = folder / "UCI HAR Dataset" if (folder / "UCI HAR Dataset").exists() else folder
        if not (root / "train" / "Inertial Signals").exists():
            raise missing_data(
                "UCI HAR",
                folder,
                "subject_XX.npz.xz files or 'UCI HAR Dataset/train/Inertial Signals'",
                "download UCI HAR from the UCI repository and pass --data-dir.",
            )
        x, y, subject = _read_uci_split(root, "train")
        test_x, test_y, _ = _read_uci_split(root, "test")
        ids = np.unique(subject)[: options.max_clients]
        train_x = [x[subject == s] for s in ids]
        train_y = np.concatenate([y[subject == s] for s in ids])
        names = [f"subject_{s:02d}" for s in ids]
        test_clients = None  # UCI's test subjects are not training clients
    if np.any((train_y < 0) | (train_y >= len(ACTIVITIES))) or np.any(
        (test_y < 0) | (test_y >= len(ACTIVITIES))
    ):
        raise DataError(f"UCI HAR labels under {folder} must be activities 0-5.")
    xt, yt = torch.from_numpy(np.concatenate(train_x)), torch.from_numpy(train_y)
    return TaskData(
        x=xt,
        y=yt,
        client_indices=consecutive([len(a) for a in train_x]),
        client_names=names,
        test_x=torch.from_numpy(test_x),
        test_y=torch.from_numpy(test_y),
        fingerprint=fingerprint(xt, yt),
        num_classes=len(ACTIVITIES),
        test_client_indices=test_clients,
    )


HAR = Task(
    name="har",
    description="UCI HAR activity recognition (6 classes), natural clients = subjects (30)",
    source="UCI HAR per-subject npz.xz or 'UCI HAR Dataset' in --data-dir (default ~/.cache/fedcli/har)",
    offline=False,
    kind="classification",
    models=MappingProxyType(
        {
            "cnn": lambda: models.HarCNN(len(ACTIVITIES)),
            "mlp": lambda: models.MLP(WINDOW * len(CHANNELS), (200, 200), len(ACTIVITIES)),
        }
    ),
    default_model="cnn",
    load=load_har,
    reads_max_clients=True,  # the loader keeps the first --max-clients clients
)

TASKS = (HAR,)
