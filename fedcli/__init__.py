"""fedcli: a federated-learning research toolkit (see README.md).

Importing the package drops one third-party log line, in every process that imports it (the
CLI, `--executor process` workers, torchrun ranks): torch's "No CUDA runtime is found, using
CUDA_HOME=..." warning, which torch.utils.cpp_extension logs on import (`--compile` imports
it, once per process) wherever a CUDA toolkit is installed but no GPU is usable. fedcli never
builds CUDA extensions, and a run that asks for a GPU without one fails with its own message
(`--device cuda`), so the line only says what every CPU run already knows. Any other record of
that logger (compiler errors, ABI warnings) still goes out.
"""

import logging as _logging

__version__ = "0.1.0"


def _not_the_cpu_cuda_probe(record: _logging.LogRecord) -> bool:
    return not str(record.msg).startswith("No CUDA runtime is found")


_logging.getLogger("torch.utils.cpp_extension").addFilter(_not_the_cpu_cuda_probe)
