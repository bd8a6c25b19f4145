"""Bring your own data: a .npz, .csv or .parquet file becomes a task (`--data FILE --model M`).

Layout (documented in `fedcli train --help` by the CLI; checked here, with clear errors):

- `.npz`: arrays `x` [N, ...] (float, or uint8 images scaled by 1/255) and `y` [N];
  optional `client` [N] (ints or strings: the natural owner of each example) and optional
  `x_test` / `y_test`.
- `.csv` / `.parquet`: one row per example; column `y` (the target), optional column
  `client`, optional column `split` with values `train` / `test`; every other column is a
  numeric feature, in file order.

Targets: an integer `y` (>= 0) is a class label (classification with max(y)+1 classes, at
most `MAX_CLASSES`); a float `y` is a regression target (1/2 squared error). Examples with the same `client`
value form one natural client, clients in sorted order of the value (use
--scheme natural); without a `client` column, partition with iid/dirichlet/... When no test
examples are given, a fixed 20 % of the rows (the last of `np.random.default_rng(0)
.permutation(N)`) is held out as the test split.

Models: `linear` (linear regression, or softmax regression for classes), `logreg`
(classification only), `mlp` (two hidden layers of 200, ReLU), `cnn` (the McMahan et al.
CNN sized to the images; needs `x` of shape [N, H, W] or [N, C, H, W] in an .npz).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch
from torch import Tensor, nn

from fedcli.datasets import models
from fedcli.datasets.sources import holdout
from fedcli.datasets.tasks import Task, TaskData, TaskOptions, fingerprint
from fedcli.errors import ConfigError, DataError

MODELS = ("linear", "logreg", "mlp", "cnn")
SUFFIXES = (".npz", ".csv", ".parquet")
TEST_FRACTION = 0.2
MAX_CLASSES = (
    100_000  # class labels 0..C-1 with C at most this: the output layer has C units (10^12 asked 800 TB)
)
Arrays = dict[str, np.ndarray]


def read_npz(path: Path) -> Arrays:
    """Arrays x, y and the optional client, x_test, y_test of an .npz (no pickles)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {k: archive[k] for k in archive.files}
    except (OSError, ValueError, EOFError) as exc:
        why = (
            "it is not a NumPy archive, or it holds Python objects (never unpickled)"
            if "pickle" in str(exc)
            else exc
        )
        raise DataError(
            f"{path} cannot be read as .npz ({why}); save plain arrays with numpy.savez."
        ) from None
    missing = [k for k in ("x", "y") if k not in arrays]
    if missing:
        raise DataError(f"{path} lacks array(s) {', '.join(missing)}; it needs x [N, ...] and y [N].")
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise DataError(f"{path} has only one of x_test / y_test; give both or neither.")
    return arrays


