"""A user's data object read into numpy arrays, for `materialise` (datasets/yours/data.py).

A map-style torch `Dataset` example by example, a Hugging Face `datasets.Dataset` by its columns, a
flwr-datasets `Partitioner`'s partitions as client ids; the client ids checked (`check_client_ids`,
which data files use too: datasets/yours/files.py) and the training tensors bounded by `MAX_BYTES`
(docs/your-data.md, "Memory"). Objects are recognised by their methods: no import of `datasets`
(Hugging Face) or `flwr_datasets` here.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedcli.errors import ConfigError, DataError

MAX_BYTES = 8 * 2**30  # training tensors of one materialised data object: 8 GiB (docs/your-data.md, "Memory")


def check_names(*, name: Any, x: Any, y: Any) -> None:
    """name, x and y name things (str): an int or a Path name was str()-ed, an empty one defaulted."""

    def kind(value: Any) -> str:
        return f"{type(value).__name__} {value!r}"[:80]

    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ConfigError(
            f"name must be a non-empty name (str) for the data; got {kind(name)}. Leave it out for the "
            "object's class name."
        )
    if not isinstance(y, str) or not y.strip():
        raise ConfigError(f"y must be the name (str) of a Hugging Face label column; got {kind(y)}.")
    if x is not None:
        columns = [x] if isinstance(x, str) else x
        bad = (
            next((c for c in columns if not isinstance(c, str) or not c.strip()), None)
            if isinstance(columns, (list, tuple))
            else x
        )
        if bad is not None or not columns:
            raise ConfigError(
                f"x must be a column name (str) or a list of column names; got "
                f"{kind(x if bad is None else bad)}."
            )


def slugify(text: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", str(text)).strip("-").lower()[:60]
    return slug or "data"


def is_hf(obj: Any) -> bool:
    return (
        type(obj).__module__.startswith("datasets.")
        and hasattr(obj, "column_names")
        and hasattr(obj, "with_format")
    )


def is_torch_dataset(obj: Any) -> bool:
    return isinstance(obj, torch.utils.data.Dataset) or (
        hasattr(obj, "__getitem__") and hasattr(obj, "__len__") and not isinstance(obj, (str, bytes, Mapping))
    )


def is_partitioner(obj: Any) -> bool:
    return type(obj).__module__.startswith("flwr_datasets.") and hasattr(obj, "load_partition")


def _check_size(label: str, n: int, example_bytes: int) -> None:
    total = n * example_bytes
    if total > MAX_BYTES:
        raise DataError(
            f"{label}: {n} examples of {example_bytes} bytes make {total / 2**30:.1f} GiB of tensors, more "
            f"than the {MAX_BYTES / 2**30:.0f} GiB fedcli holds in memory; store images as uint8, or use a "
            'subset (docs/your-data.md, "Memory").'
        )


def torch_arrays(ds: Any, label: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of a map-style Dataset: TensorDataset's tensors directly, else each example read once."""
    n = len(ds)
    if n == 0:
        raise DataError(f"{label}: the dataset must hold at least one example; got 0.")
    tensors = getattr(ds, "tensors", None)
    if isinstance(tensors, tuple) and all(isinstance(t, Tensor) for t in tensors):
        if len(tensors) < 2:
            raise DataError(
                f"{label}: examples must be (x, y) pairs; it has {len(tensors)} tensor(s) and no labels. "
                "Add the labels: TensorDataset(x, y)."
            )
        xs, ys = tensors[0].detach().cpu(), tensors[1].detach().cpu()
        _check_size(label, n, xs[0].numel() * xs.element_size())
        return xs.numpy(), ys.numpy()
    first = ds[0]
    if not isinstance(first, (tuple, list)) or len(first) < 2:
        raise DataError(
            f"{label}: ds[i] must return an (x, y) pair; ds[0] is {type(first).__name__}. Return the "
            "label with each example."
        )
    x0 = torch.as_tensor(np.array(first[0]))
    _check_size(label, n, x0.numel() * x0.element_size())
    getitems = getattr(ds, "__getitems__", None)
    rows = getitems(list(range(n))) if callable(getitems) else [ds[i] for i in range(n)]  # once, at load
    try:
        xs = np.stack([np.asarray(r[0]) for r in rows])
        values = [np.asarray(r[1]).item() for r in rows]
    except (ValueError, TypeError) as exc:
        raise DataError(
            f"{label}: examples must share one shape and have one scalar label each ({exc}); "
            "resize or pad them in the dataset."
        ) from None
    kinds = [_kind(v) for v in values]
    row = next((i for i, k in enumerate(kinds) if k not in ("int", "float") or k != kinds[0]), None)
    if row is not None:  # numpy would make [1, 0.5] floats (regression) and [True, 2] integers
        first = f" (example 0: {type(values[0]).__name__} {values[0]!r})" if row else ""
        raise DataError(
            f"{label}: labels must all be integers (classes) or all floats (regression targets); got "
            f"{type(values[row]).__name__} {values[row]!r} at example {row}{first}. Return one kind of "
            "label; fedcli casts none."
        )
    ys = np.asarray(values)
    pil = hasattr(first[0], "getbands")  # PIL images (a torchvision dataset without transform): [H, W, C]
    return (xs.transpose(0, 3, 1, 2).copy() if pil and xs.ndim == 4 else xs), ys


