"""The model as the engine uses it: stateless functions of the parameters, and their precision.

`model_functions` wraps an `nn.Module` with torch.func.functional_call (algorithms never see
the module, docs/style.md rule 6); `with_precision` applies train.precision to those functions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from fedcli.algorithms.base import Batch, Params
from fedcli.datasets.federated import CohortData, FederatedData
from fedcli.datasets.stock_layers import StockLayers, needs_stock_layers
from fedcli.datasets.tasks import Task, TaskData, per_example_loss
from fedcli.datasets.yours.model import accepts_key, tracking
from fedcli.engine.clientstate import ClientStateStore
from fedcli.errors import ConfigError

if TYPE_CHECKING:
    from fedcli.config.sections import RunConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFunctions:
    """The stateless model functions a ClientContext exposes, and the data they index."""

    apply_fn: Callable[[Params, Tensor], Tensor]  # eval mode
    loss_fn: Callable[[Params, Batch], Tensor]  # weighted mean loss, dropout keyed by batch.key
    data: FederatedData | CohortData  # CohortData: a disk store's cohort for one round (engine/rounds.py)
    prepare: Callable[[Tensor], Tensor]
    # training batches only: (x prepared, step key) -> x, data.augment's crop / flip (datasets/augment.py); None = none
    augment: Callable[[Tensor, Tensor], Tensor] | None = None
    # BatchNorm running statistics the clients carry (train.bn_stats aggregate | local); None: none, or estimate
    client_stats: ClientStats | None = None


def model_functions(
    task: Task, model: nn.Module, data: FederatedData, bn_stats: str = "aggregate"
) -> ModelFunctions:
    """Build apply/loss functions around `model` with torch.func.functional_call.

    The dropout key goes to forward only when its signature names `key` (a user's model may not:
    datasets/yours/model.py). A model whose layers behave differently in training and evaluation
    (BatchNorm, nn.Dropout) trains in train mode and is evaluated in eval mode. BatchNorm's
    running statistics (`bn_stats`, train.bn_stats; docs/bring-your-own.md, "BatchNorm"): `aggregate`
    and `local`, the clients carry them through their local steps (`ClientStats`; the server's
    aggregate is what evaluation uses); `estimate`, they are recomputed on the server for each
    evaluated model (`BatchNormStats`). A model with stock dropout, RNN or attention layers (or
    code of its own) runs inside datasets/stock_layers.py's `StockLayers`: dropout keyed by the step's
    key, RNNs as functional recurrences, so that it runs under vmap and alike on every back end.
    """
    keyed = accepts_key(model)
    stock = needs_stock_layers(model)
    modal = stock or any(isinstance(m, (_BatchNorm, _DropoutNd)) for m in model.modules())
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    for m in norms:
        m.track_running_stats = (
            False  # batch statistics, no buffer written, unless a client carries them (ClientStats)
        )
    carried = ClientStats(model, norms, bn_stats) if norms and bn_stats != "estimate" else None
    stats = BatchNormStats(model, task, data, norms) if norms and carried is None else None

    def apply_fn(params: Params, x: Tensor) -> Tensor:
        if not modal:
            with StockLayers(None) if stock else nullcontext():
                return torch.func.functional_call(model, params, (x,))
        if stats is not None:
            stats.update(params)
        tensors = (
            params if carried is None else {**params, **carried.current}
        )  # eval mode: the global statistics
        model.eval()
        try:
            with StockLayers(None) if stock else nullcontext():
                return torch.func.functional_call(model, tensors, (x,))
        finally:
            model.train()

    def loss_fn(params: Params, batch: Batch) -> Tensor:
        own = None if carried is None else carried.client  # set only inside a carrying trainer's step
        tensors = params if own is None else {**params, **own}
        with StockLayers(batch.key) if stock else nullcontext(), tracking(norms, own is not None):
            output = torch.func.functional_call(
                model, tensors, (batch.x,), {"key": batch.key} if keyed else {}
            )
        losses = per_example_loss(task, output, batch.x, batch.y)  # [B]
        return (losses * batch.weight).sum() / batch.weight.sum().clamp_min(1.0)

    return ModelFunctions(
        apply_fn=apply_fn, loss_fn=loss_fn, data=data, prepare=task.prepare, client_stats=carried
    )


RUNNING = ("running_mean", "running_var", "num_batches_tracked")


class ClientStats:
    """BatchNorm running statistics carried by the clients (train.bn_stats `aggregate` or `local`).

    Each client starts a round from the global statistics (`current`; `local`: its own, engine/
    clientstate.py) and updates them with BatchNorm's own momentum rule at every local step, on
    the batch that step trains on (engine/local.py `carrying_stats`; under vmap the statistics
    are batched, one copy per client, so the in-place update is per client). The server sets
    `current` to the example-weighted mean of the clients' statistics (`aggregate_stats`);
    evaluation, model.pt and checkpoints use it. `client` holds the statistics of the step
    being computed (inside the gradient transform) and is None otherwise: `loss_fn` then
    normalises by batch statistics and writes nothing (an algorithm's extra passes).
    """

    def __init__(self, model: nn.Module, norms: list[_BatchNorm], mode: str) -> None:
        self.mode = mode
        ids = {id(m) for m in norms}
        self.names = tuple(
            f"{prefix}.{name}" if prefix else name
            for prefix, m in model.named_modules()
            if id(m) in ids
            for name in RUNNING
            if getattr(m, name, None) is not None
        )
        buffers = dict(model.named_buffers())
        self.current: dict[str, Tensor] = {k: buffers[k].detach().clone() for k in self.names}
        self.client: dict[str, Tensor] | None = None
        # local (FedBN): each client's own statistics in a client-state store (a fresh client: the initial
        # ones); `current`, for evaluation only, is their example-weighted mean over the clients that have
        # stored any: sum_c n_c s_c (float64) / sum_c n_c, updated as clients store new ones
        self.store: ClientStateStore | None = None
        self.sum: dict[str, Tensor] = {}
        self.weight = 0.0
        if mode == "local":
            initial = {k: v.clone() for k, v in self.current.items()}
            self.store = ClientStateStore(lambda: {k: v.clone() for k, v in initial.items()})
        # momentum=None (a cumulative average): BatchNorm reads its count as a Python number, which vmap
        # cannot; `cumulative_momenta` sets one factor for the step, `cumulative_fix` each client's own
        self.cumulative = [
            (m, f"{prefix}." if prefix else "")
            for prefix, m in model.named_modules()
            if id(m) in ids and m.momentum is None
        ]

    def cumulative_momenta(self, step: int) -> tracking_momenta:
        """Inside the block, each momentum=None BatchNorm uses 1 / (its global count + step + 1): what
        PyTorch computes at a client's `step`-th step of the round when none before it was masked."""
        return tracking_momenta([(m, self._factor(prefix, step)) for m, prefix in self.cumulative])

    def _factor(self, prefix: str, step: int) -> float:
        return 1.0 / (int(self.current[prefix + "num_batches_tracked"]) + step + 1)

    def cumulative_fix(
        self, before: dict[str, Tensor], own: dict[str, Tensor], step: int
    ) -> dict[str, Tensor]:
        """`own` with each momentum=None BatchNorm's statistics at the client's own factor, 1 / (its count
        + 1): where masked steps came before (a shorter client's epoch), the step's shared factor f
        was not its; the batch statistic is recovered from the update (b = (own - (1 - f) old) / f)."""
        for _, prefix in self.cumulative:
            f = self._factor(prefix, step)
            own_f = 1.0 / (before[prefix + "num_batches_tracked"].to(torch.float64) + 1)
            same = own_f == f
            for name in ("running_mean", "running_var"):
                old, new = before[prefix + name], own[prefix + name]
                batch = (new.to(torch.float64) - (1 - f) * old.to(torch.float64)) / f
                fixed = ((1 - own_f) * old.to(torch.float64) + own_f * batch).to(new.dtype)
                own[prefix + name] = torch.where(same, new, fixed)
        return own

    def start(self, cohort: Any, device: torch.device) -> dict[str, Tensor]:
        """Each client's statistics at the start of the round, [C, ...]: the global ones (aggregate),
        or its own from the store (local; the initial ones for a client never trained)."""
        if self.store is not None:
            return dict(self.store.gather(cohort, device))
        return {k: v.unsqueeze(0).expand(len(cohort), *v.shape).clone() for k, v in self.current.items()}

    def update(
        self, cohort: Any, seen: Any, start: dict[str, Tensor], new: dict[str, Tensor], weights: Tensor
    ) -> None:
        """The round's kept clients' final statistics `new` [C, ...] (`start`: theirs at its start; `seen`:
        [C] bool, the client had stored statistics before; `weights`: [C] examples): aggregate, the
        global ones become their example-weighted mean; local, each client stores its own and the
        evaluation statistics become the example-weighted mean over every client stored so far."""
        if self.store is None:
            self.current = aggregate_stats(new, weights)
            return
        self.store.scatter(cohort, new)
        n = weights.to(torch.float64)
        old = torch.as_tensor(seen, device=n.device)
        for k, v in new.items():
            w = n.reshape(-1, *([1] * (v.dim() - 1)))
            added = (w * v.to(torch.float64)).sum(0) - (w * start[k].to(torch.float64))[old].sum(0)
            self.sum[k] = self.sum[k] + added if k in self.sum else added
        self.weight += float(n[~old].sum())
        mean = {k: s / self.weight for k, s in self.sum.items()}
        self.current = {
            k: (m if new[k].is_floating_point() else m.round()).to(new[k].dtype) for k, m in mean.items()
        }

    def snapshot(self) -> dict[str, Tensor]:
        """What a checkpoint keeps (tensors by name): the global statistics; local, also the running
        sums (`sum.<name>`, `weight`) and each stored client's own (`client.<id>.<name>`)."""
        out = dict(self.current)
        if self.store is not None:
            out.update({f"sum.{k}": v for k, v in self.sum.items()})
            out["weight"] = torch.tensor(self.weight, dtype=torch.float64)
            for client, state in self.store.state_dict().items():
                out.update({f"client.{client}.{k}": v for k, v in state.items()})
        return out

    def load(self, buffers: dict[str, Tensor], what: str) -> None:
        """Set the global statistics from a checkpoint's or model.pt's (they must be this model's).

        Raises:
            ConfigError: `buffers` lacks one of this model's statistics or has another shape.
        """
        if any(k not in buffers or buffers[k].shape != self.current[k].shape for k in self.names):
            raise ConfigError(
                f"{what} holds BatchNorm statistics of another model ({len(buffers)} buffers, this "
                f"model has {len(self.names)}); use the model the run trained."
            )
        self.current = {k: buffers[k].to(self.current[k].device, self.current[k].dtype) for k in self.names}
        if self.store is None or "weight" not in buffers:
            return
        device = self.current[self.names[0]].device
        self.sum = {k: buffers[f"sum.{k}"].to(device) for k in self.names if f"sum.{k}" in buffers}
        self.weight = float(buffers["weight"])
        clients: dict[int, dict[str, Tensor]] = {}
        for key, v in buffers.items():
            if key.startswith("client."):
                _, client, name = key.split(".", 2)
                clients.setdefault(int(client), {})[name] = v
        self.store.load_state_dict({c: {k: s[k] for k in self.names} for c, s in sorted(clients.items())})


def aggregate_stats(buffers: dict[str, Tensor], weights: Tensor) -> dict[str, Tensor]:
    """The example-weighted mean of the clients' BatchNorm statistics ([C, ...] each; `weights` [C]).

    running_mean and running_var: sum_c n_c s_c / sum_c n_c, the FedAvg weighting (McMahan et al.
    2017) applied to the statistics as to the parameters (docs/bring-your-own.md, "BatchNorm");
    num_batches_tracked: the weighted mean of the clients' counts, rounded to the nearest integer.
    """
    share = weights.to(torch.float64) / weights.to(torch.float64).sum()
    out = {}
    for k, v in buffers.items():
        w = share.to(v.device).reshape(-1, *([1] * (v.dim() - 1)))
        mean = (v.to(torch.float64) * w).sum(0)
        out[k] = mean.round().to(v.dtype) if not v.is_floating_point() else mean.to(v.dtype)
    return out


class tracking_momenta:  # noqa: N801  (a context manager named for what it does)
    """Set the given BatchNorm modules' momentum inside the block, None again after it."""

    def __init__(self, factors: list[tuple[_BatchNorm, float]]) -> None:
        self.factors = factors

    def __enter__(self) -> None:
        for m, factor in self.factors:
            m.momentum = factor

    def __exit__(self, *exc: object) -> None:
        for m, _ in self.factors:
            m.momentum = None


class BatchNormStats:
    """BatchNorm running statistics of the model being evaluated, recomputed from its parameters.

    Clients train in train mode, where BatchNorm normalises by each batch's own statistics and
    the running statistics do not enter the result; they are not kept between clients or rounds
    (nothing to checkpoint, results independent of the cohort order). Before the global model is
    evaluated, its running statistics are estimated afresh (as SWA's `update_bn`): reset, then a
    cumulative average (momentum None) over forward passes in train mode (dropout keyed by key 0,
    datasets/stock_layers.py: the same masks every time) on the first
    `EXAMPLES` examples of the training data in a fixed order, batches of `BATCH`. The same
    parameters reuse the estimate (evaluation runs in chunks). In a deployment this is one more
    federated statistics round; in this simulation the server reads the clients' examples.
    """

    EXAMPLES = 1024  # examples the statistics are estimated from (all of them when fewer)
    BATCH = 128

    def __init__(self, model: nn.Module, task: Task, data: FederatedData, norms: list[_BatchNorm]) -> None:
        self.model, self.prepare, self.data, self.norms = model, task.prepare, data, norms
        self.last: tuple[Any, ...] | None = None
        order = torch.randperm(len(data.x), generator=torch.Generator().manual_seed(0))[: self.EXAMPLES]
        self.index = order.sort().values

    def update(self, params: Params) -> None:
        """Estimate the running statistics of `params` into the model's buffers (once per parameters)."""
        key = tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in params.values())
        if key == self.last:
            return
        momenta = [m.momentum for m in self.norms]
        for m in self.norms:
            m.track_running_stats = True
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over the batches
        buffers = dict(self.model.named_buffers())
        try:
            with torch.no_grad():
                for start in range(0, len(self.index), self.BATCH):
                    x, _ = self.data.take(self.index[start : start + self.BATCH])
                    x = self.prepare(x).to(self.data.dtype)
                    with StockLayers(
                        torch.zeros((), dtype=torch.int64, device=x.device)
                    ):  # fixed dropout masks
                        torch.func.functional_call(self.model, {**params, **buffers}, (x,))
        finally:
            for m, momentum in zip(self.norms, momenta, strict=True):
                m.momentum, m.track_running_stats = momentum, False
        self.last = key


