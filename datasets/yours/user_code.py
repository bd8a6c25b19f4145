"""A user's code as fedcli finds, hashes, imports and remembers it: the modules and files of model
references (datasets/yours/model.py) and data functions (datasets/yours/data.py).

`source_sha256` hashes the source file a `module:factory` or `file.py:factory` reference names
(what a run records as `data.model_sha256`); `import_file` imports a .py file once per process and
content. `IMPORTED_CODE` holds the (reference, sha256) of the user code this process imported or
was allowed to import (`remember_import`): datasets/yours/trust.py lets the same code run again
without another opt-in.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from fedcli.errors import ConfigError


def _source_file(ref: str) -> Path:
    target = ref.rpartition(":")[0]
    if target.endswith(".py"):
        return Path(target)
    spec = find_spec(ref, target)
    if spec is None:
        raise ConfigError(
            f"data.model {ref!r}: module {target!r} is not importable here; install it or put its "
            "folder on PYTHONPATH, or pass the file: 'path/to/file.py:Name'."
        )
    if not spec.origin or not Path(spec.origin).is_file():
        raise ConfigError(
            f"data.model {ref!r}: module {target!r} has no source file to record; define the model in "
            "a .py module."
        )
    return Path(spec.origin)


def find_spec(ref: str, target: str) -> Any:
    try:
        return importlib.util.find_spec(target)
    except (ImportError, ValueError) as err:
        raise ConfigError(
            f"data.model {ref!r}: module {target!r} cannot be found ({err}); install it or put "
            "its folder on PYTHONPATH, or pass the file: 'path/to/file.py:Name'."
        ) from None


def source_sha256(ref: str) -> str:
    """sha256 (hex) of the source file of the module a reference names."""
    path = _source_file(ref)
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as err:
        raise ConfigError(f"data.model {ref!r}: {path} cannot be read ({err.strerror}).") from None


def import_file(path: Path) -> ModuleType:
    """Import a .py file once per process and content, under a name unique to its path and source (a
    long-lived sweep worker imports an edited file again)."""
    key = hashlib.sha256(str(path).encode() + path.read_bytes()).hexdigest()[:16]
    name = f"fedcli_user_model_{path.stem}_{key}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path} cannot be imported as a Python module; give a .py file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


IMPORTED: dict[str, str] = {}  # module -> sha256 of its source when this process imported it
# (reference, sha256 of its source) of the user code (models, data functions) this process imported or
# allowed: datasets/yours/trust.py lets the same code run again without another opt-in
IMPORTED_CODE: set[tuple[str, str]] = set()


def remember_import(ref: str, sha256: str) -> None:
    """Record that this process imported (or was allowed to import) `ref` with this source's sha256."""
    if sha256:
        IMPORTED_CODE.add((ref, sha256))


def sha(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return ""


def _first_line(err: BaseException) -> str:
    text = (str(err).strip().splitlines() or [""])[0][:200]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
