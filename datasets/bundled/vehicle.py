"""Vehicle sensor network: 2-class vehicle classification, one natural client per sensor.

Duarte and Hu. Vehicle classification in distributed sensor networks. JPDC 2004; the
federated version of MOCHA / q-FFL / Ditto (litian96/ditto data/vehicle): 23 sensors, 100
standardised acoustic + seismic features per sample, y = [1] or [-1] (mapped to 1 / 0).

Not bundled. Read from --data-dir (default ~/.cache/fedcli/vehicle) in LEAF JSON form:
`train/` and `test/` folders of *.json(.gz), or the files `mytrain.json(.gz)` and
`mytest.json(.gz)` directly. When no test file is present (fedcli's shared data folder
holds only the training file), each sensor's last 20 % of samples in a fixed permutation
(`np.random.default_rng(0)`) becomes the test split; a warning is logged.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from fedcli.datasets import models
from fedcli.datasets.formats.leaf import read_leaf_dir, read_leaf_file
from fedcli.datasets.sources import consecutive, data_dir, first_existing, holdout, missing_data
from fedcli.datasets.tasks import Task, TaskData, TaskOptions, fingerprint
from fedcli.errors import DataError

log = logging.getLogger(__name__)
NUM_FEATURES = 100
HOLDOUT = 0.2


def _read(folder: Path, split: str) -> dict[str, dict[str, list[Any]]] | None:
    if (folder / split).is_dir():
        return read_leaf_dir(folder / split)
    path = first_existing(folder, f"my{split}.json")
    if path is None:
        return None
    doc = read_leaf_file(path)
    return {u: doc["user_data"][u] for u in doc["users"]}


def _arrays(record: dict[str, list[Any]], where: str) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(record["x"], dtype=np.float32).reshape(len(record["x"]), -1)
    y = np.asarray(record["y"]).reshape(-1)
    if x.shape[1] != NUM_FEATURES or len(y) != len(x) or not np.isin(y, (-1, 1)).all():
        raise DataError(
            f"{where}: expected {NUM_FEATURES} features and labels in {{-1, 1}}; got x {x.shape}."
        )
    return x, (y > 0).astype(np.int64)


def load_vehicle(options: TaskOptions) -> TaskData:
    """Vehicle sensor data; sensors sorted by id, first max_clients kept."""
    folder = data_dir(options, "vehicle")
    train = _read(folder, "train")
    if train is None:
        raise missing_data(
            "Vehicle",
            folder,
            "mytrain.json(.gz) or train/*.json",
            "get data/vehicle from litian96/ditto (or MOCHA) and pass --data-dir.",
        )
    test = _read(folder, "test")
    if test is None:
        log.warning(
            "vehicle: no test file in %s; holding out %d%% of each sensor's samples as the test split.",
            folder,
            int(HOLDOUT * 100),
        )
    sensors = sorted(train)[: options.max_clients]
    xs, ys, test_xs, test_ys = [], [], [], []
    for sensor in sensors:
        x, y = _arrays(train[sensor], f"{folder} sensor {sensor}")
        if test is None:
            keep, held = holdout(len(y), int(round(HOLDOUT * len(y))))
            tx, ty, x, y = x[held], y[held], x[keep], y[keep]
        elif sensor in test:
            tx, ty = _arrays(test[sensor], f"{folder} test sensor {sensor}")
        else:
            tx, ty = np.zeros((0, NUM_FEATURES), np.float32), np.zeros(0, np.int64)
        xs.append(x)
        ys.append(y)
        test_xs.append(tx)
        test_ys.append(ty)
    test_sizes = [len(t) for t in test_ys]
    if not sum(test_sizes):
        raise DataError(f"the vehicle test file in {folder} holds none of the training sensors.")
    xt, yt = torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))
    return TaskData(
        x=xt,
        y=yt,
        client_indices=consecutive([len(y) for y in ys]),
        client_names=sensors,
        test_x=torch.from_numpy(np.concatenate(test_xs)),
        test_y=torch.from_numpy(np.concatenate(test_ys)),
        fingerprint=fingerprint(xt, yt),
        num_classes=2,
        test_client_indices=consecutive(test_sizes),
    )


VEHICLE = Task(
    name="vehicle",
    description="Vehicle sensor network (2 classes, 100 features), natural clients = sensors (23)",
    source="LEAF-style JSON (litian96/ditto data/vehicle) in --data-dir (default ~/.cache/fedcli/vehicle)",
    offline=False,
    kind="classification",
    models=MappingProxyType(
        {"logreg": lambda: models.Linear(NUM_FEATURES, 2), "mlp": lambda: models.MLP(NUM_FEATURES, (64,), 2)}
    ),
    default_model="logreg",
    load=load_vehicle,
    reads_max_clients=True,  # the loader keeps the first --max-clients clients
)

TASKS = (VEHICLE,)
