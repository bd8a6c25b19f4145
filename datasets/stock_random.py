"""Random ops in a user model's forward, drawn from the step's key: same seed, same run.

A model that calls `torch.rand`, `torch.randn`, `torch.randint`, `torch.bernoulli`, `torch.normal`
(or their `_like` forms, or the in-place `Tensor.uniform_` / `normal_` / `bernoulli_`) in its
forward (noise injection, the reparameterisation trick, stochastic depth) would draw from torch's
global generator: two runs with the same `--seed` differ, a resume is not bit-exact, and under
vmap the call fails ("called random operation while in randomness error mode"). While
`StockLayers` (datasets/stock_layers.py) is active with a training key, these calls draw instead
from the counter-based hash that keyed dropout uses (`keyed_uniform`, fedcli/datasets/models.py),
salted with the call's number in the forward like a dropout call: a pure function of (seed, round,
client, step, call), the same on every back end, and vmappable (per client under vmap).

- uniform: keyed_uniform (24-bit float32 in [0, 1)), scaled to [low, high) and cast to the dtype;
- normal: Box-Muller on two keyed uniforms (u1 moved into (0, 1] so log(u1) is finite);
- bernoulli: keyed uniform < p; randint: floor(low + u (high - low)), clamped below high.

The draws are not torch's (a seeded torch run and a fedcli run give different numbers); their
distributions are. A call with its own `generator=` keeps it (the user chose the stream), and a
call outside training (evaluation, no key) uses torch's generator as before. `torch.randperm` and
`torch.multinomial` are not keyed (they still use torch's generator and fail under vmap).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from fedcli.datasets.models import keyed_uniform


class StockLayers(Protocol):
    """What the handlers use of datasets/stock_layers.py's mode (a Protocol: that module imports this one)."""

    key: Tensor | None
    calls: int


RANDOM_SALT = 1 << 21  # streams of keyed random ops: RANDOM_SALT + n for the n-th keyed call of a forward
_TINY = 1.0 / float(1 << 25)  # half the uniform's resolution: u + _TINY lies in (0, 1)


def _size(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[int, ...]:
    """The size of `rand(*size)`, `rand(size)` or `rand(size=...)`."""
    if "size" in kwargs:
        return tuple(int(n) for n in kwargs["size"])
    if len(args) == 1 and isinstance(args[0], Sequence | torch.Size):
        return tuple(int(n) for n in args[0])
    return tuple(int(n) for n in args)


def next_uniform(
    mode: StockLayers, shape: Sequence[int], device: torch.device | str | None, base: int = RANDOM_SALT
) -> Tensor:
    """U[0, 1) float32 of `shape` from the mode's key, the next call's stream (salt `base` + the call's number)."""
    assert mode.key is not None
    salt = base + mode.calls
    mode.calls += 1
    where = torch.device(device) if device is not None else mode.key.device
    return keyed_uniform(mode.key * 7919 + salt, torch.Size(shape), where)


def _normal(mode: StockLayers, shape: Sequence[int], device: torch.device | str | None) -> Tensor:
    """N(0, 1) float32 of `shape` by Box-Muller."""
    u1 = next_uniform(mode, shape, device) + _TINY
    u2 = next_uniform(mode, shape, device)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)


def _keyed(mode: StockLayers, kwargs: dict[str, Any]) -> bool:
    return mode.key is not None and kwargs.get("generator") is None


def _factory_kwargs(kwargs: dict[str, Any], like: Tensor | None = None) -> tuple[torch.dtype, Any, bool]:
    dtype = kwargs.get("dtype") or (like.dtype if like is not None else torch.get_default_dtype())
    device = kwargs.get("device") or (like.device if like is not None else None)
    return dtype, device, bool(kwargs.get("requires_grad", False))


def _fresh(draw: Callable[[StockLayers, Sequence[int], Any], Tensor]) -> Callable[..., Tensor]:
    """`torch.rand`, `torch.randn`: (*size, dtype=, device=, requires_grad=, generator=)."""

    def handler(mode: StockLayers, func: Any, *args: Any, **kwargs: Any) -> Tensor:
        if not _keyed(mode, kwargs) or "out" in kwargs:
            return func(*args, **kwargs)  # type: ignore[no-any-return]
        dtype, device, grad = _factory_kwargs(kwargs)
        out = draw(mode, _size(args, kwargs), device).to(dtype)
        return out.requires_grad_(grad) if grad else out

    return handler


