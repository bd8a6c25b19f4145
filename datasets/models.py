"""Models of the papers, written so that torch.func can vmap them over clients.

Every model's `forward(x, key=None)` takes an optional int64 0-d `key`: when given, dropout
draws its mask from a counter-based hash of (key, position) (`keyed_dropout`), so the
same (seed, round, client, step) gives the same mask whether clients run one by one or
as one vmapped cohort (docs/style.md rule 8). `key=None` is evaluation mode (no dropout).
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
    count = shape.numel()
    stream = splitmix64(key * _GOLDEN + _GOLDEN)  # decorrelate neighbouring keys first
    z = splitmix64(stream + torch.arange(1, count + 1, device=device, dtype=torch.int64) * _GOLDEN)
    return (_shift_right(z, 40).to(torch.float32) / float(1 << 24)).reshape(shape)


def splitmix64(z: Tensor) -> Tensor:
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

    activation = "relu"  # torch.<activation> between layers (the fused back end reads it too)

    def __init__(self, in_features: int, hidden: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        sizes = (in_features, *hidden)
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:], strict=True))
        self.out = nn.Linear(sizes[-1], num_classes)

    def forward(self, x: Tensor, key: Tensor | None = None) -> Tensor:
        h = x.flatten(start_dim=1)
        for layer in self.hidden:
            h = getattr(torch, self.activation)(layer(h))
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

    def __init__(
        self, in_features: int, out_features: int = 1, bias: bool = True, squeeze: bool = False
    ) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        self.squeeze = squeeze

    def forward(self, x: Tensor, key: Tensor | None = None) -> Tensor:
        out = self.linear(x.flatten(start_dim=1))
        return out.squeeze(-1) if self.squeeze else out


def num_parameters(model: nn.Module) -> int:
    """Return the number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ----------------------------------------------------------------------------- data-task models
# Appended for the data tasks (mnist, cifar10/100, shakespeare, stackoverflow, har, sent140).


class SigmoidMLP(MLP):
    """Bayes-ADMM MLP (reference/bayes_admm.md §9.2): hidden (200, 100), sigmoid activations."""

    activation = "sigmoid"

    def __init__(
        self, in_features: int = 784, hidden: tuple[int, ...] = (200, 100), num_classes: int = 10
    ) -> None:
        super().__init__(in_features, hidden, num_classes)


