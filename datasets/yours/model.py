"""A user's own model: `--model pkg.module:factory` or `--model path/to/file.py:factory`.

The reference names a callable (an `nn.Module` class or a function) that returns an
`nn.Module` (docs/bring-your-own.md, "Your model"). Forms, as `model_reference` writes them
into `data.model`:

- `pkg.module:factory` (an importable module; `factory` may be dotted: `Outer.make`);
- `/abs/dir/file.py:factory`, written by the user as `./file.py:Net` or `file.py:Net`: made
  absolute, so that `--resume`, `fedcli evaluate`, worker processes and the MLflow model find
  it from any directory. A bare `mynet:Net` that does not import but names `./mynet.py` in the
  working directory becomes that file's absolute form (a console script has no working
  directory on `sys.path`).

The factory is called with keyword arguments `num_classes` (classes of the task's target;
None for a non-class target) and `input_shape` (one prepared example's shape, a tuple), each
only when its signature names it (or takes **kwargs). The module's `forward(x)` takes the
prepared batch [B, *input_shape]; it is also given the step's dropout key (`key=`, an int64 0-d
tensor, fedcli.datasets.models.keyed_dropout) when its signature names `key`.

Recorded with the run: the reference, `data.model_sha256` (sha256 of the module's source file:
`source_sha256`) and `data.model_args` (the JSON of the keyword arguments given). Importing a
user's module runs its code: that is what the user asked for by naming it. A reference read
back (model.pt, served.pt, a store row, an Optuna trial) is imported only after
datasets/yours/trust.py `allow_code` let it (docs/operations.md, "Security").
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from fedcli.datasets.yours.user_code import (
    IMPORTED,
    _first_line,
    find_spec,
    import_file,
    remember_import,
    sha,
    source_sha256,
)
from fedcli.errors import ConfigError

log = logging.getLogger(__name__)

FACTS = ("num_classes", "input_shape")  # the keyword arguments a factory may name
# models found unable to run under torch.func.vmap (`check_model`), with why: engine/select.py reads it
_VMAP_OBSTACLES: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def is_reference(model: object) -> bool:
    """True for a user model reference (`module:factory` or `file.py:factory`), False for a built-in name."""
    return isinstance(model, str) and ":" in model


def model_reference(model: Any, *, base: Path | None = None) -> str:
    """What `data.model` records for a user's model argument (see the module docstring).

    `model`: a built-in name (returned as is), a `module:factory` or `file.py:factory` string, or
    a class / function importable by `obj.__module__:obj.__qualname__`. `base`: the directory a
    relative file path is read from (default: the working directory).

    Raises:
        ConfigError: one line naming the problem and the fix (a `__main__` or local object, a
            module that does not import, a missing file or attribute).
    """
    if isinstance(model, nn.Module):
        raise ConfigError(
            f"model must be a class or factory, not a built module ({type(model).__name__} instance); "
            "pass the class (or a function returning the module) so every process can rebuild it."
        )
    if not isinstance(model, str):
        if not callable(model):
            raise ConfigError(
                f"model must be a name, 'module:factory', 'file.py:factory' or a class/function; "
                f"got {type(model).__name__}."
            )
        module, qual = getattr(model, "__module__", None), getattr(model, "__qualname__", "")
        if module in (None, "__main__") or "<locals>" in qual or "<lambda>" in qual:
            where = (
                "a notebook or the script being run (__main__)"
                if module in (None, "__main__")
                else "a function"
            )
            raise ConfigError(
                f"model {qual or model!r} is defined in {where}, so worker processes, --resume, "
                "fedcli evaluate and the MLflow model cannot rebuild it; put it in a .py file and pass "
                "'path/to/file.py:Name' (or import it from there and pass the object)."
            )
        model = f"{module}:{qual}"
    if not is_reference(model):
        return model  # a name: the task's own model, else a model plugin's (fedcli/config/validation.py record_model_source)
    target, _, attr = model.rpartition(":")
    if not target or not attr:
        raise ConfigError(
            f"data.model {model!r} must read 'module:factory' or 'file.py:factory'; e.g. "
            "mynet:Net or ./mynet.py:make_net."
        )
    base = Path.cwd() if base is None else base
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = (base / target).resolve()
        if not path.is_file():
            raise ConfigError(
                f"data.model {model!r}: file {path} does not exist; give the path of the .py file "
                "that defines the model (a stored run's: restore the file where it was)."
            )
        return f"{path}:{attr}"
    local = (
        base / f"{target}.py"
    )  # a module of the working directory: recorded by its file, found from anywhere
    if "." not in target and local.is_file():
        spec = find_spec(model, target)
        if spec is None or (spec.origin and Path(spec.origin).resolve() == local.resolve()):
            return f"{local.resolve()}:{attr}"
    return model


def load_factory(ref: str) -> Callable[..., nn.Module]:
    """The callable a reference names, imported (its module runs).

    Raises:
        ConfigError: the module does not import (the exception's first line is named) or lacks the name.
    """
    target, _, attr = ref.rpartition(":")
    try:
        if target.endswith(".py"):
            if not Path(target).is_file():
                raise ConfigError(
                    f"model file {target} no longer exists (data.model {ref!r}); restore it, or start "
                    "a new run with the model's current location."
                )
            module = import_file(Path(target))
        else:
            module = importlib.import_module(target)
            source = getattr(module, "__file__", None)
            if source and IMPORTED.setdefault(target, sha(source)) != sha(
                source
            ):  # edited since imported here
                module = importlib.reload(module)
                IMPORTED[target] = sha(source)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - any error of the user's module is reported in one line
        raise ConfigError(
            f"data.model {ref!r}: importing {target} failed: {_first_line(err)}. Fix the module, or "
            "check that it is importable here (PYTHONPATH, installed package)."
        ) from None
    source = getattr(module, "__file__", None)
    remember_import(ref, sha(source) if source else "")  # imported here: later gates of the same code pass
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"data.model {ref!r}: {target} has no attribute {attr!r}; name the class or function "
                "that builds the model."
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(
            f"data.model {ref!r}: {attr} is a {type(obj).__name__}, not a class or function; name "
            "what builds the model."
        )
    return obj  # type: ignore[no-any-return]


def factory_kwargs(factory: Callable[..., Any], facts: Mapping[str, Any]) -> dict[str, Any]:
    """The facts the factory's signature names (all of them if it takes **kwargs)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {k: facts[k] for k in FACTS if k in facts}
    return {k: facts[k] for k in FACTS if k in params and k in facts}


def make_model(ref: str, kwargs: Mapping[str, Any]) -> nn.Module:
    """Import the factory and call it with `kwargs`; ConfigError (one line) if it fails or returns no module."""
    factory = load_factory(ref)
    args = {k: tuple(v) if k == "input_shape" else v for k, v in kwargs.items()}
    try:
        model = factory(**args)
    except Exception as err:  # noqa: BLE001 - the user's constructor: one line, no traceback
        raise ConfigError(
            f"data.model {ref!r}: building the model failed ({_first_line(err)}); called with "
            f"{', '.join(f'{k}={v!r}' for k, v in args.items()) or 'no arguments'}. Fix the factory."
        ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"data.model {ref!r} returned a {type(model).__name__}, not a torch.nn.Module; return the module."
        )
    if not any(True for _ in model.parameters()):
        raise ConfigError(f"data.model {ref!r} has no parameters to train; return a module with parameters.")
    return model


def shape_facts(prepare: Callable[[Tensor], Tensor], x: Tensor, num_classes: int | None) -> dict[str, Any]:
    """The facts a factory may be given: classes of the target and one prepared example's shape."""
    return {"num_classes": num_classes, "input_shape": list(prepare(x[:1]).shape[1:])}


def accepts_key(model: nn.Module) -> bool:
    """True when the model's forward names a `key` argument (fedcli's keyed dropout)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "key" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def encode_args(kwargs: Mapping[str, Any]) -> str:
    """The recorded form of a factory's keyword arguments (data.model_args)."""
    return json.dumps(dict(kwargs), sort_keys=True)


def decode_args(text: str | None) -> dict[str, Any]:
    """data.model_args back to keyword arguments ({} for None)."""
    return dict(json.loads(text)) if text else {}


def with_model(task: Any, ref: str, kwargs: Mapping[str, Any]) -> Any:
    """The task with the user's model added to its models under the reference (built with `kwargs`)."""
    from dataclasses import replace

    frozen = dict(kwargs)
    return replace(task, models=MappingProxyType({**task.models, ref: lambda: make_model(ref, frozen)}))


def check_source(ref: str, recorded: str | None, *, on_change: str) -> str:
    """The source's sha256 now, checked against the one recorded with the run.

    on_change: "refuse" (--resume: a ConfigError unless FEDCLI_ALLOW_MODEL_CHANGE=1) or "warn"
    (fedcli evaluate, the MLflow model).
    """
    import os

    now = source_sha256(ref)
    if recorded and recorded != now:
        what = f"the source of model {ref} changed since the run (sha256 {recorded[:12]} recorded, {now[:12]} now)"
        if on_change == "refuse" and os.environ.get("FEDCLI_ALLOW_MODEL_CHANGE") != "1":
            raise ConfigError(
                f"{what}; restore the file to resume bit-exact, or set FEDCLI_ALLOW_MODEL_CHANGE=1 to "
                "continue with the changed code."
            )
        log.warning("%s; the results may differ from the run's", what)
    return now


def vmap_obstacle(model: nn.Module) -> str | None:
    """Why the model cannot run under torch.func.vmap (as `check_model` found), or None."""
    return _VMAP_OBSTACLES.get(model)


def check_model(
    ref: str,
    model: nn.Module,
    *,
    kind: str,
    num_classes: int | None,
    x: Tensor,
    y: Tensor,
    loss: Callable[[Tensor, Tensor, Tensor], Tensor],
    carry_stats: bool = True,
    precision: str = "fp32",
) -> None:
    """One forward pass on a real batch (`x` prepared, `y` its targets): output shape and a finite loss.

    Then runs what training runs (engine/model.py `model_functions`): BatchNorm on batch
    statistics, stock layers inside datasets/stock_layers.py's `StockLayers` with a step key, in
    train mode: one gradient step of a client on the batch (the loop's form; a failure is a
    ConfigError), then one vmapped gradient step of a cohort of `PROBE_CLIENTS` clients, each with
    its own parameters, examples and key (the vmap back end's form, randomness="error" as it runs);
    why that fails, if it does, is recorded (`vmap_obstacle`: `.item()` or data-dependent control
    flow in forward, random ops from torch's global generator, packed sequences) and auto then
    picks the loop before anything is written (engine/select.py). `carry_stats` (train.bn_stats
    aggregate or local, with an algorithm that declares its local training; engine/setup.py
    `bn_stats_of`): both steps carry the BatchNorm running statistics as training does
    (engine/local.py `CarryingStats`): each client's copy is an input of the step, BatchNorm's
    momentum update writes it (`tracking`; a momentum=None BatchNorm at its first step's factor)
    and it leaves as an output; under vmap the copies are batched, one per client. `precision`
    "bf16": the steps run under torch.autocast as training does (engine/model.py `with_precision`).

    Raises:
        ConfigError: one line naming what failed and the fix.
    """
    from fedcli.datasets.stock_layers import StockLayers

    key = {"key": torch.zeros((), dtype=torch.int64, device=x.device)} if accepts_key(model) else {}
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    try:
        with torch.no_grad(), StockLayers(torch.zeros((), dtype=torch.int64, device=x.device)):
            out = torch.func.functional_call(model, {**params, **buffers}, (x,), key)
    except Exception as err:  # noqa: BLE001 - the user's forward
        raise ConfigError(
            f"data.model {ref!r}: the forward pass on a batch of shape {list(x.shape)} failed "
            f"({_first_line(err)}); make forward accept [B, *input_shape] = {list(x.shape)}."
        ) from None
    if not isinstance(out, Tensor):
        raise ConfigError(
            f"data.model {ref!r}: forward returned a {type(out).__name__}; return one tensor of outputs."
        )
    batch = len(x)
    shapes: dict[str, list[int | None]] = {"classification": [batch, num_classes], "regression": [batch]}
    want = shapes.get(kind)
    if want is not None and None not in want and list(out.shape) != want:
        fix = (
            "end with nn.Linear(..., num_classes)"
            if kind == "classification"
            else "return shape [B]: add .squeeze(-1) to a one-output head"
        )
        raise ConfigError(
            f"data.model {ref!r}: output shape {list(out.shape)} on a batch of {batch}, expected {want} "
            f"for this {kind} task; {fix}."
        )
    try:
        losses = loss(out.float(), x, y)
    except Exception as err:  # noqa: BLE001 - a shape the loss cannot take
        raise ConfigError(
            f"data.model {ref!r}: output shape {list(out.shape)} does not fit the {kind} task's loss "
            f"({_first_line(err)}); return what the built-in models of the task return."
        ) from None
    if list(losses.shape) != [batch]:
        raise ConfigError(
            f"data.model {ref!r}: output shape {list(out.shape)} gives a loss of shape "
            f"{list(losses.shape)}, expected [{batch}]; return one output row per example."
        )
    obstacle = _probe_training(ref, model, params, buffers, x, y, bool(key), loss, carry_stats, precision)
    if obstacle is not None:
        _VMAP_OBSTACLES[model] = obstacle
    else:
        _VMAP_OBSTACLES.pop(model, None)


PROBE_CLIENTS = 3  # the cohort the model check vmaps one training step over


def _probe_training(
    ref: str,
    model: nn.Module,
    params: dict[str, Tensor],
    buffers: dict[str, Tensor],
    x: Tensor,
    y: Tensor,
    keyed: bool,
    loss: Callable[[Tensor, Tensor, Tensor], Tensor],
    carry_stats: bool,
    precision: str,
) -> str | None:
    """One client's training step (ConfigError if it fails), then why a vmapped cohort step fails, or None."""
    from contextlib import nullcontext

    from fedcli.datasets.stock_layers import StockLayers

    norms = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    ids = {id(m) for m in norms}
    carried = {
        name: buffers[name]
        for prefix, m in model.named_modules()
        if carry_stats and id(m) in ids
        for name in (f"{prefix}.{n}" if prefix else n for n, _ in m.named_buffers(recurse=False))
    }
    cumulative = [m for m in norms if m.momentum is None] if carried else []
    training = model.training

    def autocast() -> Any:
        return torch.autocast(x.device.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()

    def client_loss(
        p: dict[str, Tensor], xb: Tensor, yb: Tensor, k: Tensor, stats: dict[str, Tensor]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        own = {
            n: v.clone() for n, v in stats.items()
        }  # the step's copy, written by BatchNorm (CarryingStats)
        with StockLayers(k), autocast(), tracking(norms, bool(own)):
            out = torch.func.functional_call(
                model, {**p, **buffers, **own}, (xb,), {"key": k} if keyed else {}
            )
        return loss(out.float(), xb, yb).mean(), own

    keys = torch.arange(1, PROBE_CLIENTS + 1, dtype=torch.int64, device=x.device)
    for m in norms:
        m.track_running_stats = (
            False  # as training runs it (engine/model.py): batch statistics, no buffer written
        )
    for m in cumulative:  # CarryingStats' first step's factor (engine/model.py ClientStats.cumulative)
        count = m.num_batches_tracked
        m.momentum = 1.0 / (int(count) + 1) if count is not None else 1.0
    model.train()
    try:
        try:
            own = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in params.items()}
            wanted = [
                v for v in own.values() if v.requires_grad
            ]  # the loop's gradients: torch.autograd (local.py)
            torch.autograd.grad(client_loss(own, x, y, keys[0], carried)[0], wanted, allow_unused=True)
        except Exception as err:  # noqa: BLE001 - the user's forward or backward
            raise ConfigError(
                f"data.model {ref!r}: a training step (forward and gradient, train mode) on a batch of "
                f"shape {list(x.shape)} failed ({_first_line(err)}); fix the model's forward."
            ) from None
        stacked = {k: torch.stack([v] * PROBE_CLIENTS) for k, v in params.items()}
        xs = torch.stack(
            [x.roll(c, 0) for c in range(PROBE_CLIENTS)]
        )  # each client its own order of the examples
        ys = torch.stack([y.roll(c, 0) for c in range(PROBE_CLIENTS)])
        per_client = {k: torch.stack([v] * PROBE_CLIENTS) for k, v in carried.items()}
        try:
            torch.func.vmap(torch.func.grad(client_loss, has_aux=True))(stacked, xs, ys, keys, per_client)
        except Exception as err:  # noqa: BLE001 - what vmap cannot run: .item(), data-dependent branches, packed RNNs
            return f"its training step does not run under torch.func.vmap ({_first_line(err)[:160]})"
        return None
    finally:
        for m in norms:
            m.track_running_stats = True
        for m in cumulative:
            m.momentum = None
        model.train(training)


@contextlib.contextmanager
def tracking(norms: list[_BatchNorm], on: bool) -> Iterator[None]:
    """BatchNorm writes its running statistics (track_running_stats) inside the block, when `on`.

    Inside it each BatchNorm's input is cast to its running statistics' dtype (float32) when it
    differs: under --precision bf16 the convolution before it hands a bfloat16 input, and
    PyTorch's vmap rule for batch_norm with batched running statistics refuses that mix
    ("expected scalar type BFloat16 but found Float"; its unbatched kernel takes it). The cast
    runs on every back end, so the loop and vmap normalise alike, in float32 (the next autocast
    op casts back to bfloat16). Used by training (engine/model.py `model_functions`) and by the
    model check's training steps (`check_model`), so the check runs what training runs.
    """
    active = norms if on else []
    hooks = [m.register_forward_pre_hook(_stats_dtype) for m in active]
    for m in active:
        m.track_running_stats = True
    try:
        yield
    finally:
        for m in active:
            m.track_running_stats = False
        for hook in hooks:
            hook.remove()


def _stats_dtype(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """A BatchNorm's forward pre-hook: its input in its running statistics' dtype (tracking)."""
    x, stats = args[0], module.running_mean
    if not (isinstance(x, Tensor) and isinstance(stats, Tensor) and x.is_floating_point()):
        return None
    return (x.to(stats.dtype), *args[1:]) if x.dtype != stats.dtype else None