def read_table(path: Path) -> Arrays:
    """A .csv / .parquet table as arrays x (feature columns), y, and optional client / split."""
    import pandas as pd

    try:
        frame = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    except (OSError, ValueError, ImportError, pd.errors.ParserError) as exc:
        raise DataError(
            f"{path} cannot be read as {path.suffix[1:]} ({exc}); it needs a header row with a "
            "column y and numeric feature columns."
        ) from None
    if frame.empty:
        raise DataError(
            f"{path.name}: the table must hold at least one example row; got {len(frame)} rows and "
            f"columns {list(map(str, frame.columns[:8]))}. Is the file empty or truncated?"
        )
    if path.suffix == ".csv":  # pandas renames a repeated column to `y.1` and an unnamed one to `Unnamed: 0`
        header = pd.read_csv(path, nrows=1, header=None, dtype=str, keep_default_na=False).iloc[0].tolist()
        twice = next((c for i, c in enumerate(header) if c in header[:i]), None)
        if twice is not None:
            raise DataError(
                f"{path.name}: column {twice!r} appears twice in the header (pandas would use the second "
                f"as a feature named {twice}.1); rename or drop one."
            )
        blank = next((i for i, c in enumerate(header) if not c.strip()), None)
        if blank is not None:
            raise DataError(
                f"{path.name}: column {blank + 1} of the header has no name (pandas' to_csv writes its "
                "index that way, which would become a feature); save with index=False, or name it."
            )
    if "y" not in frame.columns:
        raise DataError(f"{path} has no column 'y'; columns are {', '.join(map(str, frame.columns[:8]))}.")
    features = [c for c in frame.columns if c not in ("y", "client", "split")]
    bad = [c for c in features if not pd.api.types.is_numeric_dtype(frame[c])]
    if not features or bad:
        raise DataError(
            f"{path}: feature columns must be numeric; {'none given' if not features else f'not numeric: {bad[:3]}'}."
        )
    arrays = {"x": frame[features].to_numpy(dtype=np.float32), "y": frame["y"].to_numpy()}
    if "client" in frame.columns:
        arrays["client"] = frame["client"].to_numpy()
    if "split" in frame.columns:
        split = frame["split"].astype(str).to_numpy()
        if not np.isin(split, ("train", "test")).all():
            raise DataError(f"{path}: column 'split' must hold 'train' or 'test'.")
        test = split == "test"
        arrays = {
            **{k: v[~test] for k, v in arrays.items()},
            "x_test": arrays["x"][test],
            "y_test": arrays["y"][test],
        }
    return arrays


def check_arrays(path: Path, arrays: Arrays) -> None:
    """Shapes, dtypes and values of the arrays as read, before any split: never drop a row silently.

    Raises:
        DataError: naming the file, the array, what it must be, what it is and the fix.
    """
    name = path.name
    for key in ("x", "x_test"):
        if key in arrays and arrays[key].dtype.kind not in "biuf":
            raise DataError(
                f"{name}: {key} must be numeric (int, uint8 or float); got dtype {arrays[key].dtype}. "
                "Encode text or categories as numbers first."
            )
    x, y = arrays["x"], arrays["y"]
    if x.ndim < 2:
        raise DataError(
            f"{name}: x must be [N, features...] (2-D or more); got shape {x.shape}. "
            "Reshape one feature per example to [N, 1]."
        )
    if len(x) == 0:
        raise DataError(f"{name}: x must hold at least one example; got 0 rows. Is the file empty?")
    if x[0].size == 0:
        raise DataError(f"{name}: x must have at least one feature per example; got shape {x.shape}.")
    checks = [("y", y, len(x), "x")]
    if "client" in arrays:
        checks.append(("client", arrays["client"], len(x), "x"))
    if "x_test" in arrays:
        x_test = arrays["x_test"]
        if x_test.shape[1:] != x.shape[1:]:
            raise DataError(
                f"{name}: x_test must have the example shape of x {x.shape[1:]}; got {x_test.shape[1:]}. "
                "Save both with the same features."
            )
        if len(x_test) == 0:
            raise DataError(
                f"{name}: x_test must hold at least one example; got 0. Leave x_test/y_test out to "
                f"hold out {TEST_FRACTION:.0%} of x."
            )
        checks.append(("y_test", arrays["y_test"], len(x_test), "x_test"))
    elif len(x) < 3:
        raise DataError(
            f"{name}: x must hold at least 3 examples to hold out a test split; got {len(x)}. "
            "Add rows, or give x_test and y_test."
        )
    for key, values, rows, of in checks:
        if values.ndim != 1 or len(values) != rows:
            raise DataError(
                f"{name}: {key} must have one entry per row of {of} (shape [{rows}]); got shape "
                f"{values.shape}. Save {key} with the same number of rows as {of}; no row is dropped."
            )
    client = arrays.get("client")
    if client is not None and client.dtype.kind == "f" and np.isnan(client).any():
        raise DataError(
            f"{name}: client must name an owner for every row; got {int(np.isnan(client).sum())} missing. "
            "Fill them, or drop the client column and partition with --scheme iid/dirichlet."
        )
    if client is not None:
        from fedcli.datasets.yours.convert import check_client_ids

        check_client_ids(client, name, "client")  # 1.5 and 1.2 are not one client, nor is 1.0 a name
    for key in ("x", "x_test"):
        if key in arrays and arrays[key].dtype.kind == "f" and not np.isfinite(arrays[key]).all():
            bad = int((~np.isfinite(arrays[key])).any(axis=tuple(range(1, arrays[key].ndim))).sum())
            raise DataError(
                f"{name}: {key} must be finite; got NaN or inf in {bad} rows. Impute or remove them "
                "before training; fedcli drops no rows."
            )


