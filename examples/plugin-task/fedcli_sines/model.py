"""`sine-cnn`: a small 1-D CNN for any task whose examples are [channels, steps] signals.

A model plugin is a factory (here the class itself) that fedcli calls with the keyword
arguments its signature names, `num_classes` and `input_shape` (docs/bring-your-own.md,
"Your model"). GroupNorm, not BatchNorm, so every executor runs it (vmap included).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class SineCNN(nn.Module):
    """Conv1d(C -> 8, 5) -> GroupNorm(2) -> ReLU -> mean over time -> Linear(num_classes)."""

    def __init__(self, num_classes: int, input_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.conv = nn.Conv1d(input_shape[0], 8, 5, padding=2)
        self.norm = nn.GroupNorm(2, 8)
        self.out = nn.Linear(8, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.relu(self.norm(self.conv(x))).mean(-1))
