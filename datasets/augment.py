"""Per-example augmentation of image batches: random crop with padding, horizontal flip, normalisation.

Declared as `data.augment` (config / `--set data.augment=crop:4,flip` / the Python API's `augment=`),
a list of operations applied in this order whatever order they are written in:

- `normalize:M:S` (or per channel `normalize:M1/M2/M3:S1/S2/S3`): x -> (x - M) / S, on training
  *and* evaluation inputs (it becomes part of the task's `prepare`: `with_normalisation`);
- `crop:P`: pad each image by P pixels of zeros on every side (after normalisation: the mean) and
  cut a random H x W window (P >= 1; 4 is the CIFAR-10 convention of He et al. 2016, §4.2);
- `flip`: mirror left-right with probability 1/2.

Crop and flip apply to training batches only, inside the client step after the batch is gathered
by index (engine/cohort.py `make_context`), batched over the examples: no per-example Python, and no
random number generator in the step. Each example's offsets and flip bit are a pure function of the
step's key (`Batch.key`: from the run's streams, a function of (seed, round, client, step);
engine/seeding.py `step_keys`) and the example's slot in the batch, through the SplitMix64 finaliser
(Steele, Lea, Flood 2014) in int64 tensor arithmetic. So every back end (loop, vmap, process,
distributed; `fused` refuses augmentation) and a resumed run draw the same crops and flips, and
vmap needs no in-graph randomness. Evaluation is never augmented.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from fedcli.datasets.models import splitmix64
from fedcli.datasets.tasks import Task
from fedcli.errors import ConfigError

_MASK62 = (1 << 62) - 1
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # SplitMix64's increment as signed int64 (wraparound)
_SALT = 0x5DEECE66D  # separates the augmentation draw from the dropout draw of the same key


@dataclass(frozen=True)
class AugmentSpec:
    """data.augment parsed: crop padding (0 = none), flip, normalisation mean / std per channel (None = none)."""

    crop: int = 0
    flip: bool = False
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    @property
    def random(self) -> bool:
        """Whether training batches are augmented (crop or flip); normalisation alone is not."""
        return self.crop > 0 or self.flip


def parse(items: Sequence[str] | None) -> AugmentSpec:
    """Parse data.augment; ConfigError naming the item and the forms accepted."""
    spec = AugmentSpec()
    forms = "crop:P (pixels, >= 1), flip, normalize:M:S (or normalize:M1/M2/M3:S1/S2/S3)"
    for item in items or ():
        name, _, arg = str(item).strip().partition(":")
        if name == "crop":
            if not arg.isdigit() or int(arg) < 1:
                raise ConfigError(
                    f"data.augment item {item!r}: crop needs a padding of >= 1 pixels, e.g. crop:4."
                )
            spec = replace(spec, crop=int(arg))
        elif name == "flip" and not arg:
            spec = replace(spec, flip=True)
        elif name == "normalize":
            mean, _, std = arg.partition(":")
            try:
                m, s = tuple(float(v) for v in mean.split("/")), tuple(float(v) for v in std.split("/"))
            except ValueError:
                m = s = ()
            if not m or len(m) != len(s) or any(v <= 0 for v in s):
                raise ConfigError(
                    f"data.augment item {item!r}: normalize needs a mean and a std > 0 (one, or one "
                    "per channel joined by /), e.g. normalize:0.5:0.25."
                )
            spec = replace(spec, mean=m, std=s)
        else:
            raise ConfigError(f"data.augment item {item!r} is not an operation; use {forms}.")
    return spec


def check(spec: AugmentSpec, task: Task, example: Tensor) -> None:
    """Refuse augmentation of data that is not images [C, H, W] once prepared (one line, the fix)."""
    if not (spec.random or spec.mean is not None):
        return
    shape = tuple(task.prepare(example[:1]).shape[1:])
    if len(shape) != 3:
        raise ConfigError(
            f"data.augment {'crop/flip' if spec.random else 'normalize'} needs images [C, H, W]; task "
            f"{task.name} gives examples of shape {list(shape)}. Drop data.augment, or give images "
            "x [N, H, W] or [N, C, H, W]."
        )
    if spec.mean is not None and len(spec.mean) not in (1, shape[0]):
        raise ConfigError(
            f"data.augment normalize gives {len(spec.mean)} means for images of {shape[0]} channels; "
            "give one value or one per channel."
        )


def with_normalisation(task: Task, spec: AugmentSpec) -> Task:
    """The task whose `prepare` also normalises (training and evaluation); the task itself without it."""
    if spec.mean is None or spec.std is None:
        return task
    prepare, mean, std = task.prepare, spec.mean, spec.std

    def normalised(x: Tensor) -> Tensor:
        out = prepare(x)
        shift = torch.tensor(mean, dtype=out.dtype, device=out.device).view(-1, 1, 1)
        scale = torch.tensor(std, dtype=out.dtype, device=out.device).view(-1, 1, 1)
        return (out - shift) / scale

    return replace(task, prepare=normalised)


def draws(key: Tensor, batch: int) -> Tensor:
    """[B] non-negative int64 draws of a step key for each example slot 0..B-1 (a pure function)."""
    slots = torch.arange(1, batch + 1, dtype=torch.int64, device=key.device)
    return splitmix64((key.to(torch.int64) ^ _SALT) + slots * _GOLDEN) & _MASK62


def augmenter(spec: AugmentSpec) -> Callable[[Tensor, Tensor], Tensor] | None:
    """The training-batch transform (x [B, C, H, W] prepared, step key) -> x, or None when nothing is random."""
    if not spec.random:
        return None
    pad, flip = spec.crop, spec.flip

    def augment(x: Tensor, key: Tensor) -> Tensor:
        h = draws(key, x.shape[0])  # [B]
        if pad:
            height, width = x.shape[-2], x.shape[-1]
            span = 2 * pad + 1
            dy, dx = h % span, (h >> 20) % span  # offsets into the padded image, 0..2P
            padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))  # [B, C, H + 2P, W + 2P]
            rows = (dy[:, None] + torch.arange(height, device=x.device))[:, None, :, None]  # [B, 1, H, 1]
            rows = rows.expand(x.shape[0], x.shape[1], height, width + 2 * pad)
            x = padded.gather(2, rows)  # [B, C, H, W + 2P]
            cols = (dx[:, None] + torch.arange(width, device=x.device))[:, None, None, :]  # [B, 1, 1, W]
            x = x.gather(3, cols.expand(x.shape[0], x.shape[1], height, width))
        if flip:
            mirrored = ((h >> 40) & 1).to(torch.bool)[:, None, None, None]
            x = torch.where(mirrored, x.flip(-1), x)
        return x

    return augment
