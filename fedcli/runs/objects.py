"""Live objects given to the Python API (docs/python-api.md, "Your model and data from a notebook").

`fedcli.train(model=..., data=...)` accepts a class, a factory or an `nn.Module` instance as the model
and a `torch.utils.data.Dataset` (or another data object) as the data; they are recorded as references
a worker process, `resume=` and a later session can import again (`live_model`), and a data object's
class by its source file and hash (`record_object_source`).
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

from fedcli.errors import ConfigError


def warn(line: str) -> None:
    """One warning line on the "fedcli" logger (what the Python API tells its caller)."""
    import logging

    logging.getLogger("fedcli").warning("%s", line)


def live_model(model: Any) -> Any:
    """What `model_reference` records for a live object given to `train(model=...)` (docs/python-api.md, "Your
    model and data from a notebook").

    - an importable class or function: itself; one of a top-level module with a source file (a `mynet.py` next
      to the notebook, or on a `sys.path` the notebook extended) is recorded by that file (`/abs/mynet.py:Net`,
      the CLI's `--model mynet.py:Net`), which every process and a later session import without the
      notebook's `sys.path`;
    - an `nn.Module` instance: its class, when fedcli can build it again from the task's facts (the class
      names only `num_classes` / `input_shape`, or has defaults for the rest): every process and `resume=`
      build the model afresh under the run's seed, so the instance's own weights are not used (a warning
      says so); otherwise one line asks for a factory;
    - a class or function defined in a notebook cell or in the script being run (`__main__`): one line naming
      what to do (write it to a .py file and pass it, or the `file.py:Name` reference): no other process and no
      later session can import it.

    Raises:
        ConfigError: one line naming the object and the fix.
    """
    import sys

    from torch import nn

    given = model
    if isinstance(model, nn.Module):
        model = type(model)
    if isinstance(model, str) or not callable(model):
        return model  # model_reference names what is wrong with it
    module, qual = getattr(model, "__module__", None), getattr(model, "__qualname__", "") or repr(model)
    what = f"an nn.Module instance of {qual}" if given is not model else f"model {qual}"
    source = _source_file(model)
    if module in (None, "__main__") or "<locals>" in qual or "<lambda>" in qual:
        if "<locals>" in qual or "<lambda>" in qual:
            where, fix = (
                "inside a function",
                "define it at the top level of a .py file and pass it from there",
            )
        elif source is None:
            where, fix = (
                "in a notebook cell",
                f"write the cell to a file (%%writefile mynet.py) and pass "
                f"model='mynet.py:{qual}', or import {qual} from a .py file and pass it",
            )
        else:
            where, fix = (
                f"in the script being run ({source})",
                f"pass model='{source}:{qual}' if the script "
                'trains only under `if __name__ == "__main__":` (other processes import it), or move '
                f"{qual} to a module of its own",
            )
        raise ConfigError(
            f"{what} is defined {where}, which no worker process, resume=, fedcli evaluate or MLflow "
            f"model can import again; {fix}."
        )
    out: Any = model
    if (
        source is not None
        and "." not in module
        and getattr(sys.modules.get(module), "__package__", "") in ("", None)
    ):
        out = f"{source}:{qual}"  # a top-level module: its file, importable from any folder and process
    if given is not model:
        _check_rebuildable(model, qual)
        recorded = out if isinstance(out, str) else f"{module}:{qual}"
        warn(
            f"model: the {qual} instance given is built again from its class ({recorded}) under the run's seed, "
            "as every process and resume= build it, so its current weights are not used; pass the class or a "
            "factory to say so."
        )
    return out


def _source_file(obj: Any) -> str | None:
    """The .py file a class or function was compiled from, when it exists (a notebook cell's does not).

    inspect.getsourcefile, except for a class: its module's `__file__` is the running program's for a class of
    `__main__` (a notebook kernel's launcher), so the file of the code of its own methods decides."""

    code = getattr(obj, "__code__", None)
    if isinstance(obj, type):
        code = next((f.__code__ for f in vars(obj).values() if hasattr(f, "__code__")), None)
    if code is not None:
        path: str | None = code.co_filename
    else:
        try:
            path = inspect.getsourcefile(obj)
        except (TypeError, OSError):
            return None
    return str(Path(path).resolve()) if path and path.endswith(".py") and Path(path).is_file() else None


def _check_rebuildable(cls: type, qual: str) -> None:
    """An instance's class must be callable with only the facts fedcli passes (num_classes, input_shape)."""

    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return
    missing = [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.name not in ("num_classes", "input_shape")  # the facts fedcli passes
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.POSITIONAL_ONLY)
    ]
    if missing:
        raise ConfigError(
            f"model: a {qual} instance cannot be built again by fedcli ({qual}() needs "
            f"{', '.join(missing)}, and fedcli passes only num_classes / input_shape); pass a factory "
            f"from a .py file instead, e.g. def make_net(num_classes): return {qual}({missing[0]}=...), "
            "then model=make_net."
        )


def record_object_source(ref: str, data: Any) -> None:
    """Record the source of a data object's class with the run (data.object_source: `/abs/file.py:Qual`, or
    `<notebook>:Qual` for a class defined in a cell; data.object_source_sha256: the file's sha256), as a
    `pkg.mod:fn` data reference records its own (docs/your-data.md, "Names and fingerprints")."""
    import hashlib

    from fedcli.datasets.yours import data as user_data

    held = user_data.shipped(ref) if ref.startswith(user_data.PYTHON_PREFIX) else None
    if held is None:
        return
    cls = type(data)
    qual = getattr(cls, "__qualname__", cls.__name__)
    source = _source_file(cls)
    if source is None and cls.__module__ not in ("__main__", None):
        return  # a library's class (a Hugging Face Dataset, torchvision's): its package names it
    record = {**held.record, "object_source": f"{source or '<notebook>'}:{qual}"}
    if source is not None:
        record["object_source_sha256"] = hashlib.sha256(Path(source).read_bytes()).hexdigest()
    user_data.register(ref, dataclasses.replace(held, record=record))
