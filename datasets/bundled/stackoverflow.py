"""StackOverflow from TFF h5 files: next-word prediction and tag prediction (logistic regression).

Preprocessing follows Reddi et al. 2021 (ICLR, arXiv:2003.00295) / the google-research
`federated` code: StackOverflow NWP keeps the 10,000 most frequent words, ids pad = 0,
words 1..10000, OOV = 10001, BOS = 10002, EOS = 10003, sequences of 20 tokens
(x = ids[:20], y = ids[1:21] of [BOS, tokens[:20], EOS] padded); StackOverflow LR uses the
10,000-word mean bag of words of "tokens title" and the 500 most frequent tags (multi-hot).
The files are read, fetched and streamed into a disk store by datasets/scale/tff_h5.py; token
ids are stored as int16 there and widened per batch by the task.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedcli.datasets import models
from fedcli.datasets.formats.tff_h5 import (
    TFF_URL,
    Encode,
    ensure_files,
    load_tff,
)
from fedcli.datasets.metrics import MetricFns, next_token
from fedcli.datasets.sources import data_dir, missing_data
from fedcli.datasets.tasks import Task, TaskData, TaskOptions
from fedcli.errors import DataError

NWP_VOCAB, NWP_LENGTH = 10000, 20  # Reddi et al. Table 7
PAD, OOV, BOS, EOS = 0, NWP_VOCAB + 1, NWP_VOCAB + 2, NWP_VOCAB + 3
LR_VOCAB, LR_TAGS = 10000, 500

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
    try:
        with path.open(encoding="utf-8") as fh:  # read only as far as the size-th word
            words = list(itertools.islice((line.split()[0] for line in fh if line.strip()), size))
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


def _so_folder(options: TaskOptions) -> Path:
    folder = data_dir(options, "stackoverflow")
    if not ensure_files(options, folder, SO_FILES, SO_ARCHIVES):
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
    """[BOS, w_1..w_20, EOS] padded to 21 ids (pad 0, words 1..V, OOV V+1; TFF to_ids) of each sentence,
    split on single spaces (Python's str.split(" ")), vectorised with pyarrow: [n, 21] int16."""
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


def _load_so(
    options: TaskOptions,
    what: str,
    fields: tuple[str, ...],
    make_encode: Callable[[Path], Encode],
    counts: tuple[str, ...],
    num_classes: int,
    dtypes: dict[str, Any],
    ragged: tuple[str, ...] = (),
) -> TaskData:
    """A StackOverflow task (`load_tff`): train clients (first max_clients by id) and the test records
    of the same users, encoded by `make_encode(folder)` a batch of clients at a time; held in memory as
    `dtypes` (int64 token ids) or streamed into a disk store."""
    folder = _so_folder(options)
    return load_tff(
        what,
        folder / SO_FILES[0],
        folder / SO_FILES[1],
        fields,
        make_encode(folder),
        tuple(folder / name for name in counts),
        options,
        num_classes,
        ragged,
        dtypes,
    )


def _nwp_encode(folder: Path) -> Encode:
    """Each sentence's `nwp_rows` ids over the 10,000 most frequent words: x = ids[:20], y = ids[1:21]."""
    vocab = read_word_count(folder / SO_FILES[2], NWP_VOCAB)

    def encode(records: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        seqs = nwp_rows([t for r in records for t in r["tokens"]], vocab)
        return {"x": seqs[:, :-1], "y": seqs[:, 1:]}

    return encode


def _load_nwp(options: TaskOptions) -> TaskData:
    return _load_so(
        options,
        "stackoverflow-nwp",
        ("tokens",),
        _nwp_encode,
        (SO_FILES[2],),
        EOS + 1,
        {"x": np.int64, "y": np.int64},
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


def lr_rows(
    tokens: list[Any], titles: list[Any], tags: list[Any], vocab: dict[str, int], tag_ids: dict[str, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of "tokens title" (OOV = V) and the multi-hot of the known tags, many examples at once
    (pyarrow): ids [n, widest] int16 padded with -1, multi-hot tags [n, 500] uint8."""
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


def _lr_encode(folder: Path) -> Encode:
    """`lr_rows` of each example over the 10,000 most frequent words and the 500 most frequent tags."""
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

    return encode


def _load_lr(options: TaskOptions) -> TaskData:
    return _load_so(
        options,
        "stackoverflow-lr",
        ("tokens", "title", "tags"),
        _lr_encode,
        (SO_FILES[2], SO_FILES[3]),
        LR_TAGS,
        {"x": np.int64, "y": np.float32},
        ragged=("x",),
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

TASKS = (STACKOVERFLOW_NWP, STACKOVERFLOW_LR)
