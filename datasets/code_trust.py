"""The import path of `trusted_by_env` before the module moved to datasets/yours/trust.py.

Not a facade for fedcli's own code (nothing in fedcli imports it): MLflow models logged by earlier
fedcli versions carry a copy of their wrapper (tracking/mlflow/model.py, a "model from code"), and
that copy runs `from fedcli.datasets.code_trust import trusted_by_env` when the model is loaded.
This module keeps those models loadable (tests/tracking/test_legacy_model.py).
"""

from fedcli.datasets.yours.trust import trusted_by_env

__all__ = ["trusted_by_env"]