def has_client(path: Path) -> bool | None:
    """Whether the file names an owner per example (array / column `client`), read cheaply from
    the archive listing or the header; None when it cannot be read (loading reports why)."""
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                return "client" in archive.files
        if path.suffix == ".csv":
            import pandas as pd

            return "client" in pd.read_csv(path, nrows=0).columns
        import pyarrow.parquet as pq

        return "client" in pq.read_schema(path).names
    except (OSError, ValueError, EOFError, ImportError):
        return None


def _targets(path: Path, y: np.ndarray, name: str = "y") -> tuple[np.ndarray, str]:
    if y.ndim != 1:
        raise DataError(f"{path.name}: {name} must be one target per example [N]; got shape {y.shape}.")
    if np.issubdtype(y.dtype, np.integer):
        if len(y) and y.min() < 0:
            raise DataError(
                f"{path.name}: class labels {name} must be >= 0; got {int(y.min())}. Map labels to 0..C-1."
            )
        if len(y) and int(y.max()) >= MAX_CLASSES:
            raise DataError(
                f"{path.name}: class labels {name} must be < {MAX_CLASSES} (the model has one output per "
                f"class 0..max); got {int(y.max())}. Map labels to 0..C-1, e.g. with "
                "numpy.unique(y, return_inverse=True)."
            )
        return y.astype(np.int64), "classification"
    if np.issubdtype(y.dtype, np.floating):
        if not np.isfinite(y).all():
            raise DataError(
                f"{path.name}: {name} must be finite; got NaN or inf in {int((~np.isfinite(y)).sum())} "
                "rows. Fill or remove them; fedcli drops no rows."
            )
        return y.astype(np.float32), "regression"
    raise DataError(
        f"{path.name}: {name} must be integer class labels or float targets; got dtype {y.dtype}. "
        "Encode class names as 0..C-1."
    )


def _split(arrays: Arrays) -> Arrays:
    """Hold out a fixed 20 % as the test split when none is given."""
    if "x_test" in arrays:
        return arrays
    n = len(arrays["y"])
    keep, held = holdout(n, int(round(TEST_FRACTION * n)))
    out = {k: v[keep] for k, v in arrays.items()}
    return {**out, "x_test": arrays["x"][held], "y_test": arrays["y"][held]}


def _natural(client: np.ndarray | None, unowned: bool = False) -> tuple[list[np.ndarray], list[str]]:
    if client is None:
        return [], []
    values = np.unique(client)
    if unowned:  # -1: no client of a given partition holds the example (datasets/yours/data.py)
        values = values[values >= 0]
    return [np.flatnonzero(client == v) for v in values], [str(v) for v in values]


def _model_factory(
    path: Path, model: str, x: np.ndarray, kind: str, num_classes: int
) -> Callable[[], nn.Module]:
    if model not in MODELS:
        raise ConfigError(f"--model must be one of {', '.join(MODELS)} for --data; got {model!r}.")
    features = int(np.prod(x.shape[1:]))
    outputs = num_classes if kind == "classification" else 1
    if model == "logreg" and kind != "classification":
        raise ConfigError(
            f"--model logreg needs integer class labels y; {path} has float targets. Use linear or mlp."
        )
    if model == "cnn":
        if x.ndim not in (3, 4):
            raise ConfigError(
                f"--model cnn needs images x [N, H, W] or [N, C, H, W]; {path} has x {x.shape}."
            )
        channels, size = (1, x.shape[1:3]) if x.ndim == 3 else (x.shape[1], x.shape[2:4])
        shape = (int(size[0]), int(size[1]))
        build: Callable[[], nn.Module] = lambda: models.McMahanCNN(outputs, channels, shape)  # noqa: E731
    elif model == "mlp":
        build = lambda: models.MLP(features, (200, 200), outputs)  # noqa: E731
    else:
        build = lambda: models.Linear(features, outputs)  # noqa: E731
    return build if kind == "classification" else (lambda: models.SqueezeOutput(build()))