def with_precision(fns: ModelFunctions, precision: str, device: torch.device) -> ModelFunctions:
    """Return model functions for train.precision: fp32 (as is), tf32 (CUDA), bf16 (autocast).

    Parameters, optimiser state and aggregation stay float32 in every mode; bf16 runs the
    model's forward (and so its backward) under torch.autocast. On a CUDA device the process's
    TF32 flags (process-wide in PyTorch) follow the precision (cuda_tf32_flags). The `fused`
    back end, whose dense trainer is fp32 only, refuses bf16 (backends/fused.py).
    """
    if precision == "tf32" and device.type != "cuda":
        raise ConfigError(
            f"train.precision='tf32' needs a CUDA device; got device {device}. "
            "Use --precision bf16 on a CPU, or fp32."
        )
    if device.type == "cuda":
        cuda_tf32_flags(precision)
    if precision in ("fp32", "tf32"):
        return fns
    if device.type == "cpu" and not _native_bf16_cpu():
        log.warning(
            "train.precision='bf16' on a CPU without native bf16 (no avx512_bf16/amx_bf16 flag): "
            "PyTorch emulates it, and its convolutions fall back to a slow reference kernel (8x slower "
            "than fp32 in make bench on such a CPU); use --precision fp32 here."
        )

    def bf16(fn: Callable[[Params, Any], Tensor]) -> Callable[[Params, Any], Tensor]:
        def autocast(params: Params, arg: Any) -> Tensor:  # arg: a Batch (loss_fn) or inputs (apply_fn)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return fn(params, arg).float()

        return autocast

    return replace(fns, loss_fn=bf16(fns.loss_fn), apply_fn=bf16(fns.apply_fn))


