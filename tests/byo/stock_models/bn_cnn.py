"""A small CNN with BatchNorm and Dropout, the way most tutorials write one (stock torch only)."""

import torch
from torch import nn
from torch.nn import functional as F


class BNDropoutCNN(nn.Module):
    """Conv(16)-BN-ReLU-pool, Conv(32)-BN-ReLU-pool, Dropout2d, Linear(64), dropout, Linear(classes).

    For [B, C, 28, 28] images (mnist/femnist: C = 1).
    """

    def __init__(self, num_classes, input_shape):
        super().__init__()
        channels = input_shape[0]
        self.conv1 = nn.Conv2d(channels, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.drop2d = nn.Dropout2d(0.1)
        self.fc1 = nn.Linear(32 * (input_shape[1] // 4) * (input_shape[2] // 4), 64)
        self.bn3 = nn.BatchNorm1d(64)
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x):
        h = F.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        h = F.max_pool2d(torch.relu(self.bn2(self.conv2(h))), 2)
        h = self.drop2d(h).flatten(1)
        h = self.drop(torch.relu(self.bn3(self.fc1(h))))
        h = F.dropout(h, 0.1, self.training)  # functional dropout too
        return self.fc2(h)
