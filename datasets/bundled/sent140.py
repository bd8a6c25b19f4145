"""LEAF Sent140: tweet sentiment (2 classes), one natural client per Twitter user.

Caldas et al. LEAF: A Benchmark for Federated Settings. arXiv:1812.01097. A LEAF Sent140
example is x = [tweet id, date, query, user, text] and y = 0 (negative) or 1 (positive).
Tokenisation follows LEAF's `language_utils.line_to_indices`: words = re.findall(r"[\\w']+|
[.,!?;]", text), the first 25 words, unknown words and padding = the UNK id.

Deviations: LEAF: the vocabulary and frozen embeddings come from GloVe (300-d, 400k words).
Here: the vocabulary is the 10,000 most frequent words of the training tweets (ties in
alphabetical order) and the embeddings are learned, so no GloVe download is needed.
Not bundled: point --data-dir at LEAF's data/sent140/data folder (train/ and test/).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from fedcli.datasets import models
from fedcli.datasets.formats import diskstore
from fedcli.datasets.formats.leaf import iter_leaf_users, read_leaf_dir, stream_leaf_store
from fedcli.datasets.sources import align_clients, consecutive, data_dir, missing_data
from fedcli.datasets.tasks import Task, TaskData, TaskOptions, fingerprint
from fedcli.errors import DataError

MAX_WORDS = 25  # LEAF line_to_indices(max_words=25)
VOCAB_SIZE = 10000
_WORD = re.compile(r"[\w']+|[.,!?;]")


def tweet_text(x: Any, where: str) -> str:
    """The text field (index 4) of a LEAF Sent140 x record."""
    if not isinstance(x, list) or len(x) < 5 or not isinstance(x[4], str):
        raise DataError(f"{where}: a Sent140 x must be [id, date, query, user, text]; got {str(x)[:80]!r}.")
    return x[4]


def build_vocab(counts: Counter[str], size: int = VOCAB_SIZE) -> dict[str, int]:
    """The `size` most frequent words of the word counts (ties alphabetical) -> ids 0..size-1."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]
    return {w: i for i, (w, _) in enumerate(ranked)}


def line_to_indices(text: str, vocab: dict[str, int]) -> list[int]:
    """First 25 word ids, UNK (= len(vocab)) for unknown words and padding."""
    unk = len(vocab)
    ids = [vocab.get(w, unk) for w in _WORD.findall(text)[:MAX_WORDS]]
    return ids + [unk] * (MAX_WORDS - len(ids))


def _stream_sent140(folder: Path, max_clients: int | None) -> TaskData:
    """load_sent140 into a disk store, one JSON file in memory at a time: a pass for the user names, one
    counting the kept users' words (the vocabulary), then the store's build (datasets/formats/leaf.py)."""
    users = set(sorted(u for _, u, _ in iter_leaf_users(folder / "train"))[:max_clients])
    counts: Counter[str] = Counter()
    for path, user, record in iter_leaf_users(folder / "train"):
        if user in users:
            counts.update(w for x in record["x"] for w in _WORD.findall(tweet_text(x, f"{path} user {user}")))
    vocab = build_vocab(counts)

    def rows(record: dict[str, list[Any]], where: str) -> dict[str, np.ndarray]:
        labels = [int(v) for v in record["y"]]
        if any(v not in (0, 1) for v in labels):
            raise DataError(f"{where}: Sent140 labels must be 0 or 1.")
        ids = [line_to_indices(tweet_text(x, where), vocab) for x in record["x"]]
        return {
            "x": np.asarray(ids, dtype=np.int64).reshape(-1, MAX_WORDS),
            "y": np.asarray(labels, dtype=np.int64),
        }

    return stream_leaf_store("sent140", folder, rows, num_classes=2, max_clients=max_clients)


def load_sent140(options: TaskOptions) -> TaskData:
    """LEAF Sent140 from data_dir/{train,test}; users sorted by id."""
    folder = data_dir(options, "sent140")
    if not (folder / "train").exists() or not (folder / "test").exists():
        raise missing_data(
            "Sent140",
            folder,
            "train/ and test/ folders of LEAF JSON",
            "run LEAF's data/sent140/preprocess.sh and pass --data-dir data/sent140/data.",
        )
    if diskstore.wants_disk(options, sorted(folder.rglob("*.json*"))):
        return _stream_sent140(folder, options.max_clients)
    train = read_leaf_dir(folder / "train")
    test = read_leaf_dir(folder / "test")
    users = sorted(train)[: options.max_clients]
    texts = {u: [tweet_text(x, f"{folder / 'train'} user {u}") for x in train[u]["x"]] for u in users}
    vocab = build_vocab(Counter(w for u in users for t in texts[u] for w in _WORD.findall(t)))

    def encode(
        split: dict[str, dict[str, list[Any]]], names: list[str], where: str
    ) -> tuple[np.ndarray, np.ndarray]:
        rows = [line_to_indices(tweet_text(x, where), vocab) for u in names for x in split[u]["x"]]
        labels = [int(v) for u in names for v in split[u]["y"]]
        if any(v not in (0, 1) for v in labels):
            raise DataError(f"{where}: Sent140 labels must be 0 or 1.")
        return np.asarray(rows, dtype=np.int64).reshape(-1, MAX_WORDS), np.asarray(labels, dtype=np.int64)

    x, y = encode(train, users, str(folder / "train"))
    test_users = [u for u in users if u in test]
    test_x, test_y = encode(test, test_users, str(folder / "test"))
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    return TaskData(
        x=xt,
        y=yt,
        client_indices=consecutive([len(train[u]["y"]) for u in users]),
        client_names=users,
        test_x=torch.from_numpy(test_x),
        test_y=torch.from_numpy(test_y),
        fingerprint=fingerprint(xt, yt),
        num_classes=2,
        test_client_indices=align_clients(
            users, test_users, consecutive([len(test[u]["y"]) for u in test_users])
        ),
    )


SENT140 = Task(
    name="sent140",
    description="LEAF Sent140 tweet sentiment (2 classes), natural clients = users",
    source="LEAF data/sent140/data JSON in --data-dir (default ~/.cache/fedcli/sent140)",
    offline=False,
    kind="classification",
    models=MappingProxyType({"lstm": lambda: models.TextLSTM(VOCAB_SIZE + 1, 2)}),
    default_model="lstm",
    load=load_sent140,
    reads_max_clients=True,  # the loader keeps the first --max-clients clients
)

TASKS = (SENT140,)
