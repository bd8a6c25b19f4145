"""LEAF Shakespeare: next-character prediction, one natural client per speaking role.

Caldas et al. LEAF: A Benchmark for Federated Settings. arXiv:1812.01097. Each example is
an 80-character window x and the next character y. Characters are encoded with LEAF's
80-letter alphabet (`models/utils/language_utils.py::ALL_LETTERS`): x -> int ids [80],
y -> one id, so the task is 80-way classification of the last step ("classification":
accuracy = next-character accuracy). LEAF maps an unknown character to -1, which no
embedding accepts; here it is a DataError naming the character.

Bundled (datasets/data/shakespeare, see its README): LEAF's niid_023_keep_64 sample with 10
roles (41,990 training and 3,881 test windows). The full LEAF data loads the same way from
LEAF's data/shakespeare/data folder (--data-dir holding train/ and test/). LEAF's test files
overstate num_samples by 79 (the window length - 1); the loader counts the stored windows.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch

from fedcli.datasets import models
from fedcli.datasets.bundled.femnist import verify_checksums
from fedcli.datasets.bundled.stackoverflow import token_ids
from fedcli.datasets.formats import diskstore
from fedcli.datasets.formats.leaf import read_leaf_dir, stream_leaf_store
from fedcli.datasets.sources import align_clients, consecutive
from fedcli.datasets.tasks import Task, TaskData, TaskOptions, fingerprint
from fedcli.errors import DataError

BUNDLED_DIR = Path(__file__).parents[1] / "data" / "shakespeare"
ALL_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
_LOOKUP = np.full(256, -1, dtype=np.int16)
_LOOKUP[np.frombuffer(ALL_LETTERS.encode("latin-1"), dtype=np.uint8)] = np.arange(len(ALL_LETTERS))


def encode(texts: list[str], where: str) -> np.ndarray:
    """Map equal-length strings to LEAF letter ids uint8 [n, len]; DataError on other characters."""
    if not texts:
        return np.zeros((0, 0), dtype=np.uint8)
    try:
        raw = np.frombuffer("".join(texts).encode("latin-1"), dtype=np.uint8)
    except UnicodeEncodeError as exc:
        raise DataError(
            f"{where}: character {exc.object[exc.start]!r} is not in LEAF's Shakespeare alphabet."
        ) from None
    if len(raw) != len(texts) * len(texts[0]):
        raise DataError(f"{where}: windows have different lengths; expected all {len(texts[0])} characters.")
    ids = _LOOKUP[raw]
    if (ids < 0).any():
        bad = chr(int(raw[int(np.flatnonzero(ids < 0)[0])]))
        raise DataError(f"{where}: character {bad!r} is not in LEAF's Shakespeare alphabet.")
    return ids.astype(np.uint8).reshape(len(texts), -1)


def _rows(record: dict[str, list[str]], where: str) -> dict[str, np.ndarray]:
    """One role's windows as letter ids uint8 [n, 80] and next letters int64 [n] (memory and disk store)."""
    return {"x": encode(record["x"], where), "y": encode(record["y"], where).reshape(-1).astype(np.int64)}


def _split(
    users: dict[str, dict[str, list[str]]], roles: list[str], where: str
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    rows = [_rows(users[role], f"{where}, role {role}") for role in roles]
    x, y = (np.concatenate([r[k] for r in rows]) for k in ("x", "y"))
    return x, y, consecutive([len(r["y"]) for r in rows])


def load_shakespeare(options: TaskOptions) -> TaskData:
    """LEAF Shakespeare from data_dir/{train,test} (default: the bundled 10-role sample)."""
    folder = Path(options.data_dir) if options.data_dir is not None else BUNDLED_DIR
    if not folder.exists():
        raise DataError(
            f"Shakespeare folder {folder} does not exist; pass --data-dir with LEAF's "
            "data/shakespeare/data folder (it holds train/ and test/)."
        )
    verify_checksums(folder)
    if diskstore.wants_disk(options, sorted(folder.rglob("*.json*"))):  # one JSON file in memory at a time
        return stream_leaf_store(
            "shakespeare",
            folder,
            _rows,
            num_classes=len(ALL_LETTERS),
            max_clients=options.max_clients,
            exact_counts=False,
        )
    train = read_leaf_dir(folder / "train", exact_counts=False)
    test = read_leaf_dir(folder / "test", exact_counts=False)
    roles = sorted(train)[: options.max_clients]
    x, y, natural = _split(train, roles, str(folder / "train"))
    test_roles = [r for r in roles if r in test]
    test_x, test_y, test_natural = _split(test, test_roles, str(folder / "test"))
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    return TaskData(
        x=xt,
        y=yt,
        client_indices=natural,
        client_names=roles,
        test_x=torch.from_numpy(test_x),
        test_y=torch.from_numpy(test_y),
        fingerprint=fingerprint(xt, yt),
        num_classes=len(ALL_LETTERS),
        test_client_indices=align_clients(roles, test_roles, test_natural),
    )


SHAKESPEARE = Task(
    name="shakespeare",
    description="LEAF Shakespeare next character (80 letters), natural clients = speaking roles (bundled: 10)",
    source="bundled LEAF sample (datasets/data/shakespeare); full LEAF via --data-dir",
    offline=True,
    kind="classification",
    models=MappingProxyType({"lstm": lambda: models.CharLSTM(len(ALL_LETTERS))}),
    default_model="lstm",
    load=load_shakespeare,
    prepare=token_ids,  # uint8 letter ids -> int64 for the embedding
    reads_max_clients=True,  # the loader keeps the first --max-clients clients
)

TASKS = (SHAKESPEARE,)