def cuda_tf32_flags(precision: str) -> None:
    """Set the CUDA matmul and cuDNN TF32 flags for train.precision: on for tf32, off otherwise.

    PyTorch's defaults are matmul off but cuDNN on, so without this `--precision fp32` still ran
    convolutions in TF32 (10-bit mantissa) on Ampere and later GPUs. bf16 turns both off too:
    the float32 work outside autocast is then float32. The flags are process-wide, so the last
    run built in a process sets them for every run in it.
    """
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def _native_bf16_cpu() -> bool:
    """True when /proc/cpuinfo lists avx512_bf16 or amx_bf16 (True where it cannot be read)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


def build_user_model(
    cfg: RunConfig, task: Task, data: TaskData, *, on_change: str = "refuse"
) -> tuple[Task, nn.Module, RunConfig]:
    """Your own model (`data.model` = `module:factory`, datasets/yours/model.py), built and checked.

    Checks the source against the recorded sha256 (`on_change`: "refuse" for a run and its
    resume, "warn" for `fedcli evaluate`), calls the factory with the task's shape facts it
    names, runs one forward pass and the loss on a real batch (8 training examples) and probes
    vmap with the run's training step (BatchNorm statistics carried where the run carries them,
    train.precision). Returns the task with the model added, the model (seeded by the caller) and the config
    with `data.model_args` recorded.

    Raises:
        ConfigError: one line naming what failed and the fix.
    """
    from fedcli.datasets.yours import model as user_model

    ref = str(cfg.data.model)
    user_model.check_source(ref, cfg.data.model_sha256, on_change=on_change)
    num_classes = data.num_classes
    if (
        num_classes is None and task.kind == "classification"
    ):  # the loader does not say: the built-in model's outputs
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            builtin = task.models[task.default_model]()
            num_classes = int(builtin(task.prepare(data.x[:1]).to(torch.float32)).shape[-1])
    facts = user_model.shape_facts(task.prepare, data.x, num_classes)
    kwargs = user_model.factory_kwargs(user_model.load_factory(ref), facts)
    model = user_model.make_model(ref, kwargs)
    x = task.prepare(data.x[:8]).to(torch.float32)
    from fedcli.algorithms import ALGORITHMS

    alg = ALGORITHMS.get(cfg.algorithm.name)  # the statistics are carried as engine/setup.py bn_stats_of says
    carry = cfg.train.bn_stats != "estimate" and alg is not None and alg.local is not None
    user_model.check_model(
        ref,
        model,
        kind=task.kind,
        num_classes=num_classes,
        x=x,
        y=data.y[:8],
        loss=lambda out, xb, yb: per_example_loss(task, out, xb, yb),
        carry_stats=carry,
        precision=cfg.train.precision,
    )
    cfg = replace(cfg, data=replace(cfg.data, model_args=user_model.encode_args(kwargs)))
    return user_model.with_model(task, ref, kwargs), model, cfg


def final_buffers(fns: ModelFunctions, model: nn.Module | None, params: Params) -> dict[str, Tensor] | None:
    """The BatchNorm running statistics of `params` as evaluation uses them (the clients' aggregate,
    or estimated: train.bn_stats), on the CPU, for model.pt and the MLflow model; None for a model
    without them (every built-in model)."""
    if model is None or not any(isinstance(m, _BatchNorm) for m in model.modules()):
        return None
    if fns.client_stats is not None:
        buffers = {k: v.detach().cpu().clone() for k, v in model.named_buffers()}
        return {**buffers, **{k: v.detach().cpu().clone() for k, v in fns.client_stats.current.items()}}
    on_device = {k: v.to(fns.data.device) for k, v in params.items()}
    fns.apply_fn(
        on_device, fns.prepare(fns.data.x[:1].to(fns.data.device)).to(fns.data.dtype)
    )  # estimates them for these parameters
    return {k: v.detach().cpu().clone() for k, v in model.named_buffers()}
