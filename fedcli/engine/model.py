"""The model as the engine uses it: stateless functions of the parameters, and their precision.

`model_functions` wraps an `nn.Module` with torch.func.functional_call (algorithms never see
the module, docs/style.md rule 6); `with_precision` applies train.precision to those functions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fedcli.algorithms.base import Batch, Params
from fedcli.datasets.federated import FederatedData
from fedcli.datasets.tasks import Task, per_example_loss
from fedcli.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFunctions:
    """The stateless model functions a ClientContext exposes, and the data they index."""

    apply_fn: Callable[[Params, Tensor], Tensor]  # eval mode
    loss_fn: Callable[[Params, Batch], Tensor]  # weighted mean loss, dropout keyed by batch.key
    data: FederatedData
    prepare: Callable[[Tensor], Tensor]


def model_functions(task: Task, model: nn.Module, data: FederatedData) -> ModelFunctions:
    """Build apply/loss functions around `model` with torch.func.functional_call."""

    def apply_fn(params: Params, x: Tensor) -> Tensor:
        return torch.func.functional_call(model, params, (x,))

    def loss_fn(params: Params, batch: Batch) -> Tensor:
        output = torch.func.functional_call(model, params, (batch.x,), {"key": batch.key})
        losses = per_example_loss(task, output, batch.x, batch.y)  # [B]
        return (losses * batch.weight).sum() / batch.weight.sum().clamp_min(1.0)

    return ModelFunctions(apply_fn=apply_fn, loss_fn=loss_fn, data=data, prepare=task.prepare)


def with_precision(fns: ModelFunctions, precision: str, device: torch.device) -> ModelFunctions:
    """Return model functions for train.precision: fp32 (as is), tf32 (CUDA), bf16 (autocast).

    Parameters, optimiser state and aggregation stay float32 in every mode; bf16 runs the
    model's forward (and so its backward) under torch.autocast. On a CUDA device the process's
    TF32 flags (process-wide in PyTorch) follow the precision (cuda_tf32_flags). The `fused`
    back end, whose dense trainer is fp32 only, refuses bf16 (backends/fused.py).
    """
    if precision == "tf32" and device.type != "cuda":
        raise ConfigError(f"train.precision='tf32' needs a CUDA device; got device {device}. "
                          "Use --precision bf16 on a CPU, or fp32.")
    if device.type == "cuda":
        cuda_tf32_flags(precision)
    if precision in ("fp32", "tf32"):
        return fns
    if device.type == "cpu" and not _native_bf16_cpu():
        log.warning("train.precision='bf16' on a CPU without native bf16 (no avx512_bf16/amx_bf16 flag): "
                    "PyTorch emulates it, and its convolutions fall back to a slow reference kernel (8x slower "
                    "than fp32 in make bench on such a CPU); use --precision fp32 here.")
    loss_fn, apply_fn = fns.loss_fn, fns.apply_fn

    def bf16_loss(params: dict[str, Tensor], batch: Any) -> Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return loss_fn(params, batch).float()

    def bf16_apply(params: dict[str, Tensor], x: Tensor) -> Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return apply_fn(params, x).float()

    return replace(fns, loss_fn=bf16_loss, apply_fn=bf16_apply)


def cuda_tf32_flags(precision: str) -> None:
    """Set the CUDA matmul and cuDNN TF32 flags for train.precision: on for tf32, off otherwise.

    PyTorch's defaults are matmul off but cuDNN on, so without this `--precision fp32` still ran
    convolutions in TF32 (10-bit mantissa) on Ampere and later GPUs. bf16 turns both off too:
    the float32 work outside autocast is then float32. The flags are process-wide, so the last
    run built in a process sets them for every run in it.
    """
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def _native_bf16_cpu() -> bool:
    """True when /proc/cpuinfo lists avx512_bf16 or amx_bf16 (True where it cannot be read)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags
