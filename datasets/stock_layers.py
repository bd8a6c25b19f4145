"""Stock torch layers under every back end: keyed dropout and functional recurrences.

`StockLayers` is a `torch.overrides.TorchFunctionMode` that engine/model.py enters around each
training call of a model (`loss_fn`, with the step's key: `Batch.key`, engine/seeding.py) and
each evaluation call (`apply_fn`, no key). Inside it:

- Dropout of every kind (`nn.Dropout`, `nn.Dropout1d/2d/3d`, `nn.AlphaDropout`,
  `nn.FeatureAlphaDropout`, the inter-layer dropout of `nn.GRU`/`nn.LSTM`/`nn.RNN`, the attention
  dropout of `nn.MultiheadAttention` and `F.scaled_dot_product_attention`, and the functional
  forms `F.dropout*`, `F.alpha_dropout`, `F.feature_alpha_dropout`, `torch.dropout`, ...) draws
  its mask from the step's key with the counter-based hash of `keyed_dropout`
  (fedcli/datasets/models.py), the n-th dropout call of a forward salted with n. A client's
  masks are then a function of (seed, round, client, step, call) alone: the same on the loop, vmap,
  process and distributed back ends, and vmap needs no random op. Evaluation (eval mode) has
  no dropout. Without a key (a caller outside the engine) dropout falls back to torch's own.
- `nn.GRU`, `nn.LSTM` (with `proj_size` too) and `nn.RNN` (tanh, relu) run as a functional
  recurrence with the module's own weights (`torch.gru` & co. are replaced; the same gate
  equations as PyTorch's docs), so they run under vmap, where PyTorch's fused kernels do not.
  Packed sequences go to PyTorch's kernel (they do not run under vmap: the model check sends such a
  model to the loop). The recurrence differs from PyTorch's MKL/cuDNN kernels by float rounding only
  (tests/byo/test_stock_layers_engine.py: max abs difference under 1e-5 on a forward pass).
  Outside torch.func transforms (the loop's autograd, evaluation) PyTorch's kernel runs (faster client
  by client), unless a multi-layer RNN's inter-layer dropout needs its keyed mask.
- Random ops in a forward (`torch.rand`, `randn`, `randint`, `bernoulli`, `normal`, their `_like`
  and in-place forms) draw from the same keyed hash (datasets/stock_random.py).

docs/bring-your-own.md, "Stock layers", says what each back end does with them.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from fedcli.datasets.stock_random import RANDOM_HANDLERS, next_uniform

SALT = (
    1 << 20
)  # keyed masks of stock layers: salt SALT + n for the n-th dropout call of a forward (built-ins use 1-3)
_ALPHA = 1.7580993408473766  # SELU's alpha * scale, as PyTorch's alpha dropout


class StockLayers(TorchFunctionMode):
    """Dropout keyed by `key` and RNNs as functional recurrences while the mode is active."""

    def __init__(self, key: Tensor | None) -> None:
        super().__init__()
        self.key = key
        self.calls = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        handler = _HANDLERS.get(func)
        if handler is None:
            return func(*args, **(kwargs or {}))
        return handler(self, func, *args, **(kwargs or {}))

    def dropout(self, x: Tensor, p: float, *, feature: bool = False, alpha: bool = False) -> Tensor:
        """Inverted dropout of `x` (feature: one mask value per [N, C] channel) from the keyed mask."""
        shape = (*x.shape[:2], *([1] * (x.dim() - 2))) if feature else x.shape
        if p >= 1.0:
            return x * 0.0
        # the keep mask: keyed_uniform(key, salted by SALT + the call's number) >= p
        keep = (next_uniform(self, shape, x.device, SALT) >= p).to(x.dtype)
        if not alpha:
            return x * keep / (1.0 - p)
        a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p))  # PyTorch's _dropout_impl, alpha form
        return x * (keep * a) + ((keep - 1.0) * (_ALPHA * a) + _ALPHA * a * p)


def _off(mode: StockLayers, training: bool, p: float) -> bool:
    return not training or p == 0.0 or mode.key is None


def _functional_dropout(
    train_default: bool, *, feature: bool = False, alpha: bool = False, batched_dim: int = 0
) -> Callable[..., Tensor]:
    """F.dropout (`training` defaults to True), F.alpha_dropout, F.feature_alpha_dropout (False) and F.dropout1d
    (batched: 3-D), dropout3d (5-D), where an unbatched input gets a batch of one, and dropout2d (as is)."""

    def handler(
        mode: StockLayers,
        func: Any,
        input: Tensor,
        p: float = 0.5,
        training: bool = train_default,
        inplace: bool = False,
    ) -> Tensor:
        if _off(mode, training, p):
            return func(input, p, training, inplace)  # type: ignore[no-any-return]
        if batched_dim and input.dim() == batched_dim - 1:
            return mode.dropout(input.unsqueeze(0), p, feature=True).squeeze(0)
        return mode.dropout(input, p, feature=feature, alpha=alpha)

    return handler


def _vf_dropout(feature: bool, alpha: bool) -> Callable[..., Tensor]:
    """torch.dropout(input, p, train) and its feature / alpha forms, called directly."""

    def handler(mode: StockLayers, func: Any, input: Tensor, p: float, train: bool) -> Tensor:
        if _off(mode, train, p):
            return func(input, p, train)  # type: ignore[no-any-return]
        return mode.dropout(input, p, feature=feature, alpha=alpha)

    return handler


def _sdpa(
    mode: StockLayers,
    func: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """F.scaled_dot_product_attention with attention dropout: the math form with a keyed mask."""
    if dropout_p == 0.0 or mode.key is None:
        return func(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,  # type: ignore[no-any-return]
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    length, source = query.size(-2), key.size(-2)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    if enable_gqa:
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    scores = query @ key.transpose(-2, -1) * scale
    if is_causal:
        allowed = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        scores = (
            scores.masked_fill(~attn_mask, float("-inf"))
            if attn_mask.dtype == torch.bool
            else scores + attn_mask
        )
    weights = torch.softmax(scores, dim=-1)
    return mode.dropout(weights, dropout_p) @ value


def _cell(
    kind: str,
    x_proj: Tensor,
    h: Tensor,
    c: Tensor | None,
    w_hh: Tensor,
    b_hh: Tensor | None,
    w_hr: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """One step of the recurrence (PyTorch's equations; gates in PyTorch's weight order)."""
    gates_h = F.linear(h, w_hh, b_hh)
    if kind == "gru":  # r, z, n
        i_r, i_z, i_n = x_proj.chunk(3, -1)
        h_r, h_z, h_n = gates_h.chunk(3, -1)
        r = torch.sigmoid(i_r + h_r)
        z = torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        return (1 - z) * n + z * h, None
    if kind == "lstm":  # i, f, g, o
        assert c is not None
        i, f, g, o = (x_proj + gates_h).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return (h if w_hr is None else F.linear(h, w_hr)), c
    pre = x_proj + gates_h
    return (torch.tanh(pre) if kind == "rnn_tanh" else torch.relu(pre)), None


def _recurrence(kind: str) -> Callable[..., Any]:
    """torch.gru / torch.lstm / torch.rnn_tanh / torch.rnn_relu (unpacked input) as a Python recurrence."""

    def handler(mode: StockLayers, func: Any, *args: Any) -> Any:
        if not isinstance(args[1] if kind == "lstm" else args[2], (list, tuple)):
            return func(*args)  # PyTorch's kernel: packed sequences (not under vmap)
        x, hx, weights, has_biases, num_layers, dropout, train, bidirectional, batch_first = args
        keyed = dropout > 0 and train and num_layers > 1 and mode.key is not None
        if torch._C._functorch.maybe_current_level() is None and not keyed:
            return func(
                *args
            )  # no torch.func transform (the loop's autograd, evaluation): PyTorch's fused kernel
        if batch_first:
            x = x.transpose(0, 1)  # [T, B, C]
        dirs = 2 if bidirectional else 1
        per = len(weights) // (num_layers * dirs)
        h0, c0 = (hx[0], hx[1]) if kind == "lstm" else (hx, None)
        layer_in, hs, cs = x, [], []
        for layer in range(num_layers):
            outs = []
            for d in range(dirs):
                idx = layer * dirs + d
                w = weights[idx * per : (idx + 1) * per]
                b_ih, b_hh = (w[2], w[3]) if has_biases else (None, None)
                w_hr = w[-1] if kind == "lstm" and per in (3, 5) else None
                seq = layer_in if d == 0 else layer_in.flip(0)
                x_proj = F.linear(seq, w[0], b_ih)  # every step's input projection at once
                h, c = h0[idx], None if c0 is None else c0[idx]
                steps = []
                for t in range(seq.size(0)):
                    h, c = _cell(kind, x_proj[t], h, c, w[1], b_hh, w_hr)
                    steps.append(h)
                out = torch.stack(steps)
                outs.append(out if d == 0 else out.flip(0))
                hs.append(h)
                if c is not None:
                    cs.append(c)
            layer_in = torch.cat(outs, -1) if dirs == 2 else outs[0]
            if dropout > 0 and train and layer < num_layers - 1:
                layer_in = (
                    mode.dropout(layer_in, dropout) if mode.key is not None else F.dropout(layer_in, dropout)
                )
        output = layer_in.transpose(0, 1) if batch_first else layer_in
        if kind == "lstm":
            return output, torch.stack(hs), torch.stack(cs)
        return output, torch.stack(hs)

    return handler


def _composite(func: Any) -> Callable[..., Any]:
    """A torch.nn.functional function that hands itself to torch function modes before it runs
    (F.multi_head_attention_forward): its own body run with the mode active, so that the dropout and
    attention calls inside it reach the mode. The body is the same code object with a
    `has_torch_function` that says no (it would hand the call back to the mode again)."""
    body = types.FunctionType(
        func.__code__,
        {**func.__globals__, "has_torch_function": lambda *_: False},
        func.__name__,
        func.__defaults__,
        func.__closure__,
    )
    body.__kwdefaults__ = func.__kwdefaults__

    def handler(mode: StockLayers, _func: Any, *args: Any, **kwargs: Any) -> Any:
        with mode:
            return body(*args, **kwargs)

    return handler


_HANDLERS: dict[Any, Callable[..., Any]] = {
    F.multi_head_attention_forward: _composite(F.multi_head_attention_forward),
    F.dropout: _functional_dropout(True),
    F.alpha_dropout: _functional_dropout(False, alpha=True),
    F.feature_alpha_dropout: _functional_dropout(False, feature=True, alpha=True),
    F.dropout1d: _functional_dropout(True, feature=True, batched_dim=3),
    F.dropout2d: _functional_dropout(True, feature=True),
    F.dropout3d: _functional_dropout(True, feature=True, batched_dim=5),
    torch.dropout: _vf_dropout(False, False),
    torch.feature_dropout: _vf_dropout(True, False),
    torch.alpha_dropout: _vf_dropout(False, True),
    torch.feature_alpha_dropout: _vf_dropout(True, True),
    F.scaled_dot_product_attention: _sdpa,
    torch.gru: _recurrence("gru"),
    torch.lstm: _recurrence("lstm"),
    torch.rnn_tanh: _recurrence("rnn_tanh"),
    torch.rnn_relu: _recurrence("rnn_relu"),
    **RANDOM_HANDLERS,  # torch.rand & co. in a forward: keyed like dropout (datasets/stock_random.py)
}

_STOCK = (
    nn.modules.dropout._DropoutNd,
    nn.RNNBase,
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)


def needs_stock_layers(model: nn.Module) -> bool:
    """True when the model has stock dropout, RNN or attention layers, or code of its own (a forward
    that may call F.dropout): fedcli's built-in models (keyed dropout of their own) run without the mode."""
    return any(
        isinstance(m, _STOCK) or not type(m).__module__.startswith(("torch.", "fedcli."))
        for m in model.modules()
    )
