"""The round loop of one run (docs/architecture.md §2).

    cohort  = sample(clients, rng(seed, COHORT, r))
    plan    = FederatedData.plan(cohort, E, B, rng(seed, BATCH_ORDER, r, client))
    outs    = executor(client_update, broadcast(state), plan, client states)
    state   = server_update(state, outs, weights = n_i)
    metrics = evaluate(global params) every eval_every rounds and at the last round
    tracker.log_round(r, metrics); checkpoint every k rounds (atomic)
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from fedcli.algorithms import ALGORITHMS
from fedcli.algorithms.base import Algorithm, HyperparameterError, OptimConfig, tree_nbytes
from fedcli.config import RunConfig, make_hyperparameters, run_tags
from fedcli.datasets.federated import FederatedData
from fedcli.datasets.registry import resolve_task
from fedcli.datasets.tasks import Task, TaskData, TaskOptions
from fedcli.engine import checkpoint as ckpt
from fedcli.engine.checkpoint import CheckpointWriter
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.evaluation import evaluate
from fedcli.engine.executors import EXECUTORS, CohortInputs, ModelFunctions, model_functions
from fedcli.engine.lifecycle import GracefulSignals, Heartbeat, RunInterrupted, graceful_signals, signal_name
from fedcli.engine.seeding import Stream, derive_seed, numpy_rngs, sample_cohort, step_keys, torch_generator
from fedcli.errors import ConfigError, FedcliError
from fedcli.tracking.store import RunTakenOver, StoreUnavailable

log = logging.getLogger(__name__)


class DivergenceError(FedcliError):
    """A metric became NaN or inf; the run was marked failed at that round."""


@dataclass
class Timing:
    """Seconds spent per phase, summed over the rounds of this process."""

    train: float = 0.0
    aggregate: float = 0.0
    evaluate: float = 0.0
    tracking: float = 0.0
    rounds: int = 0

    def per_round(self) -> dict[str, float]:
        n = max(self.rounds, 1)
        return {"train": self.train / n, "aggregate": self.aggregate / n,
                "evaluate": self.evaluate / n, "tracking": self.tracking / n}


@dataclass
class RunResult:
    run_id: str
    status: str
    rounds_completed: int
    final_metrics: dict[str, float]
    model_path: Path | None
    executor: str
    timing: Timing = field(default_factory=Timing)
    wall_s: float = 0.0


@dataclass
class Setup:
    """Everything built once before the first round."""

    cfg: RunConfig
    task: Task
    data: TaskData
    fed: FederatedData
    fns: ModelFunctions
    alg: Algorithm
    hp: Any
    device: torch.device
    executor: str
    init_params: dict[str, torch.Tensor]
    partition: list[np.ndarray] | None = None  # client -> example indices actually used
    partition_spec: Any = None  # the PartitionSpec that produced it
    runner: Any = None  # issue 7: a stateful executor (process pool, compiled vmap) used instead of EXECUTORS
    executor_reason: str = ""  # why `executor` was chosen (logged, tagged)
    opt: OptimConfig = field(default_factory=OptimConfig)  # cfg.train's optimiser, client_lr None -> the task's
    prefetched: dict[int, RoundPlan] = field(default_factory=dict)  # the next round's plan, built during this one


def resolve_device(name: str) -> torch.device:
    """Map auto|cpu|cuda|cuda:N|mps to a torch.device; ConfigError if unavailable."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device is {name!r} but CUDA is not available here; use --device cpu.")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("train.device is 'mps' but MPS is not available here; use --device cpu.")
    return torch.device(name)


def client_partition(cfg: RunConfig, data: TaskData) -> tuple[list[np.ndarray], Any]:
    """Return (client -> example indices, PartitionSpec) from a partition file or the scheme.

    A partition file must have been made for this data (its fingerprint is checked). A scheme
    is drawn from the run's seed; `natural` with --clients N keeps the first N natural clients.
    """
    from fedcli.datasets.partition import PartitionSpec, load_partition, make_partition

    part, task = cfg.partition, cfg.data.task
    if part.file is not None:
        return load_partition(Path(part.file), dataset=task, fingerprint=data.fingerprint)
    spec = PartitionSpec(scheme=part.scheme, num_clients=part.num_clients, alpha=part.alpha,
                         shards_per_client=part.shards_per_client, labels_per_client=part.labels_per_client,
                         min_size=part.min_size, seed=derive_seed(cfg.seed, Stream.PARTITION) % (2**31),
                         balanced=part.balanced, sigma=part.sigma, size_alpha=part.size_alpha)
    if part.scheme == "natural":
        if not data.client_indices:
            raise ConfigError(f"task {task} has no natural clients; choose --scheme iid|dirichlet|... .")
        if part.num_clients is not None and part.num_clients > len(data.client_indices):
            raise ConfigError(f"partition.num_clients={part.num_clients} exceeds the {len(data.client_indices)} "
                              f"natural clients of task {task}; lower --clients.")
        return data.client_indices[: part.num_clients or len(data.client_indices)], spec
    return make_partition(spec, labels=data.y.numpy(), natural=data.client_indices or None), spec


