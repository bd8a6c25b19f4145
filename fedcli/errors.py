"""Error types shared by every layer (docs/style.md rule 11).

`ConfigError` is a user mistake (bad option, unknown name, malformed file): the CLI prints
one line and exits 2. `DataError` and `TrackingError` are runtime failures outside the
user's options (missing or corrupt data, an unwritable store): exit 1 unless the fix is
an option the user passes, in which case raise `ConfigError`.
"""

from __future__ import annotations


class FedcliError(Exception):
    """Base class of every error fedcli reports to users without a traceback."""


class ConfigError(FedcliError):
    """Invalid configuration or usage (exit code 2)."""


class DataError(FedcliError):
    """Missing, corrupt or incompatible data (exit code 2: the user points at data)."""


class CheckpointError(DataError):
    """A checkpoint or model file fedcli will not use: unreadable, needing code to load, or another
    run's or round's. The message is one line naming the file and the reason."""


class TrackingError(FedcliError):
    """The results store or MLflow cannot be used (exit code 2: the user picks the store)."""
