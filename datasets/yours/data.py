"""A user's data objects as tasks: a torch Dataset, a Hugging Face Dataset, a flwr-datasets partition.

`data_ref(data, ...)` turns what a user hands fedcli (Python API) into the string a run's config
records as `data.file` (docs/your-data.md):

- a path (.npz/.csv/.parquet) or a `pkg.mod:fn` / `path/to/file.py:fn` reference: returned as is;
  the engine reads the file, or imports the module and calls `fn()` (no arguments), in every
  process that needs the data (the process back end's workers, `--resume`, `fedcli evaluate`);
- a map-style torch `Dataset` (`ds[i] -> (x, y)`), a Hugging Face `datasets.Dataset` or a
  flwr-datasets `Partitioner`: materialised once here as tensors (`UserData`), checked, registered
  in this process and named `python:<name>@<hash16>` (hash of every tensor and the clients).

Each becomes a `Task` named `byo-<name>` through datasets/yours/files.py (`arrays_task`), with the same
checks, held-out split and built-in models as a data file. The whole data set is held in memory
as tensors so that batches are gathered by index on the device (the vectorised data path, no
per-example Python in training); materialising reads each example once. Above `MAX_BYTES` of
training tensors it is refused (DataError naming the size and the fix): there is no streaming path.
Reading each kind of object into arrays is in datasets/yours/convert.py.

No import of `datasets` (Hugging Face) or `flwr_datasets` here: objects are recognised by their
methods, so fedcli works without the `[hf]` extra and a user's objects need no version of ours.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedcli.datasets.yours.convert import (
    check_names,
    client_ids,
    flwr_partition,
    hf_arrays,
    is_hf,
    is_partitioner,
    is_torch_dataset,
    partition_ids,
    partitioner_dataset,
    slugify,
    torch_arrays,
)
from fedcli.datasets.yours.user_code import import_file, remember_import
from fedcli.errors import ConfigError, DataError

PYTHON_PREFIX = "python:"
_CALLABLE = re.compile(r"(?P<module>[A-Za-z_][\w.]*|.+\.py):(?P<fn>[A-Za-z_]\w*)")
_REGISTRY: dict[str, UserData] = {}  # python:<name>@<hash> -> the materialised data of this process
_LOADED: dict[str, UserData] = {}  # pkg.mod:fn -> its materialised data (called once per process)


@dataclass(frozen=True)
class UserData:
    """A user's data object materialised as tensors (picklable: crosses to the process back end's workers)."""

    name: str  # slug; the task is byo-<name>
    x: Tensor  # [N, ...] inputs (uint8 images or float features)
    y: Tensor  # [N] class labels (int64) or float targets
    client: np.ndarray | None  # [N] owner per example (-1 = none), or None = partition by scheme
    x_test: Tensor | None = None
    y_test: Tensor | None = None
    source: str = ""  # what it was made from, for `fedcli list`-style descriptions
    record: Mapping[str, str] = field(default_factory=dict)  # recorded under data.* (source_sha256 ...)

    def digest(self) -> str:
        """sha256 over every tensor and the client ids: the part of the reference that names the content."""
        h = hashlib.sha256()
        for part in (self.x, self.y, self.x_test, self.y_test):
            if part is not None:
                h.update(str((tuple(part.shape), str(part.dtype))).encode())
                h.update(part.contiguous().numpy().tobytes())
        if self.client is not None:
            h.update(np.ascontiguousarray(self.client, dtype=np.int64).tobytes())
        return h.hexdigest()

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays datasets/yours/files.py checks and splits (the layout of an .npz)."""
        out = {"x": self.x.numpy(), "y": self.y.numpy()}
        if self.client is not None:
            out["client"] = self.client
        if self.x_test is not None and self.y_test is not None:
            out |= {"x_test": self.x_test.numpy(), "y_test": self.y_test.numpy()}
        return out


def is_data_ref(value: str) -> bool:
    """Whether data.file names a data object (`python:...`) or a function (`pkg.mod:fn`, `file.py:fn`)."""
    return value.startswith(PYTHON_PREFIX) or (
        _CALLABLE.fullmatch(value) is not None and not value.endswith((".npz", ".csv", ".parquet"))
    )


