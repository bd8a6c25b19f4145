"""The algorithm contract: types, the `Algorithm` record and shared pytree math.

An algorithm is a module of pure functions over explicit state (docs/architecture.md §3, docs/style.md
rules 3 and 6). The engine calls them in this order every round::

    state  = server_init(params, hp, opt)                       # once
    bc     = broadcast(state, hp)                               # what clients download
    out_i  = client_update(ctx_i, bc, client_state_i, hp, opt)  # per client, or vmapped
    state, diagnostics = server_update(state, outs, weights, hp, opt)

An algorithm whose local work is local SGD and then a computation on its result declares it
(`Algorithm.local = Local(request, finish)`, a `LocalSGD` request) instead of writing the loop,
so that every back end trains it its own way (`client_update` is then `optim.local_update(local)`).

`client_update` is written for ONE client and must also run under `torch.func.vmap` over
a cohort: no `.item()`, no Python branching on tensor values, a fixed number of local
steps with a step mask (a masked step leaves every piece of state unchanged), and
randomness only from tensors in `ctx`. Python branching on static values (`ctx.round_idx`,
hyperparameters) is fine: they are the same for the whole cohort.

Everything here imports only torch and the standard library (docs/style.md rule 1).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, NamedTuple

import torch
from torch import Tensor

Params = dict[str, Tensor]
Diagnostics = dict[str, Tensor]


class Batch(NamedTuple):
    """One local minibatch with a per-example weight (0 for padding)."""

    x: Tensor  # [B, ...]
    y: Tensor  # [B, ...]
    weight: Tensor  # [B]   1.0 for a real example, 0.0 for padding
    key: Tensor  # []     int64 seed for in-model randomness (dropout); see models.keyed_dropout


LossFn = Callable[[Params, Batch], Tensor]


class ClientContext(NamedTuple):
    """What one client's local work may use, built by the engine's executor.

    Local steps are laid out epoch-major: step `s` belongs to epoch `s // steps_per_epoch`.
    Clients with fewer batches than the cohort's longest get masked (no-op) steps at the
    end of each epoch, so `step_mask[s] == 0` means "leave the state unchanged".
    """

    loss_fn: LossFn  # (params, batch) -> weighted mean loss over the batch
    apply_fn: Callable[[Params, Tensor], Tensor]  # (params, x) -> model output, eval mode
    batch: Callable[[int], Batch]  # step index -> that step's minibatch
    step_mask: Tensor  # [S] float, 1.0 = a real step
    num_examples: Tensor  # [] float, examples in one pass over the local data
    num_epochs: int  # E
    steps_per_epoch: int  # K (padded), so S = E * K
    round_idx: int  # 1-based training round (static for the cohort)
    noise: dict[str, Tensor]  # pre-drawn N(0, 1) tensors declared by Algorithm.noise_shapes

    @property
    def num_steps(self) -> int:
        """Total local steps S = E * K."""
        return self.num_epochs * self.steps_per_epoch


class ClientOut(NamedTuple):
    """One client's result: what it uploads, its new private state, local metrics."""

    upload: dict[str, Any]  # tensors/pytrees sent to the server (counted as bytes up)
    #                         server_update gets an UploadSums instead where the engine ran upload_sums
    state: Any  # new per-client state (None for stateless algorithms)
    metrics: dict[str, Tensor]  # scalar local metrics, e.g. {"train_loss": ...}


@dataclass
class UploadSums:
    """server_update's `outs.upload` where the engine reduced the cohort's uploads a group at a time
    (Algorithm.upload_sums; engine/streaming.py stream_cohort): no [C, ...] upload is ever held.

    `sums` is the sum over the groups of upload_sums(group) over the clients kept (finite uploads),
    `count` how many were kept, `finite` (numpy bool [C]) which cohort rows were, `nbytes` the bytes
    uploaded by all C clients (comm/bytes_up). A plain class, not a pytree: take_rows leaves it alone.
    """

    sums: Any
    count: int
    finite: Any
    nbytes: float


