"""The trained global model as a plain `nn.Module` that takes the data set's stored inputs.

`model.pt` holds the global parameters, not a module: fedcli trains through
`torch.func.functional_call`. `served_model(...)` rebuilds the task's module, loads the
parameters and wraps it with the task's `prepare` (stored inputs -> model inputs, e.g.
uint8 pixels -> floats in [0, 1]), so that `module(x)` on rows of the data set gives the
logits fedcli evaluates.

The MLflow mirror logs it as the run's MLflow model without pickling code
(docs/operations.md, "Security"): a pyfunc model from code (tracking/mlflow/model.py,
MLflow's "models from code") whose one artifact, `served.pt`, holds the parameters and the
names of the task and model in plain containers (`write_served`); loading it
(`load_served`, `torch.load(weights_only=True)`) rebuilds the module through the task
registry, the importable model factory (your own model: by importing its module again, with the
factory arguments the run recorded, only once the loader allowed that code: datasets/yours/trust.py;
BatchNorm statistics from model.pt's `buffers`). `mlflow.pyfunc.load_model(uri).predict(rows)` gives
the logits; `.unwrap_python_model().module` is the `nn.Module`.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

SERVED_FORMAT = 1  # served.pt: {"format", "params", "task", "model", "data_file"}; optional "model_args",
# "model_sha256" (your own model: datasets/yours/model.py) and "buffers" (BatchNorm statistics), None when absent


class ServedModel(nn.Module):
    """`net(prepare(x))` in eval mode: the stored-input -> logits map of one trained run."""

    def __init__(self, net: nn.Module, prepare: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.net = net
        self.prepare = prepare

    def forward(self, x: Tensor) -> Tensor:
        return self.net(self.prepare(x))


def served_model(
    params: Mapping[str, Tensor],
    task: str,
    model: str,
    data_file: str | None,
    model_args: str | None = None,
    model_sha256: str | None = None,
    buffers: Mapping[str, Tensor] | None = None,
    augment: Sequence[str] | None = None,
    *,
    trust: bool = False,
    data_sha256: str | None = None,
    source: str = "the model file",
    fix: str = "pass trust_code=True if you trust it",
) -> ServedModel:
    """The task's `model` module with `params` loaded, behind the task's `prepare`, in eval mode.

    Your own model (`module:factory`, fedcli/datasets/yours/model.py) is rebuilt by importing it
    (it must be importable where the model is loaded) with the recorded factory arguments
    `model_args`; so is a data function `data_file` (`pkg.mod:fn`) called. Either is imported only
    when datasets/yours/trust.py `allow_code` lets it: `trust` (the caller's explicit opt-in, with
    the recorded sha256 `model_sha256` / `data_sha256` matching) or the same code already imported
    in this process; else a ConfigError naming the code (`source`: what names it) and `fix`.
    A source already allowed whose sha256 differs from `model_sha256` is loaded with a warning.
    `buffers`: BatchNorm running statistics of the final model (model.pt's, when it has any).

    Raises:
        ValueError: `params` do not fit the model (another fedcli version, another model).
        KeyError: an unknown task or model name.
        ConfigError: your model's module no longer imports, or it is not allowed to run (one line).
    """
    from fedcli.datasets.augment import parse, with_normalisation
    from fedcli.datasets.registry import resolve_task
    from fedcli.datasets.yours.model import check_source, is_reference
    from fedcli.datasets.yours.trust import allow_code, recorded_code

    allow_code(
        recorded_code(
            {"model": model, "model_sha256": model_sha256}, data_file=data_file, data_sha256=data_sha256
        ),
        source=source,
        fix=fix,
        trust=trust,
    )
    if is_reference(model):
        check_source(model, model_sha256, on_change="warn")
    resolved = resolve_task(task, model, data_file, model_args)
    resolved = with_normalisation(resolved, parse(augment))  # data.augment's normalize (docs/your-data.md)
    with torch.random.fork_rng(devices=[]):
        net = resolved.models[model]()
    weights = {k: v.detach().to("cpu") for k, v in {**(buffers or {}), **params}.items()}
    missing, unexpected = net.load_state_dict(weights, strict=False)
    names = dict(net.named_parameters())
    if unexpected or any(k in names for k in missing):
        raise ValueError(
            f"the parameters do not fit model {model!r}: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )
    return ServedModel(net, resolved.prepare).eval().requires_grad_(False)


def read_model_file(path: Path) -> dict[str, Any]:
    """A run's `model.pt`, read with `torch.load(weights_only=True)` (the mirror's reader; no code runs).

    Raises:
        ValueError: one line: unreadable, needing code to load, or not a fedcli model.
    """
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        raise ValueError(
            f"{path} needs code to load (a pickled {found[1] if found else 'object'}); fedcli never "
            "runs code from a file. If you wrote it and trust it, convert it: "
            f"python -m fedcli.engine.checkpoint --trust {path}"
        ) from None
    except Exception as err:  # noqa: BLE001 - a damaged file: RuntimeError, EOFError, OSError ...
        raise ValueError(
            f"{path} cannot be read ({(str(err).splitlines() or [type(err).__name__])[0][:160]})"
        ) from None
    if (
        not isinstance(saved, dict)
        or not isinstance(saved.get("params"), dict)
        or not all(isinstance(saved.get(k), str) for k in ("task", "model"))
    ):
        raise ValueError(f"{path} is not a fedcli model.pt (no params, task and model)")
    return saved


def write_served(saved: Mapping[str, Any], path: Path) -> None:
    """Write the MLflow model's artifact `served.pt` from a read `model.pt`: parameters and names only."""
    config = saved.get("config")
    data = config.get("data") if isinstance(config, Mapping) else None
    recorded = (
        {k: data.get(k) for k in ("file", "model_args", "model_sha256", "augment")}
        if isinstance(data, Mapping)
        else {}
    )
    buffers = saved.get("buffers")
    torch.save(
        {
            "format": SERVED_FORMAT,
            "params": dict(saved["params"]),
            "task": saved["task"],
            "model": saved["model"],
            "data_file": recorded.get("file"),
            "model_args": recorded.get("model_args"),
            "model_sha256": recorded.get("model_sha256"),
            "augment": recorded.get("augment"),
            "buffers": dict(buffers) if isinstance(buffers, Mapping) else None,
        },
        path,
    )


