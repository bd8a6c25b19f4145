"""GRU and LSTM classifiers over an image's rows (28 steps of 28 features), stock torch only."""

import math

from torch import nn


def _steps_features(input_shape):
    """[C, H, W] -> H steps of C*W features; [T, F] -> T steps of F."""
    if len(input_shape) == 2:
        return input_shape[0], input_shape[1]
    return input_shape[-2], input_shape[-1] * math.prod(input_shape[:-2])


class GRUClassifier(nn.Module):
    """nn.GRU(hidden 64, 1 layer, batch_first) -> last hidden state -> Dropout -> Linear(classes)."""

    def __init__(self, num_classes, input_shape, hidden=64):
        super().__init__()
        self.steps, features = _steps_features(input_shape)
        self.rnn = nn.GRU(features, hidden, batch_first=True)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(hidden, num_classes)

    def forward(self, x):
        seq = x.reshape(len(x), self.steps, -1) if x.dim() != 3 else x  # [B, 1, H, W] -> [B, H, W]
        _, h = self.rnn(seq)  # h: [1, B, hidden]
        return self.out(self.drop(h[-1]))


class LSTMClassifier(nn.Module):
    """nn.LSTM(hidden 64, 2 layers, dropout 0.1 between them) -> last output -> Linear(classes)."""

    def __init__(self, num_classes, input_shape, hidden=64):
        super().__init__()
        self.steps, features = _steps_features(input_shape)
        self.rnn = nn.LSTM(features, hidden, num_layers=2, dropout=0.1, batch_first=True)
        self.out = nn.Linear(hidden, num_classes)

    def forward(self, x):
        seq = x.reshape(len(x), self.steps, -1) if x.dim() != 3 else x
        out, _ = self.rnn(seq)  # [B, T, hidden]
        return self.out(out[:, -1])