def data_ref(
    data: Any,
    *,
    name: str | None = None,
    client: Any = None,
    partition: Any = None,
    x: str | Sequence[str] | None = None,
    y: str = "label",
    test: Any = None,
) -> str:
    """Return the `data.file` value of a user's data (module docstring); objects are registered here.

    Args:
        data: A path, a `pkg.mod:fn` string, a torch Dataset, an HF Dataset or a flwr-datasets Partitioner.
        name: The data's name (task `byo-<name>`); default the object's class name or the function's.
        client: Per-example client ids (a sequence of length N), or an HF column name.
        partition: Client k -> example indices (a list of index arrays), or a flwr-datasets Partitioner.
        x: HF input column (or numeric columns stacked as features); default the first column not `y`.
        y: HF label column (default "label").
        test: Held-out data of the same form (default: 20 % of the rows, as for files).

    Raises:
        DataError / ConfigError: one line naming what is wrong and the fix (nothing is registered).
    """
    if isinstance(data, (str, Path)):
        if any(v is not None for v in (client, partition, x, test)) or name is not None:
            raise ConfigError(
                f"data {str(data)!r} is a file or function reference; client/partition/x/test/name "
                "apply to data objects only. Return a dict with those keys from your function."
            )
        return normalise(str(data))
    user = materialise(data, name=name, client=client, partition=partition, x=x, y=y, test=test)
    ref = f"{PYTHON_PREFIX}{user.name}@{user.digest()[:16]}"
    _REGISTRY[ref] = user
    return ref


def normalise(value: str) -> str:
    """A data file, or the file of a `file.py:fn` reference, as an absolute path (resume from any folder).

    An empty value stays empty (`--data "$FILE"` with FILE unset was read as the working folder):
    the config's validation refuses it.
    """
    if not value.strip():
        return value
    if value.startswith(PYTHON_PREFIX) or not is_data_ref(value):
        return str(Path(value).expanduser().resolve()) if Path(value).expanduser().exists() else value
    source, _, fn = value.rpartition(":")
    return f"{Path(source).expanduser().resolve()}:{fn}" if source.endswith(".py") else value


def register(ref: str, user: UserData) -> None:
    """Register data under its reference (the process back end's workers receive it this way)."""
    (_REGISTRY if ref.startswith(PYTHON_PREFIX) else _LOADED)[ref] = user


def shipped(ref: str | None) -> UserData | None:
    """The materialised data of a data reference this process holds (for a worker), None for a file."""
    if ref is None or not is_data_ref(ref):
        return None
    return _REGISTRY.get(ref) or _LOADED.get(ref)


def lookup(ref: str) -> UserData:
    """The materialised data of a data reference: registered (`python:`) or loaded by calling the function."""
    if ref.startswith(PYTHON_PREFIX):
        if ref not in _REGISTRY:
            raise ConfigError(
                f"data {ref!r} is a Python object given to another process; pass the same object to "
                "fedcli.train again (resume included), or save it with numpy.savez and use --data FILE."
            )
        return _REGISTRY[ref]
    if ref not in _LOADED:
        fn, digest = load_function(ref)
        try:
            made = fn()
        except Exception as exc:  # noqa: BLE001 - the user's code: one line, not a traceback
            raise DataError(
                f"data function {ref} raised {type(exc).__name__}: {exc}; fix it and rerun."
            ) from None
        options = dict(made) if isinstance(made, Mapping) else {"data": made}
        if "data" not in options:
            raise DataError(
                f"data function {ref} returned a dict without 'data'; return the dataset, or "
                "{'data': ds, 'client': ..., 'partition': ..., 'x': ..., 'y': ..., 'test': ...}."
            )
        unknown = sorted(set(options) - {"data", "name", "client", "partition", "x", "y", "test"})
        if unknown:
            raise DataError(
                f"data function {ref} returned unknown key(s) {unknown}; use data, name, client, "
                "partition, x, y, test."
            )
        obj = options.pop("data")
        module, _, fn_name = ref.rpartition(":")
        options.setdefault(
            "name", f"{Path(module).stem if module.endswith('.py') else module.rpartition('.')[2]}-{fn_name}"
        )
        user = materialise(obj, **options)
        _LOADED[ref] = UserData(
            user.name,
            user.x,
            user.y,
            user.client,
            user.x_test,
            user.y_test,
            source=ref,
            record={"source": ref, "source_sha256": digest},
        )
    return _LOADED[ref]