def hf_arrays(
    ds: Any, x: str | Sequence[str] | None, y: str, client: Any, label: str
) -> tuple[np.ndarray, np.ndarray, Any]:
    """(x, y, client) of a Hugging Face Dataset read as NumPy columns (batched, no per-row Python)."""
    columns = list(ds.column_names)
    if y not in columns:
        raise DataError(
            f"{label}: no label column {y!r}; columns are {columns[:8]}. Pass y='<label column>'."
        )
    if len(ds) == 0:
        raise DataError(f"{label}: the dataset must hold at least one example; got 0.")
    if x is None:
        rest = [c for c in columns if c not in (y, client if isinstance(client, str) else None)]
        if not rest:
            raise DataError(f"{label}: no input column besides {y!r}; pass x='<input column>'.")
        x = rest[0]
    names = [x] if isinstance(x, str) else list(x)
    missing = [c for c in names + ([client] if isinstance(client, str) else []) if c not in columns]
    if missing:
        raise DataError(f"{label}: no column(s) {missing}; columns are {columns[:8]}.")
    table = ds.with_format("numpy")[0 : len(ds)]
    parts = [np.asarray(table[c]) for c in names]
    if len(parts) == 1 and type(ds.features.get(names[0])).__name__ == "Image" and parts[0].ndim == 4:
        parts = [parts[0].transpose(0, 3, 1, 2)]  # an Image column reads as [N, H, W, C]: channels first
    if any(p.dtype.kind not in "biuf" for p in parts):
        raise DataError(
            f"{label}: input column(s) {names} must be numeric arrays; decode images or text first."
        )
    xs = (
        parts[0]
        if len(parts) == 1 and parts[0].ndim > 1
        else np.stack([p.reshape(len(p), -1) for p in parts], 1)
    )
    xs = xs.reshape(len(xs), -1) if len(parts) > 1 else xs
    if xs.ndim == 1:
        xs = xs[:, None]
    if xs.dtype.kind in "iu" and xs.ndim >= 3 and xs.min(initial=0) >= 0 and xs.max(initial=0) <= 255:
        xs = xs.astype(
            np.uint8
        )  # integer images (HF stores them as int64): scaled by 1/255 like an .npz's uint8
    elif xs.dtype.kind != "f" or xs.dtype == np.float64:
        xs = xs.astype(np.float32)
    _check_size(label, len(xs), xs[0].nbytes)
    owners = np.asarray(table[client]) if isinstance(client, str) else client
    return xs, np.asarray(table[y]), owners


def client_ids(owners: Any, n: int, label: str) -> np.ndarray:
    """One owner per example as 0..K-1 (sorted order of the ids); ids must be integers or names, of one kind.

    Refused, never cast: float ids (0.5 and 0.7 are not two writers' numbers), booleans, and a
    sequence that mixes kinds (`[1, "1"]` became one client).
    """
    if isinstance(owners, Tensor):
        owners = owners.detach().cpu().numpy()
    if (
        not isinstance(owners, np.ndarray)
        and isinstance(owners, Sequence)
        and not isinstance(owners, (str, bytes))
    ):
        kinds = [_kind(v) for v in owners]
        row = next((i for i, k in enumerate(kinds) if k not in ("int", "str")), None)
        row = next((i for i, k in enumerate(kinds) if k != kinds[0]), None) if row is None else row
        if row is not None:
            first = f" (example 0: {type(owners[0]).__name__} {owners[0]!r})" if row else ""
            raise DataError(
                f"{label}: client ids must all be integers or all be names (str); got "
                f"{type(owners[row]).__name__} {owners[row]!r} at example {row}{first}. Give each client "
                "one integer id or one name; fedcli casts none."
            )
    ids = np.asarray(owners)
    if ids.ndim != 1 or len(ids) != n:
        raise DataError(
            f"{label}: client must give one id per example (length {n}); got shape {ids.shape}. "
            "Give an id per example, or a partition (a list of index arrays)."
        )
    check_client_ids(ids, label, "client")
    return np.unique(ids, return_inverse=True)[1].astype(np.int64)