class ServerOptState(NamedTuple):
    """Server optimiser moments (zeros-shaped dicts when unused)."""

    first: Params  # momentum / Adam m_t
    second: Params  # Adam/Adagrad/Yogi v_t
    step: Tensor  # [] number of server steps taken


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Client and server optimiser settings shared by the FedOpt family.

    Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan. Adaptive Federated
    Optimization. ICLR 2021. arXiv:2003.00295. The server treats the weighted mean client
    delta (old minus new, a pseudo-gradient) as the gradient of its optimiser (Alg. 1).
    Defaults follow FedPA Table 4 (EMNIST column) where the paper fixes them.
    """

    client_lr: float = 0.01  # eta_l; FedPA Table 6 EMNIST
    client_momentum: float = 0.0  # heavy-ball momentum of local SGD (FedPA Table 4 uses 0.9)
    local_epochs: int = 1  # E; passes over the local data per round
    server_opt: str = "sgd"  # sgd | momentum | adam | adagrad | yogi
    server_lr: float = 1.0  # eta_g; 1.0 with sgd is McMahan et al.'s FedAvg
    server_momentum: float = 0.9  # beta for --server-opt momentum (FedPA Table 4)
    server_beta1: float = 0.9  # Adam/Yogi beta1 (FedPA Table 4)
    server_beta2: float = 0.99  # Adam/Yogi beta2 (FedPA Table 4)
    server_tau: float = 1e-3  # adaptivity tau of FedAdam/FedYogi/FedAdagrad (Reddi et al. §3)
    server_bias_correction: bool = (
        False  # Adam/Yogi moments / (1 - beta^t) (PyTorch); Reddi et al. Alg. 2 has none
    )
    server_adagrad_beta1: float = (
        0.0  # FedAdagrad momentum beta1; 0 = Reddi et al.'s code (Keras Adagrad), Alg. 2 prints one
    )

    def __post_init__(self) -> None:
        require(self.local_epochs >= 1, "train.local_epochs", ">= 1", self.local_epochs)
        require(
            self.server_opt in SERVER_OPTIMIZERS,
            "train.server_opt",
            f"one of {', '.join(SERVER_OPTIMIZERS)}",
            self.server_opt,
        )
        for key in ("client_lr", "server_lr", "server_tau"):
            require(getattr(self, key) > 0, f"train.{key}", "> 0", getattr(self, key))
        for key in (
            "client_momentum",
            "server_momentum",
            "server_beta1",
            "server_beta2",
            "server_adagrad_beta1",
        ):
            require(0 <= getattr(self, key) < 1, f"train.{key}", "in [0, 1)", getattr(self, key))


SERVER_OPTIMIZERS = ("sgd", "momentum", "adam", "adagrad", "yogi")


class HyperparameterError(ValueError):
    """A hyperparameter value violates its constraint (the config layer re-raises it)."""


def require(ok: bool, key: str, constraint: str, value: object, fix: str = "") -> None:
    """Raise HyperparameterError '<key> must be <constraint>; got <value>.' unless ok."""
    if not ok:
        raise HyperparameterError(f"{key} must be {constraint}; got {value!r}. {fix}".strip())


class LocalSGD(NamedTuple):
    """The local training a client needs this round, declared instead of written (Algorithm.local).

    E epochs x K masked steps of SGD (+ heavy-ball momentum, `OptimConfig`) from `start` on

        F_i(theta) + prox_mu/2 ||theta - start||^2 + <linear, theta>

    where F_i is the task loss (ctx.loss_fn). Every back end honours it: autograd
    (optim.train_local, which loop, vmap, process and distributed run), a compiled per-client
    step (--compile), the traced or captured cohort program (--graph) and the hand-derived
    dense trainer (`fused`). The reported loss is F_i alone (docs/architecture.md §3,
    "Local training").
    """

    start: Params  # theta_0 (and the proximal anchor): the broadcast model
    prox_mu: float = 0.0  # FedProx's mu (Li et al. Eq. 2); static, the same for the whole cohort
    linear: Params | None = (
        None  # a per-client constant added to every gradient (SCAFFOLD's c - c_i), or None
    )
    average_epochs: bool = False  # also the mean iterate of each epoch (IASG samples, FedPA Alg. 4); static


class Local(NamedTuple):
    """Local training declared (`Algorithm.local`): what to train, then what to do with the result.

    The engine runs `finish(ctx, bc, state, hp, opt, train(ctx, request(ctx, bc, state, hp, opt)))`
    with the trainer of its back end; both functions are written for one client (vmap rules,
    docs/architecture.md §3) and `request` trains nothing. `client_update` of such an algorithm
    is `optim.local_update(local)`, the same composition with the autograd trainer.
    """

    request: Callable[..., LocalSGD]  # (ctx, bc, client_state, hp, opt) -> LocalSGD
    finish: Callable[..., ClientOut]  # (ctx, bc, client_state, hp, opt, optim.LocalResult) -> ClientOut


class RunFacts(NamedTuple):
    """The run as an algorithm's `recommend` and `degenerate` hooks see it (docs/architecture.md §3).

    Built by the config layer from the requested config, before any data is loaded.
    """

    task: str  # task name ("byo" for --data FILE)
    kind: str  # classification | regression | multilabel | next_token | lsa
    model: str  # the model that runs (the task's default unless --model)
    rounds: int  # R, communication rounds
    clients_per_round: int  # M, the cohort size
    given: frozenset[str] = frozenset()  # keys the user set ("hp.rho", "train.local_epochs")
    num_clients: int | None = None  # N, where the task fixes it before loading (Task.num_clients); else None


class Advice(NamedTuple):
    """A run setting an algorithm recommends, applied only where the user did not set the key."""

    value: object
    why: str  # the rule and its source (paper table, released config, measured rule), one line


class Degeneracy(NamedTuple):
    """A configuration under which the algorithm computes another algorithm, or a key has no effect, or
    (kind "shortfall") under which it is known to trail FedAvg."""

    code: str  # short id, recorded in the run's tag fedcli.degenerate ("fedpa:no-sampling-round")
    message: str  # one line: what the run computes instead, and the option that fixes it
    inert: tuple[str, ...] = ()  # config keys without effect here ("hp.rho"): a sweep over them repeats runs
    # "degenerate": the run computes another algorithm or a key is inert (tag fedcli.degenerate);
    # "shortfall": it acts as itself but is measured to trail FedAvg here, the message says by how much and
    # why (tag fedcli.shortfall; docs/out-of-the-box.md, "Known shortfalls")
    kind: str = "degenerate"


class Algorithm(NamedTuple):
    """The record every algorithm module exports as `ALGORITHM`."""

    name: str
    paper: str  # "Authors. Title. Venue year. arXiv id"
    config_cls: type  # frozen dataclass of hyperparameters with the paper's defaults
    server_init: Callable[..., Any]  # (params, hp, opt) -> ServerState
    broadcast: Callable[..., Any]  # (state, hp) -> Broadcast pytree
    client_update: Callable[..., ClientOut]  # (ctx, broadcast, client_state, hp, opt) -> ClientOut
    server_update: Callable[..., tuple[Any, Diagnostics]]  # (state, outs[C], weights[C], hp, opt)
    global_params: Callable[[Any], Params]  # state -> the model to evaluate and save
    init_client_state: Callable[..., Any] | None = None  # (params, hp) -> state; None = stateless
    noise_shapes: Callable[..., dict[str, tuple[int, ...]]] | None = None  # (params, hp, num_steps)
    upload_nbytes: Callable[[dict[str, Any]], Tensor] | None = None  # default: dense count
    download_nbytes: Callable[[Any], Tensor | int] | None = None  # default: dense count
    supports_vmap: bool = True
    description: str = ""
    # Bayesian algorithms: state -> (posterior mean, posterior variance), diagonal Gaussian
    # over the flattened parameters as Params trees; used by `fedcli evaluate --predictive`.
    posterior: Callable[[Any], tuple[Params, Params]] | None = None
    # local training declared (request -> the back end's trainer -> finish); None: client_update trains
    # by its own loop, which every generic back end runs (the `fused` trainer needs `local`)
    local: Local | None = None
    # (hp, round_idx) -> what the client code's dependence on ctx.round_idx is a function of (FedPA:
    # whether the round is past burn-in; FOLA: the round itself). Rounds with equal keys must give
    # equal client outputs for equal inputs: programs built from the client update (--compile,
    # --graph) are reused across them. None: the client code does not depend on the round at all
    # (tests/algorithms/test_contract.py checks both for every registered algorithm).
    round_key: Callable[[Any, int], Hashable] | None = None
    # RunFacts -> {"hp.<name>" | "train.<key>": Advice}: the settings this algorithm needs to act on
    # this run (FedPA: local epochs, a burn-in scaled to the run). The config layer applies each to a
    # key the user did not set and records it (tag fedcli.recommended); `fedcli list algos NAME` shows them.
    recommend: Callable[[RunFacts], Mapping[str, Advice]] | None = None
    # (hp, opt, RunFacts) -> [Degeneracy]: configurations that make the algorithm another one or a
    # hyperparameter inert, or (kind "shortfall") where it is measured to trail FedAvg; `train` and `sweep`
    # warn before the run starts, the run records them (tags fedcli.degenerate, fedcli.shortfall).
    degenerate: Callable[[Any, OptimConfig, RunFacts], list[Degeneracy]] | None = None
    # what to expect with the defaults where it differs from FedAvg's (trails it, equals another algorithm),
    # and why; `fedcli list algos NAME` prints it (docs/out-of-the-box.md)
    caveats: str = ""
    # (model, hp, vmap_obstacle) -> None, or one line why this algorithm's own passes cannot run on this model (the layer
    # and the reason) and the setting that can (FOLA's per-example Fisher on BatchNorm: --hp fisher=batch_sq).
    # engine/setup.py `build` raises it as a ConfigError before anything is written (docs/bring-your-own.md,
    # "Every algorithm on your model"); vmap_obstacle: why the model cannot run under torch.func.vmap, as the
    # engine's model check found (None: it can). None: every model the back end runs.
    check_model: Callable[[torch.nn.Module, Any, str | None], str | None] | None = None
    # (upload[G], weights[G], broadcast, hp) -> a pytree of tensors without the client axis whose sum over
    # groups of clients is what server_update reads of the cohort's uploads (BayesADMM: Sum s_k, Sum s_k m_k,
    # the dual increments' sums; SCAFFOLD: Sum q_i (x - y_i), Sum q_i Delta c_i); weights are server_update's
    # (the clients' example counts) for the group's clients. Set, rounds the engine streams (engine/streaming.py stream_group) reduce each group's
    # uploads as it ends and pass server_update an UploadSums instead of the stacked [C, ...] uploads, so
    # they hold O(group) of uploads; server_update must take both (docs/architecture.md, "Back ends").
    upload_sums: Callable[..., Any] | None = None


def hyperparameter_defaults(config_cls: type) -> dict[str, object]:
    """Return {name: default} of a hyperparameter dataclass ('required' if none)."""
    return {f.name: f.default if f.default is not MISSING else "required" for f in fields(config_cls)}


# ---------------------------------------------------------------------------------------
# Pytree math on Params (shared once here, docs/style.md rule 1)
# ---------------------------------------------------------------------------------------


def tree_sub(a: Params, b: Params) -> Params:
    """Return a - b leaf-wise."""
    return {k: a[k] - b[k] for k in a}


def tree_add(a: Params, b: Params) -> Params:
    """Return a + b leaf-wise."""
    return {k: a[k] + b[k] for k in a}


def tree_scale(a: Params, c: float | Tensor) -> Params:
    """Return c * a leaf-wise."""
    return {k: v * c for k, v in a.items()}


def tree_zeros_like(a: Params) -> Params:
    """Return zeros with a's shapes."""
    return {k: torch.zeros_like(v) for k, v in a.items()}