def load_function(ref: str) -> tuple[Callable[[], Any], str]:
    """Import `pkg.mod:fn` or `path/file.py:fn`; return (fn, sha256 of the module's source file).

    A module name is looked up with the working folder appended to sys.path (after installed
    packages, so a local folder never shadows one), as `python -m` would find it.
    """
    match = _CALLABLE.fullmatch(ref)
    if match is None:
        raise ConfigError(f"data {ref!r} must be pkg.module:function or path/to/file.py:function.")
    module_name, fn_name = match["module"], match["fn"]
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).expanduser().resolve()
            if not path.is_file():
                raise ConfigError(f"data function file {path} does not exist; give path/to/file.py:function.")
            module = import_file(path)
        else:
            cwd = str(Path.cwd())
            added = cwd not in sys.path
            if added:
                sys.path.append(cwd)
            try:
                module = importlib.import_module(module_name)
            finally:
                if added:
                    sys.path.remove(cwd)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - an import of the user's code: one line
        raise ConfigError(
            f"data {ref}: cannot import {module_name} ({type(exc).__name__}: {exc}); check the "
            "module is importable from here (installed, or in the working folder)."
        ) from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError(
            f"data {ref}: {module_name} has no function {fn_name!r}; name a function that returns "
            "the dataset."
        )
    source = getattr(module, "__file__", None)
    digest = hashlib.sha256(Path(source).read_bytes()).hexdigest() if source else ""
    remember_import(ref, digest)  # imported here: later gates of the same code pass (datasets/yours/trust.py)
    return fn, digest


def materialise(
    data: Any,
    *,
    name: str | None = None,
    client: Any = None,
    partition: Any = None,
    x: str | Sequence[str] | None = None,
    y: str = "label",
    test: Any = None,
) -> UserData:
    """One data object as tensors (`data_ref` documents the arguments)."""
    check_names(name=name, x=x, y=y)
    if is_partitioner(partition) or is_partitioner(data):
        partitioner = partition if is_partitioner(partition) else data
        if not is_partitioner(partition):  # data is the partitioner: its dataset is the data
            data = partitioner_dataset(partitioner)
        partition = flwr_partition(partitioner, data)
    if is_hf(data):
        label = (
            f"Hugging Face Dataset {name or slugify(getattr(data.info, 'dataset_name', None) or 'dataset')}"
        )
        xs, ys, owners = hf_arrays(data, x, y, client, label)
        kind = "hf"
    elif is_torch_dataset(data):
        label = f"torch Dataset {type(data).__name__}"
        if x is not None or y != "label":
            raise ConfigError(
                f"{label}: x= and y= name Hugging Face columns; a torch Dataset gives (x, y) pairs."
            )
        xs, ys = torch_arrays(data, label)
        owners, kind = client, "torch"
    else:
        raise ConfigError(
            f"data must be a file path, a pkg.mod:fn string, a torch Dataset, a Hugging Face Dataset "
            f"or a flwr-datasets Partitioner; got {type(data).__name__}."
        )
    if owners is not None and partition is not None:
        raise ConfigError(f"{label}: give client ids or a partition, not both.")
    n = len(ys)
    owner = client_ids(owners, n, label) if owners is not None else None
    if partition is not None:
        owner = partition_ids(partition, n, label)
    x_test = y_test = None
    if test is not None:
        tx, ty = (
            hf_arrays(test, x, y, None, label)[:2] if is_hf(test) else torch_arrays(test, f"{label} (test)")
        )
        x_test, y_test = torch.from_numpy(tx), torch.from_numpy(ty)
    default_name = (getattr(data.info, "dataset_name", None) or "hf") if kind == "hf" else type(data).__name__
    return UserData(
        slugify(name or default_name),
        torch.from_numpy(xs),
        torch.from_numpy(ys),
        owner,
        x_test,
        y_test,
        source=label,
    )