def _kind(value: Any) -> str:
    """int, float, bool, str or other: the kind of one label or client id."""
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if isinstance(value, (int, np.integer)):
        return "int"
    if isinstance(value, (float, np.floating)):
        return "float"
    return "str" if isinstance(value, str) else "other"


def _first_non_integer(values: np.ndarray) -> int:
    """The first position of a float array whose value is not a whole number (NaN, inf), else 0."""
    odd = np.flatnonzero(~np.isfinite(values) | (values != np.round(values)))
    return int(odd[0]) if len(odd) else 0


def check_client_ids(ids: np.ndarray, label: str, column: str) -> None:
    """Client ids as read (an array, a table column) must be integers or text: DataError naming an example.

    Float ids are refused even when whole (1.0): a float column is how a table says the ids were
    computed, or had missing values, and casting would merge 1.2 and 1.5 or name a client "1.0".
    """
    if ids.dtype.kind in "iuUS" or (ids.dtype.kind == "O" and all(isinstance(v, str) for v in ids)):
        return
    if ids.dtype.kind == "f":
        row = _first_non_integer(ids)
    elif ids.dtype.kind == "O":
        row = next(i for i, v in enumerate(ids) if not isinstance(v, str))
    else:
        row = 0
    value = ids[row].item() if isinstance(ids[row], np.generic) else ids[row]
    raise DataError(
        f"{label}: {column} must hold integer ids or names; got dtype {ids.dtype} (e.g. {value!r} at "
        f"row {row}). Save the ids as integers or text; fedcli casts none."
    )


def partition_ids(partition: Any, n: int, label: str) -> np.ndarray:
    """Client k -> indices as one owner per example (-1 = no client); an example in two clients is refused."""
    owner = np.full(n, -1, dtype=np.int64)
    for k, part in enumerate(partition):
        raw = np.asarray(part.detach().cpu() if isinstance(part, Tensor) else part).reshape(-1)
        if raw.size and raw.dtype.kind not in "iu":
            example = raw[_first_non_integer(raw) if raw.dtype.kind == "f" else 0]
            example = example.item() if isinstance(example, np.generic) else example
            raise DataError(
                f"{label}: partition client {k} must be integer example indices; got dtype {raw.dtype} "
                f"(e.g. {example!r}). Give integer arrays; fedcli truncates no index."
            )
        ix = raw.astype(np.int64)
        if len(ix) and (ix.min() < 0 or ix.max() >= n):
            raise DataError(
                f"{label}: partition client {k} has index {int(ix.max() if ix.max() >= n else ix.min())} "
                f"outside 0..{n - 1}; give indices into the dataset."
            )
        if (owner[ix] >= 0).any() or len(np.unique(ix)) != len(ix):
            raise DataError(
                f"{label}: partition client {k} repeats an example that another client (or itself) "
                "holds; give disjoint index arrays."
            )
        owner[ix] = k
    return owner


def partitioner_dataset(partitioner: Any) -> Any:
    if not getattr(partitioner, "is_dataset_assigned", lambda: False)():
        raise ConfigError(
            "the flwr-datasets partitioner has no dataset; set partitioner.dataset = ds, or pass "
            "data=ds, partition=partitioner."
        )
    return partitioner.dataset


def flwr_partition(partitioner: Any, ds: Any) -> list[np.ndarray]:
    """A flwr-datasets partitioner's partitions as index arrays into `ds` (read from a row-number column)."""
    if not is_hf(ds):
        raise ConfigError(
            "a flwr-datasets partitioner partitions a Hugging Face Dataset; got "
            f"{type(ds).__name__}. Convert it with datasets.Dataset.from_dict."
        )
    # a deep copy (its random state and any partitions it made included, its dataset left out) given the same
    # rows plus their numbers: flwr-datasets assigns a dataset only once, and the user's partitioner is left
    # as it was, so its own partitions are these
    if "_dataset" not in vars(partitioner):
        raise ConfigError(
            f"the flwr-datasets partitioner {type(partitioner).__name__} keeps its dataset where "
            "fedcli does not look; pass its partitions as partition=[indices, ...] instead."
        )
    own = vars(partitioner)["_dataset"]
    vars(partitioner)["_dataset"] = None
    try:
        mine = copy.deepcopy(partitioner)
    finally:
        vars(partitioner)["_dataset"] = own
    mine.dataset = ds.add_column("__fedcli_row", np.arange(len(ds)))
    return [
        np.asarray(mine.load_partition(k).with_format("numpy")[:]["__fedcli_row"], dtype=np.int64)
        for k in range(mine.num_partitions)
    ]