def _like(draw: Callable[[StockLayers, Sequence[int], Any], Tensor]) -> Callable[..., Tensor]:
    """torch.rand_like / torch.randn_like (input, dtype=, device=)."""

    def handler(mode: StockLayers, func: Any, input: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if not _keyed(mode, kwargs) or args:
            return func(input, *args, **kwargs)  # type: ignore[no-any-return]
        dtype, device, _ = _factory_kwargs(kwargs, input)
        return draw(mode, input.shape, device).to(dtype)

    return handler


def _randint_bounds(args: Sequence[Any]) -> tuple[int, int, Sequence[Any]]:
    """`torch.randint`'s (high, size) or (low, high, size): (low, high, the rest)."""
    if len(args) >= 2 and isinstance(args[1], int) and not isinstance(args[1], bool):
        return int(args[0]), int(args[1]), args[2:]
    return 0, int(args[0]), args[1:]


def _draw_int(
    mode: StockLayers, low: int, high: int, shape: Sequence[int], device: Any, dtype: torch.dtype
) -> Tensor:
    u = next_uniform(mode, shape, device).to(torch.float64)
    ints = torch.floor(low + u * (high - low)).clamp(max=high - 1)
    return ints.to(dtype)


def _randint(mode: StockLayers, func: Any, *args: Any, **kwargs: Any) -> Tensor:
    if not _keyed(mode, kwargs) or "out" in kwargs:
        return func(*args, **kwargs)  # type: ignore[no-any-return]
    low, high, rest = _randint_bounds(args)
    low, high = int(kwargs.get("low", low)), int(kwargs.get("high", high))
    shape = _size(rest, kwargs)
    _, device, _ = _factory_kwargs(kwargs)
    return _draw_int(mode, low, high, shape, device, kwargs.get("dtype") or torch.int64)


def _randint_like(mode: StockLayers, func: Any, input: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    if not _keyed(mode, kwargs):
        return func(input, *args, **kwargs)  # type: ignore[no-any-return]
    low, high = (0, int(args[0])) if len(args) == 1 else (int(args[0]), int(args[1]))
    dtype, device, _ = _factory_kwargs(kwargs, input)
    return _draw_int(mode, low, high, input.shape, device, dtype)


def _bernoulli(mode: StockLayers, func: Any, input: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """`torch.bernoulli` of (probs) or (input, p): 1 where a keyed uniform < p."""
    if not _keyed(mode, kwargs) or "out" in kwargs:
        return func(input, *args, **kwargs)  # type: ignore[no-any-return]
    p = args[0] if args else kwargs.get("p", input)
    u = next_uniform(mode, input.shape, input.device)
    return (u < p).to(input.dtype)


def _normal_fn(mode: StockLayers, func: Any, *args: Any, **kwargs: Any) -> Tensor:
    """`torch.normal` of (mean, std) with tensor mean and/or std, or (mean, std, size) with floats."""
    if not _keyed(mode, kwargs) or "out" in kwargs:
        return func(*args, **kwargs)  # type: ignore[no-any-return]
    mean = args[0] if args else kwargs["mean"]
    std = args[1] if len(args) > 1 else kwargs.get("std", 1.0)
    size = args[2] if len(args) > 2 else kwargs.get("size")
    tensors = [t for t in (mean, std) if isinstance(t, Tensor)]
    if size is not None:
        shape: Sequence[int] = tuple(size)
    elif tensors:
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    else:
        return func(*args, **kwargs)  # type: ignore[no-any-return]
    device = tensors[0].device if tensors else kwargs.get("device")
    dtype = tensors[0].dtype if tensors else (kwargs.get("dtype") or torch.get_default_dtype())
    return (mean + std * _normal(mode, shape, device)).to(dtype)


def _inplace(
    value: Callable[[StockLayers, Tensor, tuple[Any, ...], dict[str, Any]], Any],
) -> Callable[..., Tensor]:
    """`Tensor.uniform_` / `normal_` / `bernoulli_`: `self` overwritten, outside autograd, with `value`'s keyed draw."""

    def handler(mode: StockLayers, func: Any, self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if not _keyed(mode, kwargs):
            return func(self, *args, **kwargs)  # type: ignore[no-any-return]
        with torch.no_grad():
            return self.copy_(value(mode, self, args, kwargs))

    return handler


def _uniform_value(mode: StockLayers, self: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    low = args[0] if args else kwargs.get("from", 0.0)
    high = args[1] if len(args) > 1 else kwargs.get("to", 1.0)
    return low + (high - low) * next_uniform(mode, self.shape, self.device)


def _normal_value(mode: StockLayers, self: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    mean = args[0] if args else kwargs.get("mean", 0.0)
    std = args[1] if len(args) > 1 else kwargs.get("std", 1.0)
    return mean + std * _normal(mode, self.shape, self.device)


def _bernoulli_value(mode: StockLayers, self: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    p = args[0] if args else kwargs.get("p", 0.5)
    return (next_uniform(mode, self.shape, self.device) < p).to(self.dtype)


RANDOM_HANDLERS: dict[Any, Callable[..., Any]] = {
    torch.rand: _fresh(next_uniform),
    torch.randn: _fresh(_normal),
    torch.rand_like: _like(next_uniform),
    torch.randn_like: _like(_normal),
    torch.randint: _randint,
    torch.randint_like: _randint_like,
    torch.bernoulli: _bernoulli,
    Tensor.bernoulli: _bernoulli,
    torch.normal: _normal_fn,
    Tensor.uniform_: _inplace(_uniform_value),
    Tensor.normal_: _inplace(_normal_value),
    Tensor.bernoulli_: _inplace(_bernoulli_value),
}
