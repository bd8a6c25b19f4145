"""Evaluation of a global model on a held-out split, in fixed-size chunks on the run's device."""

from __future__ import annotations

import torch
from torch import Tensor

from fedcli.algorithms.base import Params, flatten
from fedcli.datasets.tasks import Task, per_example_loss
from fedcli.engine.executors import ModelFunctions


@torch.no_grad()
def evaluate(task: Task, fns: ModelFunctions, params: Params, x: Tensor, y: Tensor,
             optimum: Tensor | None = None, chunk: int = 2048) -> dict[str, float]:
    """Return eval/loss, eval/accuracy (classification) and eval/dist_to_opt (if optimum known).

    eval/loss is the mean per-example loss (cross-entropy, or 1/2 squared error);
    eval/accuracy the fraction of argmax predictions equal to the label;
    eval/dist_to_opt = ||theta - theta*||_2 over the flattened parameters.
    """
    device = next(iter(params.values())).device
    loss_sum, correct, count = 0.0, 0, 0
    for start in range(0, len(y), chunk):
        xb = fns.prepare(x[start : start + chunk].to(device))
        yb = y[start : start + chunk].to(device)
        output = fns.apply_fn(params, xb)
        loss_sum += float(per_example_loss(task, output, xb, yb).sum())
        if task.kind == "classification":
            correct += int((output.argmax(dim=-1) == yb).sum())
        count += len(yb)
    metrics = {"eval/loss": loss_sum / max(count, 1)}
    if task.kind == "classification":
        metrics["eval/accuracy"] = correct / max(count, 1)
    if optimum is not None:
        metrics["eval/dist_to_opt"] = float(torch.linalg.vector_norm(flatten(params) - optimum.to(device)))
    return metrics