def build(cfg: RunConfig, *, peers: Any = None) -> Setup:
    """Load data, build the model, the algorithm and the executor; data-dependent checks.

    `peers` is this process's `distributed.Peers` under `--executor distributed` (torchrun).
    """
    device = resolve_device(cfg.train.device)
    from fedcli.engine.workers import available_cores

    threads = cfg.train.threads or available_cores()  # issue: two threads on a loaded 2-core box
    if cfg.train.executor == "distributed":  # this rank's GPU (LOCAL_RANK) and share of its host's cores
        from fedcli.engine.distributed import placement

        device, threads = placement(cfg, device, peers)
    torch.set_num_threads(threads)
    task = resolve_task(cfg.data.task, cfg.data.model, cfg.data.file)
    data = task.load(TaskOptions(seed=cfg.seed, data_dir=Path(cfg.data.data_dir) if cfg.data.data_dir else None,
                                 download=cfg.data.download, max_clients=cfg.data.max_clients))
    indices, spec = client_partition(cfg, data)
    if cfg.train.clients_per_round > len(indices):
        raise ConfigError(f"train.clients_per_round={cfg.train.clients_per_round} exceeds the "
                          f"{len(indices)} clients of the partition; lower --clients-per-round.")
    check_plan_size(cfg, max((len(ix) for ix in indices), default=0))
    with torch.random.fork_rng(devices=[]):  # model init from its own stream, global RNG untouched
        torch.manual_seed(derive_seed(cfg.seed, Stream.INIT))
        model_name = cfg.data.model or task.default_model
        if model_name not in task.models:
            raise ConfigError(f"data.model must be one of {', '.join(task.models)} for task {task.name}; "
                              f"got {model_name!r}.")
        model = task.models[model_name]()
    model = model.to(device)
    init_params = {k: v.detach().clone() for k, v in model.named_parameters()}
    fed = FederatedData(data.x, data.y, indices, device)
    alg = ALGORITHMS[cfg.algorithm.name]
    hp = make_hyperparameters(alg.name, cfg.algorithm.hp)
    from fedcli.engine.workers import speed_setup  # issue 7: precision, executor choice (auto), its runner

    fns, executor, why, runner = speed_setup(cfg, alg, device, fed, model_functions(task, model, fed), model,
                                             peers)
    log.debug("executor: %s (%s)", executor, why)
    return Setup(cfg, task, data, fed, fns, alg, hp, device, executor, init_params, indices, spec, runner, why,
                 cfg.train.optim(task.client_lr))


PLAN_LIMIT = 2**28  # example slots of one round's padded plan: 3 GiB of indices and weights (docs/architecture.md §8)