class McMahanCNN(nn.Module):
    """MNIST CNN of McMahan et al. 2017: 1,663,370 parameters for 10 classes (28x28 input).

    Conv(32, 5x5, same) -> MaxPool 2 -> Conv(64, 5x5, same) -> MaxPool 2 -> Dense 512 -> Dense.
    `image_size` (H, W) sizes the first dense layer for other inputs (bring-your-own data).
    """

    def __init__(
        self, num_classes: int = 10, in_channels: int = 1, image_size: tuple[int, int] = (28, 28)
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.fc1 = nn.Linear(64 * (image_size[0] // 4) * (image_size[1] // 4), 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x: Tensor, key: Tensor | None = None) -> Tensor:
        h = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        h = torch.max_pool2d(torch.relu(self.conv2(h)), 2)
        return self.fc2(torch.relu(self.fc1(h.flatten(start_dim=1))))


class LeNet5(nn.Module):
    """LeNet-5-style CIFAR CNN: Conv(6, 5x5) -> pool -> Conv(16, 5x5) -> pool -> 120 -> 84 -> K.

    62,006 parameters for CIFAR-10 (ReLU and max-pooling, as in most FL CIFAR baselines).
    `widths`: the two convolutions' channels and the two hidden layers' sizes (32x32 inputs).
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 3,
        widths: tuple[int, int, int, int] = (6, 16, 120, 84),
    ) -> None:
        super().__init__()
        c1, c2, h1, h2 = widths
        self.conv1 = nn.Conv2d(in_channels, c1, 5)
        self.conv2 = nn.Conv2d(c1, c2, 5)
        self.fc1 = nn.Linear(c2 * 5 * 5, h1)
        self.fc2 = nn.Linear(h1, h2)
        self.fc3 = nn.Linear(h2, num_classes)

    def forward(self, x: Tensor, key: Tensor | None = None) -> Tensor:
        h = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        h = torch.max_pool2d(torch.relu(self.conv2(h)), 2)
        h = torch.relu(self.fc1(h.flatten(start_dim=1)))
        return self.fc3(torch.relu(self.fc2(h)))


class ZenkeCNN(nn.Module):
    """CifarNet of Zenke et al. as used by Bayes-ADMM (reference/bayes_admm.md §9.2).

    conv3x3(32, pad 1), conv3x3(32), pool, dropout .25; conv3x3(64, pad 1), conv3x3(64), pool,
    dropout .25; FC 2304 -> 512, dropout .5; FC 512 -> K.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 32, 3)
        self.conv3 = nn.Conv2d(32, 64, 3, padding=1)
        self.conv4 = nn.Conv2d(64, 64, 3)
        self.fc1 = nn.Linear(2304, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x: Tensor, key: Tensor | None = None) -> Tensor:
        h = torch.max_pool2d(torch.relu(self.conv2(torch.relu(self.conv1(x)))), 2)
        h = keyed_dropout(h, key, 0.25, salt=1)
        h = torch.max_pool2d(torch.relu(self.conv4(torch.relu(self.conv3(h)))), 2)
        h = keyed_dropout(h, key, 0.25, salt=2)
        h = keyed_dropout(torch.relu(self.fc1(h.flatten(start_dim=1))), key, 0.5, salt=3)
        return self.fc2(h)


class AcarCNN(LeNet5):
    """FedDyn CIFAR CNN of Acar et al. (reference/bayes_admm.md §9.2), no dropout: LeNet5's layers, wider.

    conv5x5(64)-ReLU-pool2, conv5x5(64)-ReLU-pool2, FC 1600 -> 384 -> 192 -> K with ReLU.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__(num_classes, in_channels, widths=(64, 64, 384, 192))


class _BasicBlock(nn.Module):
    """ResNet basic block with GroupNorm in place of BatchNorm."""

    def __init__(self, in_planes: int, planes: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(groups, planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(groups, planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.GroupNorm(groups, planes)
            )

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(h)) + self.shortcut(x))


class ResNet18GN(nn.Module):
    """CIFAR ResNet-18 with GroupNorm (2 groups), as Reddi et al. 2021 use for CIFAR-100.

    3x3 stem (no max-pool), stages of 2 basic blocks with 64/128/256/512 channels, global
    average pooling, linear head: 11,220,132 parameters for 100 classes.
    """

    def __init__(self, num_classes: int = 100, in_channels: int = 3, groups: int = 2) -> None:
        super().__init__()
        self.stem = nn.Conv2d(in_channels, 64, 3, padding=1, bias=False)
        self.stem_norm = nn.GroupNorm(groups, 64)
        blocks, planes = [], 64
        for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [_BasicBlock(planes, width, stride, groups), _BasicBlock(width, width, 1, groups)]
            planes = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(512, num_classes)

    def forward(self, x: Tensor, key: Tensor | None = None) -> Tensor:
        h = self.blocks(torch.relu(self.stem_norm(self.stem(x))))
        return self.head(h.mean(dim=(-2, -1)))


class StackedLSTM(nn.Module):
    """Multi-layer LSTM written with matmuls over time, so torch.func.vmap can batch it.

    Parameters are named and initialised like nn.LSTM (uniform(-1/sqrt(H), 1/sqrt(H))); gate
    order i, f, g, o. Input [B, T, E] -> outputs of the last layer [B, T, H].
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        bound = hidden_size**-0.5
        self.weights = nn.ParameterList()
        for layer in range(num_layers):
            size_in = input_size if layer == 0 else hidden_size
            for shape in ((4 * hidden_size, size_in), (4 * hidden_size, hidden_size), (4 * hidden_size,)):
                self.weights.append(nn.Parameter(torch.empty(shape).uniform_(-bound, bound)))

    def forward(self, x: Tensor) -> Tensor:
        batch, steps = x.shape[0], x.shape[1]
        h_seq = x
        for layer in range(len(self.weights) // 3):
            # one by one: a slice is a new ParameterList, which wraps each tensor in a new Parameter, cut off from
            # the graph of the loop back end's autograd leaves (functional_call): no gradient reached them
            w_ih, w_hh, bias = (self.weights[3 * layer + i] for i in range(3))
            inputs = h_seq @ w_ih.T + bias  # [B, T, 4H]
            h = x.new_zeros(batch, self.hidden_size)
            c = x.new_zeros(batch, self.hidden_size)
            outputs = []
            for t in range(steps):
                i, f, g, o = (inputs[:, t] + h @ w_hh.T).chunk(4, dim=-1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                outputs.append(h)
            h_seq = torch.stack(outputs, dim=1)
        return h_seq


class CharLSTM(nn.Module):
    """LEAF Shakespeare model: Embedding(V, 8) -> 2-layer LSTM(256) -> Dense(V) on the last step.

    Input: int64 character ids [B, T]; output: next-character logits [B, V].
    """

    def __init__(self, vocab_size: int = 80, embed_dim: int = 8, hidden: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.lstm = StackedLSTM(embed_dim, hidden, layers)
        self.out = nn.Linear(hidden, vocab_size)

    def forward(self, x: Tensor, key: Tensor | None = None) -> Tensor:
        return self.out(self.lstm(self.embed(x))[:, -1])


class WordLSTM(nn.Module):
    """StackOverflow next-word model of Reddi et al. 2021 (Table 7): Embedding(V, 96) ->
    LSTM(670) -> Dense(96) -> Dense(V), applied at every position: [B, T] -> [B, T, V].
    """

    def __init__(self, vocab_size: int = 10004, embed_dim: int = 96, hidden: int = 670) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.lstm = StackedLSTM(embed_dim, hidden, 1)
        self.project = nn.Linear(hidden, embed_dim)
        self.out = nn.Linear(embed_dim, vocab_size)

    def forward(self, x: Tensor, key: Tensor | None = None) -> Tensor:
        return self.out(self.project(self.lstm(self.embed(x))))


class TextLSTM(nn.Module):
    """Sent140-style classifier (LEAF stacked_lstm): Embedding -> 2-layer LSTM(100) on the
    last step -> Dense(128) -> Dense(K). Embeddings are learned (LEAF uses frozen GloVe)."""

    def __init__(
        self, vocab_size: int, num_classes: int = 2, embed_dim: int = 100, hidden: int = 100
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.lstm = StackedLSTM(embed_dim, hidden, 2)
        self.fc = nn.Linear(hidden, 128)
        self.out = nn.Linear(128, num_classes)

    def forward(self, x: Tensor, key: Tensor | None = None) -> Tensor:
        return self.out(torch.relu(self.fc(self.lstm(self.embed(x))[:, -1])))


class HarCNN(nn.Module):
    """Small 1-D CNN for UCI HAR windows [B, 128, 9] (time x channel) -> 6 activities.

    Conv1d(9->32, 5) -> GroupNorm(4) -> ReLU -> MaxPool 2 -> Conv1d(32->64, 5) -> GroupNorm(4)
    -> ReLU -> global average pool -> Dropout 0.5 -> Dense(K).
    """

    def __init__(self, num_classes: int = 6, channels: int = 9) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, 32, 5, padding=2)
        self.norm1 = nn.GroupNorm(4, 32)
        self.conv2 = nn.Conv1d(32, 64, 5, padding=2)
        self.norm2 = nn.GroupNorm(4, 64)
        self.out = nn.Linear(64, num_classes)

    def forward(self, x: Tensor, key: Tensor | None = None) -> Tensor:
        h = x.transpose(-1, -2)  # [B, 9, 128]
        h = torch.max_pool1d(torch.relu(self.norm1(self.conv1(h))), 2)
        h = torch.relu(self.norm2(self.conv2(h))).mean(dim=-1)
        return self.out(keyed_dropout(h, key, 0.5, salt=1))


class SqueezeOutput(nn.Module):
    """Wrap a one-output model so it returns [B] (regression targets are [B])."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor, key: Tensor | None = None) -> Tensor:
        return self.inner(x, key).squeeze(-1)
