"""fedcli: a federated-learning research toolkit (see README.md)."""

__version__ = "0.1.0"
