"""A fedcli run's MLflow model: a pyfunc "model from code" (docs/operations.md, "Security").

MLflow copies this file into the logged model and runs it when the model is loaded
(`mlflow.pyfunc.load_model`), instead of unpickling a module: nothing of the model is
pickled. The model's one artifact, `weights` (`served.pt`, tracking/served.py), holds the
parameters and the task and model names in plain containers; `load_context` rebuilds the
module through fedcli's task registry, so loading needs fedcli installed (the model's
requirements name the version) and, for your own model (`--model module:factory`) or data function,
its module importable where the model is loaded and the loader's opt-in to run it:
`mlflow.pyfunc.load_model(uri, model_config={"trust_code": True})` or FEDCLI_TRUST_CODE=1, with
the source's sha256 the one recorded (docs/operations.md, "Security"); without it, loading
fails with one line naming the code. `predict(rows)` maps stored rows (e.g. uint8 pixels) to the
logits fedcli evaluates; `unwrap_python_model().module` is the `nn.Module`.

No `from __future__ import annotations` here: MLflow reads the `predict` type hints as
objects (an `np.ndarray` hint turns off its schema inference from hints and its warning).
"""

import mlflow
import numpy as np
from mlflow.pyfunc import PythonModel


class FedcliModel(PythonModel):
    """The run's global model behind the task's input preparation, in eval mode."""

    def load_context(self, context) -> None:  # noqa: ANN001 - MLflow's PythonModelContext
        from fedcli.tracking.served import load_served  # the one fedcli path a logged model's copy names

        config = getattr(context, "model_config", None) or {}
        # the loader's opt-in to the user's code: model_config, else (None) FEDCLI_TRUST_CODE=1
        self.module = load_served(
            context.artifacts["weights"], trust=True if config.get("trust_code") is True else None
        )

    def predict(self, context, model_input: np.ndarray, params=None) -> np.ndarray:  # noqa: ANN001
        """Logits of the rows `model_input` (the data set's stored form, e.g. uint8 pixels)."""
        import torch

        with torch.no_grad():
            return self.module(torch.as_tensor(np.asarray(model_input))).numpy()


mlflow.models.set_model(FedcliModel())
