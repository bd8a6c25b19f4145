"""fedcli: a federated-learning research toolkit (see README.md).

From Python (docs/python-api.md): `fedcli.train(...) -> Run`, `fedcli.load_run(ref)`,
`fedcli.report(...)`. They are loaded on first use (module `__getattr__`), so that `import fedcli`
stays cheap for the CLI, its worker processes and the MLflow mirror (no torch, no pandas);
`from fedcli.api import train, Run` gives the same objects with their types.

Importing the package drops one third-party log line, in every process that imports it (the
CLI, `--executor process` workers, torchrun ranks): torch's "No CUDA runtime is found, using
CUDA_HOME=..." warning, which torch.utils.cpp_extension logs on import (`--compile` imports
it, once per process) wherever a CUDA toolkit is installed but no GPU is usable. fedcli never
builds CUDA extensions, and a run that asks for a GPU without one fails with its own message
(`--device cuda`), so the line only says what every CPU run already knows. Any other record of
that logger (compiler errors, ABI warnings) still goes out.
"""

from __future__ import annotations

import logging as _logging

__version__ = "0.1.0"

# No import of fedcli.api here, not even for type checkers: the engine imports `fedcli` (for
# __version__), and tests/test_layering.py counts type-only imports as dependencies. Typed
# code imports the names from fedcli.api (the same objects).
# public name -> the module that defines it (loaded by `__getattr__` on first use)
_LAZY = {
    "train": "fedcli.api",
    "load_run": "fedcli.api",
    "report": "fedcli.api",
    "Run": "fedcli.api",
    "StoppedBeforeStart": "fedcli.api",
    "ConfigError": "fedcli.errors",
    "FedcliError": "fedcli.errors",
}
__all__ = [
    "ConfigError",
    "FedcliError",
    "Run",
    "StoppedBeforeStart",
    "__version__",
    "load_run",
    "report",
    "train",
]


def __getattr__(name: str):  # no return annotation: Any to type checkers, without importing typing (2 ms)
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # the next lookup finds it without this function
        return value
    raise AttributeError(f"module 'fedcli' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def _not_the_cpu_cuda_probe(record: _logging.LogRecord) -> bool:
    return not str(record.msg).startswith("No CUDA runtime is found")


_logging.getLogger("torch.utils.cpp_extension").addFilter(_not_the_cpu_cuda_probe)
