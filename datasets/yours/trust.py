"""Which user code a command may import: the one gate of code named by a file, a row or a study.

A user's model (`--model pkg.mod:factory` / `file.py:factory`, datasets/yours/model.py) and data
function (`--data pkg.mod:fn` / `file.py:fn`, datasets/yours/data.py) are Python code: importing
them runs it. fedcli imports such code when the user names it on the command (`fedcli train
--model ...`, `fedcli.train(model=...)`, a `--config` file or sweep spec the user passes). It
reads references back from places the user did not write on this command: a run's `model.pt`,
an MLflow model's `served.pt`, a store row (`--resume`, `fedcli evaluate`, `fedcli sync`,
`Run.model()`), an Optuna trial. Every such path calls `allow_code` first, which lets the code
be imported only when

- the user names the same reference on this command (`named`: `--model` / `--data` again), or
- the user passes an explicit opt-in (`trust`: `--trust-code`, `trust_code=True`, the MLflow
  model's `model_config={"trust_code": True}` or FEDCLI_TRUST_CODE=1), and then only if the
  source file's sha256 is the one recorded with the run (a file swapped since is refused), or
- this process already imported the same reference with the same source (`remember_import`: code that
  already ran here, e.g. `fedcli.train(model=...)` then `run.model()`).

Otherwise a `ConfigError` says in one line what would be imported and how to allow it
(docs/operations.md, "Security"). Built-in models, tasks and installed plugins (entry points)
are installed code and need no opt-in. Nothing here imports the user's module: a dotted
module's file is looked up only once the user allowed it (finding `pkg.mod` imports `pkg`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedcli.datasets.yours.user_code import IMPORTED_CODE, remember_import, source_sha256
from fedcli.errors import ConfigError

TRUST_ENV = "FEDCLI_TRUST_CODE"  # "1": the MLflow model's loader may import the code its served.pt names


@dataclass(frozen=True)
class Code:
    """One piece of user code a file, row or trial names."""

    what: str  # "model" or "data function"
    ref: str  # the recorded reference (`/abs/file.py:Net`, `pkg.mod:fn`)
    sha256: str | None  # the source's sha256 recorded with the run, None where none was

    @property
    def where(self) -> str:
        """The reference with its file, for messages (a dotted module: its name only, nothing is imported)."""
        target = self.ref.rpartition(":")[0]
        return f"{self.ref} (file {target})" if target.endswith(".py") else f"{self.ref} (module {target})"


def recorded_code(
    data: Mapping[str, Any] | None, *, data_file: Any = None, data_sha256: Any = None
) -> list[Code]:
    """The user code a recorded `data` section names: its model reference and its data function.

    `data_file` / `data_sha256` override the section's `file` / `source_sha256` (served.pt keeps them apart).
    """
    from fedcli.datasets.yours.data import PYTHON_PREFIX, is_data_ref
    from fedcli.datasets.yours.model import is_reference
    from fedcli.datasets.yours.plugins import model_plugins

    data = data if isinstance(data, Mapping) else {}
    out = []
    model = data.get("model")
    installed = {reference for reference, _ in model_plugins().values()}  # entry points: installed code
    if isinstance(model, str) and is_reference(model) and model not in installed:
        sha = data.get("model_sha256")
        out.append(Code("model", model, sha if isinstance(sha, str) else None))
    file = data_file if data_file is not None else data.get("file")
    if isinstance(file, str) and is_data_ref(file) and not file.startswith(PYTHON_PREFIX):
        sha = data_sha256 if data_sha256 is not None else data.get("source_sha256")
        out.append(Code("data function", file, sha if isinstance(sha, str) else None))
    return out


def _remembered(ref: str) -> bool:
    target = ref.rpartition(":")[0]
    if not any(r == ref for r, _ in IMPORTED_CODE):
        return False
    if target.endswith(".py"):  # the file as it is now must be the one imported
        try:
            now = hashlib.sha256(Path(target).read_bytes()).hexdigest()
        except OSError:
            return False
        return (ref, now) in IMPORTED_CODE
    return True  # a module imported here stays imported (sys.modules); load_factory reloads an edited one


def same_reference(code: Code, given: str | None) -> bool:
    """Whether a reference the user gave on this command names the same code as the recorded one."""
    if not given:
        return False
    from fedcli.datasets.yours.data import normalise
    from fedcli.datasets.yours.model import model_reference

    if given == code.ref:
        return True
    try:
        canonical = model_reference(given) if code.what == "model" else normalise(given)
    except ConfigError:
        return False
    return canonical == code.ref


def allow_code(
    code: Sequence[Code], *, source: str, fix: str, named: Collection[str | None] = (), trust: bool = False
) -> None:
    """Let `code` be imported, or raise ConfigError (one line: what would run, and `fix`).

    `source`: what names the code ("run 3f2a9c's stored config", "served.pt ..."); `fix`: how to
    allow it on this command ("pass --trust-code if you trust it, or --model REF"). `named`: the
    references the user gave on this command; `trust`: the user's explicit opt-in, honoured only
    when the source file's sha256 is the recorded one.
    """
    for item in code:
        if any(same_reference(item, given) for given in named):
            continue  # the user names it: the caller's policy on a changed source applies (--resume, evaluate)
        if trust:
            now = source_sha256(item.ref)
            if item.sha256 and item.sha256 != now:
                raise ConfigError(
                    f"{source} names {item.what} {item.where}, whose source changed since the run "
                    f"recorded it (sha256 {item.sha256[:12]} recorded, {now[:12]} now), so the trust "
                    "given does not cover it; restore the file, or name the code yourself on this "
                    "command to run it as it is now."
                )
            remember_import(item.ref, now)
            continue
        if _remembered(item.ref):
            continue
        raise ConfigError(
            f"{source} names {item.what} {item.where}, Python code that fedcli would import and run; "
            f"fedcli runs only code you name or allow on this command: {fix}."
        )


def trusted_by_env() -> bool:
    """FEDCLI_TRUST_CODE=1 (the MLflow model's loader only; docs/operations.md, "Security")."""
    return os.environ.get(TRUST_ENV) == "1"
