"""Test-wide settings: one intra-op thread (small tensors run faster, and the 2-core CI box
is not oversubscribed when a test spawns worker processes)."""

import torch

torch.set_num_threads(1)