def _prepare(x: np.ndarray) -> Callable[[Tensor], Tensor]:
    scale = 1.0 / 255.0 if x.dtype == np.uint8 else 1.0
    add_channel = x.ndim == 3

    def prepare(batch: Tensor) -> Tensor:
        out = batch.to(torch.float32) * scale
        return out.unsqueeze(-3) if add_channel else out

    return prepare


def byo_task(path: Path | str, model: str) -> Task:
    """Read and validate a bring-your-own data file; return it as a Task named byo-<stem>.

    A data reference instead of a file (`python:<name>@<hash>` for an object given to the Python
    API, `pkg.mod:fn` / `file.py:fn` for a function: datasets/yours/data.py) becomes a Task named
    byo-<name> through the same checks.
    """
    from fedcli.datasets.yours import data as user_data

    if user_data.is_data_ref(str(path)):
        user = user_data.lookup(str(path))
        return arrays_task(
            Path(f"byo-{user.name}"),
            user.arrays(),
            model,
            name=f"byo-{user.name}",
            source=user.source or str(path),
            record=user.record,
        )
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise ConfigError(
            f"--data must be a {', '.join(SUFFIXES)} file or pkg.module:function; got {path.name!r}."
        )
    if not path.is_file():
        raise ConfigError(f"--data file {path} does not exist.")
    arrays = read_npz(path) if path.suffix == ".npz" else read_table(path)
    return arrays_task(path, arrays, model, name=f"byo-{path.stem}", source=str(path.resolve()))


def arrays_task(
    path: Path, arrays: Arrays, model: str, *, name: str, source: str, record: Mapping[str, str] | None = None
) -> Task:
    """Check, split and type the arrays of a data file or object (`path.name` names it in errors); a Task.

    For a data object (`record` given), a `client` value of -1 (an example no client of its partition
    holds) belongs to no client.
    """
    check_arrays(path, arrays)
    arrays = _split(arrays)
    x, x_test = np.asarray(arrays["x"]), np.asarray(arrays["x_test"])
    y, kind = _targets(path, np.asarray(arrays["y"]))
    y_test, test_kind = _targets(path, np.asarray(arrays["y_test"]), name="y_test")
    if test_kind != kind:
        wanted = "integer class labels" if kind == "classification" else "float targets"
        raise DataError(
            f"{path.name}: y_test must be {wanted} like y; got dtype {arrays['y_test'].dtype}. "
            "Save y and y_test with one dtype."
        )
    num_classes = int(max(y.max(), y_test.max(initial=0))) + 1 if kind == "classification" else 0
    natural, names = _natural(arrays.get("client"), unowned=record is not None)
    factory = _model_factory(path, model, x, kind, num_classes)
    xt, yt = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)
    data = TaskData(
        x=xt,
        y=yt,
        client_indices=natural,
        client_names=names,
        test_x=torch.from_numpy(x_test),
        test_y=torch.from_numpy(y_test),
        fingerprint=fingerprint(xt, yt),
        num_classes=num_classes or None,
    )

    def load(options: TaskOptions) -> TaskData:
        return data

    return Task(
        name=name,
        description=f"your data {path.name}: {len(y)} examples, {kind}",
        source=source,
        offline=True,
        kind=kind,
        models=MappingProxyType({model: factory}),
        default_model=model,
        load=load,
        prepare=_prepare(x),
        record=dict(record or {}),
    )
