"""Models of the papers, written so that torch.func can vmap them over clients.

Every model's `forward(x, key=None)` takes an optional int64 0-d `key`: when given, dropout
draws its mask from a counter-based hash of (key, position) (`keyed_dropout`), so the
same (seed, round, client, step) gives the same mask whether clients run one by one or
as one vmapped cohort (STYLE.md rule 8). `key=None` is evaluation mode (no dropout).
No BatchNorm anywhere: its running statistics are mutable state vmap cannot carry
(reference/performance.md §2.2); models normalise with GroupNorm where they need to.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

# splitmix64 constants as signed int64 (torch has no uint64 arithmetic)
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _shift_right(z: Tensor, n: int) -> Tensor:
    """Logical right shift of int64 z by n bits."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def keyed_uniform(key: Tensor, shape: torch.Size, device: torch.device) -> Tensor:
    """Return U[0, 1) float32 of `shape`, a pure function of (key, position) (splitmix64)."""
    count = 1
    for n in shape:
        count *= n
    stream = _mix(key * _GOLDEN + _GOLDEN)  # decorrelate neighbouring keys first
    z = _mix(stream + torch.arange(1, count + 1, device=device, dtype=torch.int64) * _GOLDEN)
    return (_shift_right(z, 40).to(torch.float32) / float(1 << 24)).reshape(shape)


def _mix(z: Tensor) -> Tensor:
    """The splitmix64 finaliser on int64 (wrapping multiplication)."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def keyed_dropout(h: Tensor, key: Tensor | None, p: float, salt: int) -> Tensor:
    """Inverted dropout with a mask from keyed_uniform(key + salt); identity if key is None."""
    if key is None or p == 0.0:
        return h
    keep = keyed_uniform(key * 7919 + salt, h.shape, h.device) >= p
    return h * keep.to(h.dtype) / (1.0 - p)


class MLP(nn.Module):
    """Fully connected ReLU network, e.g. 784-200-200-62 (the 2NN of McMahan et al. 2017)."""

    def __init__(self, in_features: int, hidden: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        sizes = (in_features, *hidden)
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:], strict=True))
        self.out = nn.Linear(sizes[-1], num_classes)

    def forward(self, x: Tensor, key: Tensor | None = None) -> Tensor:
        h = x.flatten(start_dim=1)
        for layer in self.hidden:
            h = torch.relu(layer(h))
        return self.out(h)


class ReddiCNN(nn.Module):
    """EMNIST CNN of Reddi et al. 2021 / FedPA App. D.1: 1,206,590 parameters for 62 classes.

    Conv(32, 3x3) -> Conv(64, 3x3) -> MaxPool 2 -> Dropout 0.25 -> Dense 128 -> Dropout 0.5
    -> Dense(num_classes). PyTorch default init (the TFF model uses Glorot-normal).
    """

    def __init__(self, num_classes: int = 62, in_channels: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: Tensor, key: Tensor | None = None) -> Tensor:
        h = torch.relu(self.conv1(x))
        h = torch.max_pool2d(torch.relu(self.conv2(h)), 2)
        h = keyed_dropout(h, key, 0.25, salt=1)
        h = torch.relu(self.fc1(h.flatten(start_dim=1)))
        h = keyed_dropout(h, key, 0.5, salt=2)
        return self.fc2(h)


class Linear(nn.Module):
    """Linear model x -> x @ w (+ b) for least squares / logistic regression."""

    def __init__(self, in_features: int, out_features: int = 1, bias: bool = True,
                 squeeze: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        self.squeeze = squeeze

    def forward(self, x: Tensor, key: Tensor | None = None) -> Tensor:
        out = self.linear(x.flatten(start_dim=1))
        return out.squeeze(-1) if self.squeeze else out


def num_parameters(model: nn.Module) -> int:
    """Return the number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
