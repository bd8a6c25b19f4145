"""User-style models with stock torch layers only, as a researcher writes them (issue 37).

Each file is what a user passes as `fedcli train --model tests/byo/stock_models/FILE.py:FACTORY`
(or `fedcli.train(model=...)`) on a bundled image task (`mnist`: 10 classes, `femnist`: 62;
examples are [1, 28, 28]). The sequence models read an image as 28 steps of 28 features (its
rows), which is how an RNN/transformer is tried on MNIST; no bundled sequence task fits better
(shakespeare is next-character with its own vocabulary, har is not bundled).

- `bn_cnn.py:BNDropoutCNN`: Conv2d + BatchNorm2d + nn.Dropout + nn.functional.dropout
- `rnn.py:GRUClassifier`, `rnn.py:LSTMClassifier`: nn.GRU / nn.LSTM over the rows, Dropout head
- `transformer.py:TinyTransformer`: nn.TransformerEncoder of nn.TransformerEncoderLayer (attention,
  LayerNorm, its own dropout)
- `resnet.py:resnet18`: torchvision's ResNet-18 with its BatchNorm, first conv adapted to the
  input channels and 28x28 inputs

MODELS maps a short name to the `file.py:factory` reference (absolute paths).
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent

MODELS: dict[str, str] = {
    "bn_cnn": f"{HERE / 'bn_cnn.py'}:BNDropoutCNN",
    "gru": f"{HERE / 'rnn.py'}:GRUClassifier",
    "lstm": f"{HERE / 'rnn.py'}:LSTMClassifier",
    "transformer": f"{HERE / 'transformer.py'}:TinyTransformer",
    "resnet18": f"{HERE / 'resnet.py'}:resnet18",
}
