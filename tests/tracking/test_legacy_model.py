"""An MLflow model logged by an earlier fedcli still loads: its copied wrapper (a pyfunc "model from
code") imports `trusted_by_env` from fedcli.datasets.code_trust, where it lived before it moved to
datasets/yours/trust.py (datasets/code_trust.py keeps that path)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# the wrapper as earlier versions copied it into every logged model (tracking/mlflow_model.py then)
LEGACY_WRAPPER = """
import mlflow
import numpy as np
from mlflow.pyfunc import PythonModel


class FedcliModel(PythonModel):
    def load_context(self, context) -> None:
        from fedcli.datasets.code_trust import trusted_by_env
        from fedcli.tracking.served import load_served

        config = getattr(context, "model_config", None) or {}
        trust = config.get("trust_code") is True or trusted_by_env()
        self.module = load_served(context.artifacts["weights"], trust=trust)

    def predict(self, context, model_input: np.ndarray, params=None) -> np.ndarray:
        import torch

        with torch.no_grad():
            return self.module(torch.as_tensor(np.asarray(model_input))).numpy()


mlflow.models.set_model(FedcliModel())
"""


@pytest.mark.slow  # a `fedcli train` process (tests/tracking/logged_model.py)
def test_a_model_logged_with_the_earlier_wrapper_loads_and_predicts(tmp_path: Path) -> None:
    import mlflow

    from fedcli.tracking.mlflow.sink import global_tracking_uri
    from tests.tracking.logged_model import train_and_log

    _, _, logged, fedcli_id = train_and_log(tmp_path)
    wrappers = [
        p for p in tmp_path.joinpath("mlartifacts").rglob("*.py") if "class FedcliModel" in p.read_text()
    ]
    assert len(wrappers) == 1
    wrappers[0].write_text(LEGACY_WRAPPER)  # the logged model as an earlier fedcli wrote it
    saved = torch.load(tmp_path / "runs" / fedcli_id / "model.pt", map_location="cpu", weights_only=True)
    with global_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}"):
        loaded = mlflow.pyfunc.load_model(logged.model_uri)
    rows = saved["example"]
    assert torch.allclose(
        torch.as_tensor(loaded.predict(rows.numpy())), loaded.unwrap_python_model().module(rows)
    )
    assert loaded.predict(rows.numpy()).shape == (2, 10)