def tree_where(mask: Tensor, new: Any, old: Any) -> Any:
    """Return new where mask (a 0-d float/bool tensor) is set, else old, for any pytree.

    This is how a padded (masked) local step leaves momentum and parameters unchanged.
    """
    if isinstance(new, dict):
        return {k: tree_where(mask, new[k], old[k]) for k in new}
    if isinstance(new, tuple) and hasattr(new, "_fields"):
        return type(new)(*(tree_where(mask, n, o) for n, o in zip(new, old, strict=True)))
    if isinstance(new, (tuple, list)):
        return type(new)(tree_where(mask, n, o) for n, o in zip(new, old, strict=True))
    if isinstance(new, Tensor):
        return torch.where(mask.bool(), new, old)
    return new


def tree_vdot(a: Params, b: Params) -> Tensor:
    """Return sum_k <a_k, b_k>: the inner product of the flattened trees."""
    return sum((a[k] * b[k]).sum() for k in a)  # type: ignore[return-value]


def tree_norm(a: Params) -> Tensor:
    """Return the L2 norm of the flattened tree."""
    return torch.sqrt(tree_vdot(a, a))


def flatten(a: Params) -> Tensor:
    """Concatenate the leaves of a (in key order) into one vector [D]."""
    return torch.cat([v.reshape(-1) for v in a.values()])