LOADER_FIX = (
    "load it with mlflow.pyfunc.load_model(uri, model_config={'trust_code': True}) or set "
    "FEDCLI_TRUST_CODE=1 if you trust that code"
)  # how the MLflow model's loader allows user code


def load_served(path: str | Path, *, trust: bool | None = None, fix: str = LOADER_FIX) -> ServedModel:
    """The module of an MLflow model's `served.pt` (read with weights_only=True: no code runs from the file).

    User code it names (your model, a data function) is imported only with `trust` (the caller's
    opt-in; the recorded sha256 must match; None: FEDCLI_TRUST_CODE=1, the loader's opt-in, which
    the copy of tracking/mlflow/model.py in a model logged before the opt-in existed relies on) or
    when this process imported it already; else a ConfigError (one line: the code, and `fix`).
    """
    from fedcli.datasets.yours.trust import trusted_by_env

    trust = trusted_by_env() if trust is None else trust
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or saved.get("format") != SERVED_FORMAT:
        raise ValueError(f"{path} is not a fedcli served.pt of format {SERVED_FORMAT}")
    return served_model(
        saved["params"],
        saved["task"],
        saved["model"],
        saved.get("data_file"),
        saved.get("model_args"),
        saved.get("model_sha256"),
        saved.get("buffers"),
        saved.get("augment"),
        trust=trust,
        source=f"the MLflow model's weights ({Path(path).name})",
        fix=fix,
    )
