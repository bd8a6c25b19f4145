"""A small transformer encoder over an image's rows as tokens, stock torch only."""

import math

import torch
from torch import nn


class TinyTransformer(nn.Module):
    """Linear row embedding + learned positions -> 2 x nn.TransformerEncoderLayer(d 32, 4 heads,
    dropout 0.1) -> mean over tokens -> LayerNorm -> Linear(classes)."""

    def __init__(self, num_classes, input_shape, d_model=32, heads=4, layers=2):
        super().__init__()
        if len(input_shape) == 2:
            self.tokens, features = input_shape
        else:
            self.tokens, features = input_shape[-2], input_shape[-1] * math.prod(input_shape[:-2])
        self.embed = nn.Linear(features, d_model)
        self.pos = nn.Parameter(torch.randn(self.tokens, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=2 * d_model, dropout=0.1, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, num_classes)

    def forward(self, x):
        seq = x.reshape(len(x), self.tokens, -1)
        h = self.encoder(self.embed(seq) + self.pos)
        return self.out(self.norm(h.mean(1)))