def check_plan_size(cfg: RunConfig, largest: int) -> None:
    """Refuse settings whose round plan (`FederatedData.plan`: [M, E * K, B] example slots, K =
    ceil(n / B) for the largest client's n examples) would exceed PLAN_LIMIT, before any is built."""
    t = cfg.train
    slots = t.clients_per_round * t.local_epochs * -(-max(largest, 1) // t.batch_size) * t.batch_size
    if slots > PLAN_LIMIT:
        raise ConfigError(
            f"train.batch_size={t.batch_size}, train.local_epochs={t.local_epochs} and train.clients_per_round="
            f"{t.clients_per_round} make each round's plan {slots:,} example slots (clients x epochs x ceil(n / B) x B, "
            f"the largest client n = {largest}), more than the limit of {PLAN_LIMIT:,}. Lower --batch-size (a batch "
            f"of {largest}, the largest client, is already full-batch training), --local-epochs or "
            "--clients-per-round.")


def draw_noise(setup: Setup, params: dict[str, torch.Tensor], cohort: np.ndarray, round_idx: int,
               num_steps: int) -> dict[str, torch.Tensor]:
    """Pre-draw each client's N(0, 1) noise from its own stream (shapes lead with S steps)."""
    if setup.alg.noise_shapes is None:
        return {}
    shapes = setup.alg.noise_shapes(params, setup.hp, num_steps)
    out: dict[str, torch.Tensor] = {}
    for slot, (name, shape) in enumerate(sorted(shapes.items()), start=1):
        draws = [torch.randn(shape, generator=torch_generator(setup.cfg.seed, Stream.NOISE, round_idx, int(c), slot))
                 for c in cohort]
        out[name] = torch.stack(draws).to(setup.device)
    return out


@dataclass
class Trained:
    """A round after local training, before aggregation (see `train_cohort`)."""

    cohort: np.ndarray
    plan: Any
    broadcast: Any
    outs: Any
    start: float
    clients: list[tuple[int, str, float]] = field(default_factory=list)  # set by `aggregate`: per-client rows


@dataclass(frozen=True)
class RoundPlan:
    """What a round's local training needs that depends only on the seed and the round (not on
    the model state): the cohort, its CohortPlan and its step keys."""

    cohort: np.ndarray
    plan: Any  # CohortPlan
    keys: torch.Tensor  # [C, S] int64


def plan_round(setup: Setup, round_idx: int, on_host: bool = False) -> RoundPlan:
    """Sample the round's cohort and build its plan and step keys (on the run's device, or in
    pinned host memory with on_host, for a plan built ahead while the GPU trains)."""
    cfg = setup.cfg
    cohort = sample_cohort(setup.fed.num_clients, cfg.train.clients_per_round, seed=cfg.seed, round_idx=round_idx)
    # largest local data first (ties by id): the clients still training at local step k are then a
    # prefix of the cohort, which the fused executor uses without permuting (results do not depend on it)
    cohort = cohort[np.argsort(-setup.fed.sizes[cohort], kind="stable")]
    rngs = numpy_rngs(cfg.seed, Stream.BATCH_ORDER, round_idx, cohort)
    plan = setup.fed.plan(cohort, num_epochs=setup.opt.local_epochs, batch_size=cfg.train.batch_size, rngs=rngs,
                          on_host=on_host)
    keys = step_keys(cfg.seed, round_idx, cohort, plan.num_epochs * plan.steps_per_epoch)
    if on_host and setup.device.type == "cuda":
        keys = keys.pin_memory()
    return RoundPlan(cohort, plan, keys if on_host else keys.to(setup.device))


def overlaps_host_work(device: torch.device) -> bool:
    """True where an executor returns while the device still trains (CUDA launches are
    asynchronous): train_cohort then builds the next round's plan before it waits."""
    return device.type == "cuda"


def train_cohort(setup: Setup, state: Any, store: ClientStateStore, round_idx: int,
                 interrupt: Callable[[], None] | None = None) -> Trained:
    """Sample the round's cohort and run its local training (no state changes: interruptible).

    `interrupt` (GracefulSignals.check) is called between the clients (`loop`) or cohort chunks
    (`--cohort-chunk`) of the round and raises there when the run was asked to stop.
    On a GPU the next round's cohort, plan and step keys (numpy shuffles, seed derivation: a few
    ms of host time at 100 clients) are built while the device trains this round, before the
    synchronisation that ends it, and copied to the device without blocking when their round comes.
    """
    cfg, alg, hp, opt = setup.cfg, setup.alg, setup.hp, setup.opt
    fns = setup.fns if interrupt is None else replace(setup.fns, interrupt=interrupt)
    start = time.perf_counter()
    planned = setup.prefetched.pop(round_idx, None) or plan_round(setup, round_idx)
    cohort, plan = planned.cohort, planned.plan.to(setup.device)
    num_steps = plan.num_epochs * plan.steps_per_epoch
    bc = alg.broadcast(state, hp)
    inputs = CohortInputs(plan=plan, keys=planned.keys.to(setup.device, non_blocking=True),
                          noise=draw_noise(setup, alg.global_params(state), cohort, round_idx, num_steps),
                          states=store.gather(cohort, setup.device))
    execute = setup.runner or EXECUTORS[setup.executor]
    outs = execute(alg, fns, bc, inputs, hp, opt, round_idx, cfg.train.cohort_chunk)
    setup.prefetched.clear()
    if overlaps_host_work(setup.device) and round_idx < cfg.train.rounds:
        setup.prefetched[round_idx + 1] = plan_round(setup, round_idx + 1, on_host=True)
    _sync(setup.device)
    return Trained(cohort, plan, bc, outs, start)


def aggregate(setup: Setup, state: Any, store: ClientStateStore, trained: Trained, round_idx: int,
              timing: Timing) -> tuple[Any, dict[str, float]]:
    """Drop clients whose upload is not finite, aggregate, store client states. Returns (state, metrics).

    A client whose upload holds NaN/inf is left out of this round as if it had not been
    sampled (its state is not updated) and counted in `client/dropped_nonfinite`; if every
    client of the cohort is non-finite the run has diverged.
    """
    alg, hp, opt = setup.alg, setup.hp, setup.opt
    cohort, plan, outs = trained.cohort, trained.plan, trained.outs
    trained_at = time.perf_counter()
    weights = plan.num_examples
    finite = _finite_rows(outs.upload, len(cohort))
    dropped = int((~finite).sum())
    if dropped == len(cohort):
        raise DivergenceError(f"run diverged at round {round_idx}: every client's upload is NaN/inf; "
                              "lower --client-lr. The run is marked failed.")
    if dropped:
        keep = torch.nonzero(torch.as_tensor(finite)).flatten()
        outs = _take_rows(outs, keep)
        weights, cohort = weights[keep.to(weights.device)], cohort[finite]
    state, diagnostics = alg.server_update(state, outs, weights, hp, opt)
    store.scatter(cohort, outs.state)
    _sync(setup.device)
    timing.train += trained_at - trained.start
    timing.aggregate += time.perf_counter() - trained_at
    share = weights / weights.sum()
    up = alg.upload_nbytes(trained.outs.upload) if alg.upload_nbytes else tree_nbytes(trained.outs.upload)
    down = alg.download_nbytes(trained.broadcast) if alg.download_nbytes else tree_nbytes(trained.broadcast)
    # every number the round logs crosses to the host in one copy (one sync on a GPU)
    means = {f"client/{k}": (v.to(share.dtype) * share).sum() for k, v in outs.metrics.items()}
    columns = {("train/loss" if k == "train_loss" else f"client/{k}"): v for k, v in outs.metrics.items()}
    columns["client/num_examples"] = weights
    host = to_host({**means, **diagnostics, "comm/bytes_up": up}, columns)
    metrics = {k: host[k][0] for k in means}
    metrics["train/loss"] = metrics.pop("client/train_loss", float("nan"))
    metrics.update({k: host[k][0] for k in diagnostics})
    metrics["comm/bytes_up"] = host["comm/bytes_up"][0]
    metrics["comm/bytes_down"] = float(down) * len(trained.cohort)
    metrics["client/dropped_nonfinite"] = float(dropped)
    trained.clients = client_rows(cohort, {key: host[("column", key)] for key in columns})
    return state, metrics


def to_host(scalars: dict[str, Any], columns: dict[str, torch.Tensor]) -> dict[Any, list[float]]:
    """Python floats of scalar tensors (or numbers) and of per-client columns, copied to the host
    in one transfer: {name: [value]} and {("column", name): [value per client]}."""
    names: list[Any] = [*scalars, *(("column", k) for k in columns)]
    parts = [*scalars.values(), *columns.values()]
    flat = [p.detach().reshape(-1).to(torch.float64) if isinstance(p, torch.Tensor)
            else torch.tensor([float(p)], dtype=torch.float64) for p in parts]
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(flat):
        by_device.setdefault(t.device, []).append(i)
    out: dict[Any, list[float]] = {}
    for rows in by_device.values():  # one copy per device the values live on
        values = torch.cat([flat[i] for i in rows]).cpu().tolist()
        start = 0
        for i in rows:
            out[names[i]] = values[start:start + flat[i].numel()]
            start += flat[i].numel()
    return out


def client_rows(cohort: np.ndarray, columns: dict[str, list[float]]) -> list[tuple[int, str, float]]:
    """Per-client rows `(client, key, value)` of the clients aggregated this round: each local
    metric under the round key it is averaged into (`train_loss` -> `train/loss`, else `client/*`)
    and `client/num_examples`, the client's weight (`columns`: key -> one value per client)."""
    return [(int(c), key, float(values[i])) for key, values in columns.items() for i, c in enumerate(cohort)]


def run_round(setup: Setup, state: Any, store: ClientStateStore, round_idx: int, timing: Timing
              ) -> tuple[Any, dict[str, float]]:
    """One communication round: sample, train clients, aggregate. Returns (state, metrics)."""
    trained = train_cohort(setup, state, store, round_idx)
    return aggregate(setup, state, store, trained, round_idx, timing)


def _finite_rows(upload: Any, num_clients: int) -> np.ndarray:
    """[C] bool: True for clients whose every uploaded tensor is finite.

    A row's sum is finite exactly when all its entries are, unless finite entries overflow
    float32 when summed; rows whose sum is not finite are checked entry by entry, so the answer
    is exact. One pass of reductions instead of a [C, N] boolean per leaf: on the FEMNIST MLP
    (10 clients x 210k parameters, 2 CPU cores) 0.3 ms against 4.9 ms, a third of a fused
    round. One host sync for the whole upload.
    """
    leaves = [leaf.reshape(num_clients, -1) for leaf in pytree.tree_leaves(upload)
              if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == num_clients
              and leaf.is_floating_point()]
    if not leaves:
        return np.ones(num_clients, dtype=bool)
    sums = torch.stack([leaf.sum(dim=1, dtype=torch.float32) for leaf in leaves])  # [L, C]
    finite = torch.isfinite(sums).cpu()
    for i, j in zip(*torch.nonzero(~finite, as_tuple=True), strict=True):  # NaN/inf, or an overflowing sum
        finite[i, j] = bool(torch.isfinite(leaves[int(i)][int(j)]).all())
    return finite.all(dim=0).numpy()


def _take_rows(tree: Any, rows: torch.Tensor) -> Any:
    """The pytree with only `rows` of every tensor's leading (client) axis."""
    return pytree.tree_map(lambda t: t.index_select(0, rows.to(t.device)) if isinstance(t, torch.Tensor)
                           and t.dim() > 0 else t, tree)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


ProgressFn = Callable[[int, dict[str, float]], None]


def train(cfg: RunConfig, *, tracker: Any, progress: ProgressFn | None = None,
          resume_run_id: str | None = None, setup: Setup | None = None,
          signals: GracefulSignals | None = None) -> RunResult:
    """Run (or resume) one training run to completion, logging every round to `tracker`.

    `setup` is `build(cfg)` when the caller built it already (the CLI does, to validate the
    data and the options before it opens any store); `signals`, stop-signal handlers the
    caller installed already (the CLI does, before its set-up), else this installs its own.
    The run's life (docs/architecture.md, "Run lifecycle"): a heartbeat while it trains;
    SIGINT/SIGTERM/SIGHUP stop it at the next safe point (between rounds, clients or cohort
    chunks), abandon the round in flight, checkpoint the last completed round and mark it
    `interrupted`; a signal after the last round lets it finish; checkpoints in the
    background with retention; any other failure marks it `failed`.

    Raises:
        ConfigError: invalid settings discovered against the data (before any round).
        DivergenceError: a metric became non-finite; the run is marked failed first.
        RunInterrupted: a signal stopped it (a KeyboardInterrupt); marked interrupted first.
    """
    wall_start = time.perf_counter()
    setup = setup or build(cfg)
    log.info("executor: %s (%s)", setup.executor, setup.executor_reason)
    try:
        state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    except HyperparameterError as exc:
        raise ConfigError(str(exc)) from None
    init_fn = None
    if setup.alg.init_client_state is not None:
        init_fn = lambda: setup.alg.init_client_state(setup.init_params, setup.hp)  # noqa: E731
    store = ClientStateStore(init_fn)
    with graceful_signals(signals) as signals:
        if resume_run_id is None:
            run_id = start_tracking(tracker, cfg, setup)
            start_round = 1
        else:
            run_id = resume_run_id
            state, start_round = _restore(tracker, run_id, setup, state, store)
        run_dir = Path(cfg.tracking.root) / "runs" / run_id
        if start_round == 1:
            _save_partition(tracker, run_dir, setup)
        heartbeat = Heartbeat(tracker.store, run_id)
        writer = CheckpointWriter(run_dir, record=tracker.checkpoint,
                                  forget=lambda rounds: tracker.store.delete_checkpoints(run_id, rounds),
                                  existing=tracker.store.checkpoints(run_id),
                                  every=cfg.train.checkpoint_every, keep=cfg.train.keep_checkpoints)
        loop = _Loop(setup, tracker, store, writer, state, start_round - 1, Timing(),
                     _cumulative(tracker.store, run_id, start_round - 1))
        try:
            metrics = loop.run(signals, progress)
            model_path = _save_model(tracker, run_dir, setup, loop.state)
        except RunTakenOver:  # another process resumed the run: write nothing more, not even its end
            raise
        except StoreUnavailable as exc:  # locked or unreachable for FEDCLI_STORE_RETRY_S: stop, resumable
            _stop_without_store(tracker, exc)
            raise StoreUnavailable(f"{exc}. Run {run_id[:8]} stopped after round {loop.completed} and is "
                                   f"resumable: `fedcli train --resume {run_id[:8]}` once the store answers") from exc
        except KeyboardInterrupt as exc:
            loop.save_on_exit()
            reason = f"stopped by {exc.args[0] if exc.args else 'SIGINT'} during round {loop.completed + 1}"
            tracker.finish("interrupted", reason=reason)
            raise
        except DivergenceError as exc:
            if tracker.store.get_run(run_id).stored_status == "running":  # not yet marked (aggregate's check)
                tracker.finish("failed", reason=str(exc)[:500], diverged_at_round=loop.completed + 1)
            raise
        except BaseException as exc:
            if signals.pending is None:
                tracker.finish("failed", reason=f"{type(exc).__name__}: {exc}"[:500])
                raise
            # a stop was asked and something failed on its way (a worker ended by the same signal)
            log.debug("stopping after %s: %s", type(exc).__name__, exc)
            loop.save_on_exit()
            stop = RunInterrupted(signals.pending)
            tracker.finish("interrupted", reason=f"stopped by {stop.args[0]} during round {loop.completed + 1}")
            raise stop from None
        finally:
            heartbeat.stop()
            with contextlib.suppress(Exception):
                writer.close()
            from fedcli.engine.workers import close_runner  # issue 7: no worker outlives its run

            close_runner(setup.runner)
        tracker.finish("finished")  # a signal from here on (the MLflow wait) is recorded, not raised
        if signals.pending is not None:
            log.warning("%s arrived after the last round; the run finished", signal_name(signals.pending))
    return RunResult(run_id=run_id, status="finished", rounds_completed=loop.completed, final_metrics=metrics,
                     model_path=model_path, executor=executor_label(setup), timing=loop.timing,
                     wall_s=time.perf_counter() - wall_start)


def _stop_without_store(tracker: Any, exc: StoreUnavailable) -> None:
    """Mark the run `interrupted` if the store answers within a few seconds (it just failed for a
    minute); otherwise leave it: its row reads `interrupted` once this process is gone."""
    tracker.store.retry_s = min(tracker.store.retry_s, 5.0)
    with contextlib.suppress(FedcliError):
        tracker.finish("interrupted", reason=f"store unreachable: {exc}"[:500])


CUMULATIVE = {"comm/bytes_up": "comm/cum_bytes_up", "comm/bytes_down": "comm/cum_bytes_down",
              "time/round_s": "time/cum_train_s"}


def _cumulative(store: Any, run_id: str, completed: int) -> dict[str, float]:
    """The cumulative totals a resumed run continues from (its round `completed`)."""
    if completed <= 0:
        return {}
    frame = store.metrics_frame([run_id], keys=list(CUMULATIVE.values()))
    frame = frame[frame["round_idx"] == completed]
    return {str(k): float(v) for k, v in zip(frame["key"], frame["value"], strict=True)}


@dataclass
class _Loop:
    """The round loop of one run and what an orderly stop needs: the last completed state."""

    setup: Setup
    tracker: Any
    store: ClientStateStore
    writer: CheckpointWriter
    state: Any
    completed: int  # last round whose state, client states and metrics are all in place
    timing: Timing
    cumulative: dict[str, float]  # comm/cum_bytes_* totals up to `completed`

    def run(self, signals: GracefulSignals, progress: ProgressFn | None) -> dict[str, float]:
        """Train the remaining rounds; a stop signal raises RunInterrupted at the next `signals.check()`
        (safe points: before round 0, between rounds, clients or chunks, after local training)."""
        cfg, setup = self.setup.cfg, self.setup
        metrics: dict[str, float] = {}
        signals.check()  # a signal while the run started (store, MLflow's set-up, checkpoint read)
        if self.completed == 0:
            with signals.critical():
                metrics = _evaluate(setup, self.state)
                _log(self.tracker, 0, metrics, self.timing, progress)
        for round_idx in range(self.completed + 1, cfg.train.rounds + 1):
            signals.check()
            trained = train_cohort(setup, self.state, self.store, round_idx, interrupt=signals.check)
            signals.check()  # the round's local training is abandoned: it changed no kept state
            with signals.critical():  # aggregation, evaluation and logging finish together
                state, metrics = aggregate(setup, self.state, self.store, trained, round_idx, self.timing)
                if round_idx % cfg.train.eval_every == 0 or round_idx == cfg.train.rounds:
                    eval_start = time.perf_counter()
                    metrics.update(_evaluate(setup, state))
                    self.timing.evaluate += time.perf_counter() - eval_start
                round_s = time.perf_counter() - trained.start
                metrics["time/round_s"] = round_s
                for key in CUMULATIVE:  # comm/bytes_up -> comm/cum_bytes_up: x-axes of accuracy vs bytes
                    metrics[CUMULATIVE[key]] = self.cumulative.get(CUMULATIVE[key], 0.0) + metrics[key]
                self.timing.rounds += 1
                _check_finite(self.tracker, round_idx, metrics)
                _log(self.tracker, round_idx, metrics, self.timing, progress, trained.clients)
                self.state, self.completed = state, round_idx
                self.cumulative = {v: metrics[v] for v in CUMULATIVE.values()}
                if self.writer.due(round_idx, round_s) or round_idx == cfg.train.rounds:
                    self._checkpoint()
        self.writer.wait()
        return metrics

    def _checkpoint(self) -> None:
        cfg = self.setup.cfg
        self.writer.submit(self.completed, self.state, self.store.state_dict(), cfg.to_dict(), cfg.seed)

    def save_on_exit(self) -> None:
        """Checkpoint the last completed round if it is not yet (an orderly stop loses no finished round)."""
        try:
            self.writer.wait()
            if self.completed > 0 and self.writer.last_round != self.completed:
                self._checkpoint()
                self.writer.wait()
        except Exception as err:  # the stop goes on; the run resumes from an older checkpoint
            log.warning("could not checkpoint round %d on the way out: %s", self.completed, err)


def executor_label(setup: Setup) -> str:
    """The executor as the summary line names it: `vmap`, `vmap + graph`, `process + compile`."""
    train = setup.cfg.train
    return " + ".join([setup.executor, *(name for name, on in (("compile", train.compile), ("graph", train.graph))
                                         if on)])


def start_tracking(tracker: Any, cfg: RunConfig, setup: Setup) -> str:
    """Start the run in the store and MLflow with the resolved config, tags and versions."""
    import fedcli

    return tracker.start(
        experiment=cfg.tracking.experiment, run_name=cfg.tracking.run_name, config=resolved_config(setup),
        requested=cfg.to_dict(), config_hash=cfg.config_hash,
        algo=cfg.algorithm.name, task=setup.task.name, seed=cfg.seed, dataset=cfg.data.task,
        partitioner=cfg.partition.scheme, fedcli_version=fedcli.__version__, torch_version=torch.__version__,
        git_commit=git_commit(), tags={"fedcli.executor": setup.executor, "fedcli.device": str(setup.device),
                                       "fedcli.executor_reason": setup.executor_reason[:250],
                                       "fedcli.model": cfg.data.model or setup.task.default_model,
                                       "fedcli.config_hash": cfg.config_hash, **run_tags(cfg)})


def resolved_config(setup: Setup) -> dict[str, Any]:
    """The run's config as it runs: every `auto`/None that the set-up decided, filled in.

    Stored as the run's config and logged as its MLflow params, so that two runs that differ
    only in what `auto` chose can be told apart; the request itself (what `--resume` and the
    config hash use) is stored beside it.
    """
    cfg = setup.cfg
    out = cfg.to_dict()
    out["data"]["model"] = cfg.data.model or setup.task.default_model
    out["train"]["device"] = str(setup.device)
    out["train"]["executor"] = setup.executor
    out["train"]["threads"] = torch.get_num_threads()
    out["train"]["client_lr"] = setup.opt.client_lr
    if setup.partition is not None:
        out["partition"]["num_clients"] = len(setup.partition)
    spec = setup.partition_spec
    if cfg.partition.file is not None and spec is not None:  # the file fixes the scheme and its options
        for key in ("scheme", "alpha", "shards_per_client", "labels_per_client", "min_size", "balanced", "sigma",
                    "size_alpha"):
            if hasattr(spec, key):
                out["partition"][key] = getattr(spec, key)
    if setup.runner is not None and hasattr(setup.runner, "slots"):  # the process executor's processes
        out["train"]["workers"] = setup.runner.slots
    return out


def git_commit() -> str | None:
    """Return the HEAD commit of the git checkout fedcli runs from, or None."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _evaluate(setup: Setup, state: Any) -> dict[str, float]:
    params = setup.alg.global_params(state)
    return evaluate(setup.task, setup.fns, params, setup.data.test_x, setup.data.test_y, setup.data.optimum)


def _log(tracker: Any, round_idx: int, metrics: dict[str, float], timing: Timing,
         progress: ProgressFn | None, clients: list[tuple[int, str, float]] | None = None) -> None:
    start = time.perf_counter()
    tracker.log_round(round_idx, metrics, clients or ())
    timing.tracking += time.perf_counter() - start
    log.info("round %d  %s", round_idx, "  ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())
                                                  if k.startswith(("eval/", "train/"))))
    if progress is not None:
        progress(round_idx, metrics)


def _check_finite(tracker: Any, round_idx: int, metrics: dict[str, float]) -> None:
    bad = sorted(k for k, v in metrics.items() if not np.isfinite(v))
    if bad:
        tracker.finish("failed", reason=f"non-finite {', '.join(bad)} at round {round_idx}",
                       diverged_at_round=round_idx)
        raise DivergenceError(f"run diverged at round {round_idx}: {', '.join(bad)} not finite; "
                              "lower --client-lr / --server-lr. The run is marked failed.")


def _save_partition(tracker: Any, run_dir: Path, setup: Setup) -> None:
    """Keep the run's client partition beside it (and in MLflow) so reports and reruns can share it."""
    from fedcli.datasets.partition import save_partition

    if setup.partition is None or setup.partition_spec is None:
        return
    path = run_dir / "partition.json"
    labels = setup.data.y.numpy() if setup.task.kind in ("classification", "multilabel") else np.zeros(len(setup.data.y))
    save_partition(path, setup.partition, spec=setup.partition_spec, dataset=setup.task.name,
                   fingerprint=setup.data.fingerprint, labels=labels)
    tracker.log_artifact(path)


def _save_model(tracker: Any, run_dir: Path, setup: Setup, state: Any) -> Path:
    path = run_dir / "model.pt"
    params = ckpt.to_cpu(setup.alg.global_params(state))
    ckpt.atomic_save({"format_version": ckpt.FORMAT_VERSION, "run_id": tracker.run_id,
                      "config_hash": setup.cfg.config_hash, "params": params,
                      "server_state": ckpt.to_plain(ckpt.to_cpu(state)), "config": setup.cfg.to_dict(),
                      "task": setup.task.name, "algorithm": setup.alg.name,
                      "model": setup.cfg.data.model or setup.task.default_model,
                      "example": setup.data.x[:2].detach().cpu()}, path)  # MLflow model signature (tracking/served.py)
    tracker.store.set_run_fields(tracker.run_id, model_path=str(path.resolve()))
    tracker.log_artifact(path)
    return path


def _restore(tracker: Any, run_id: str, setup: Setup, state: Any, store: ClientStateStore) -> tuple[Any, int]:
    """Reopen run_id at its newest readable checkpoint (or at round 0 if it has none).

    Rows of later rounds are dropped (they are trained again, to the same values) and the
    stored config becomes the one this resume runs (e.g. more rounds). Returns (state, next round).
    """
    cfg, record = setup.cfg, tracker.store.get_run(run_id)
    client_template = None if setup.alg.init_client_state is None else setup.alg.init_client_state(setup.init_params,
                                                                                                  setup.hp)
    for round_idx, path in reversed(tracker.store.checkpoints(run_id)):
        try:  # read without running code, checked against the run's row and state (docs/architecture.md, "Checkpoints")
            server_state, client_states = ckpt.load_checkpoint(
                Path(path), f"checkpoint of round {round_idx} ({path})", server_template=state,
                client_template=client_template, run_id=run_id, config_hash=record.config_hash,
                requested=record.requested, round_idx=round_idx)
        except ckpt.CheckpointError as err:
            log.warning("%s; trying an older one", err)
            continue
        store.load_state_dict(client_states)
        tracker.resume(run_id, from_round=round_idx, config=resolved_config(setup), config_hash=cfg.config_hash,
                       requested=cfg.to_dict())
        return ckpt.to_device(server_state, setup.device), round_idx + 1
    log.warning("run %s has no checkpoint; it restarts from round 0 under the same id", run_id)
    tracker.resume(run_id, from_round=-1, config=resolved_config(setup), config_hash=cfg.config_hash,
                   requested=cfg.to_dict())
    return state, 1
