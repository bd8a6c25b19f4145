"""The trained global model as a plain `nn.Module` that takes the data set's stored inputs.

`model.pt` holds the global parameters, not a module: fedcli trains through
`torch.func.functional_call`. `served_model(saved)` rebuilds the task's module, loads the
parameters and wraps it with the task's `prepare` (stored inputs -> model inputs, e.g.
uint8 pixels -> floats in [0, 1]), so that `module(x)` on rows of the data set gives the
logits fedcli evaluates. The MLflow mirror logs this module as the run's MLflow model
(pytorch flavour, docs/architecture.md §6); `mlflow.pytorch.load_model` returns it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn


class ServedModel(nn.Module):
    """`net(prepare(x))` in eval mode: the stored-input -> logits map of one trained run."""

    def __init__(self, net: nn.Module, prepare: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.net = net
        self.prepare = prepare

    def forward(self, x: Tensor) -> Tensor:
        return self.net(self.prepare(x))


def served_model(saved: Mapping[str, Any]) -> tuple[ServedModel, Tensor | None]:
    """Return (module with the run's global parameters, a two-row input example or None).

    `saved` is a loaded `model.pt` (fedcli.engine.train._save_model). Raises KeyError or
    ValueError when the file does not match its task's model (another fedcli version).
    """
    from fedcli.datasets.registry import resolve_task

    config = saved["config"]
    task = resolve_task(saved["task"], saved["model"], config["data"].get("file"))
    with torch.random.fork_rng(devices=[]):
        net = task.models[saved["model"]]()
    params = {k: v.detach().to("cpu") for k, v in saved["params"].items()}
    missing, unexpected = net.load_state_dict(params, strict=False)
    names = dict(net.named_parameters())
    if unexpected or any(k in names for k in missing):
        raise ValueError(f"model.pt does not fit model {saved['model']!r}: missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]}")
    module = ServedModel(net, task.prepare).eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module, saved.get("example")