def unflatten(vector: Tensor, like: Params) -> Params:
    """Split a vector [D] back into a tree shaped like `like`."""
    parts = vector.split([v.numel() for v in like.values()])
    return {k: part.reshape(v.shape) for (k, v), part in zip(like.items(), parts, strict=True)}


def weighted_mean(cohort_tree: Params, weights: Tensor) -> Params:
    """Return sum_i w_i x_i / sum_i w_i over the leading client axis.

    Args:
        cohort_tree: leaves shaped [C, ...].
        weights: [C] non-negative client weights (q_i = n_i in FedAvg/FedPA).
    """
    total = weights.sum()
    return {
        k: torch.tensordot(weights.to(v.dtype), v, dims=([0], [0])) / total.to(v.dtype)
        for k, v in cohort_tree.items()
    }


def finite_client_mask(cohort_tree: Params) -> Tensor:
    """Return [C] bool: True for clients whose every leaf is finite."""
    masks = [torch.isfinite(v.reshape(v.shape[0], -1)).all(dim=1) for v in cohort_tree.values()]
    return torch.stack(masks).all(dim=0)


def tree_nbytes(tree: Any) -> int:
    """Return the bytes of every tensor in a pytree (dense float encoding)."""
    if isinstance(tree, Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, Mapping):
        return sum(tree_nbytes(v) for v in tree.values())
    if isinstance(tree, (tuple, list)):
        return sum(tree_nbytes(v) for v in tree)
    return 0
