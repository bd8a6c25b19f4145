"""A run's set-up: everything built once before the first round (docs/architecture.md §2).

    device    = resolve_device(train.device)            (distributed: this rank's GPU, its share of cores)
    task      = resolve_task(data.task | --data FILE);   data = task.load(...)
    clients   = client_partition(cfg, data)              a partition file (fingerprint checked) or the scheme
    model     = task.models[name]() under fork_rng, seeded from Stream.INIT
    alg, hp   = ALGORITHMS[name], make_hyperparameters(name, algorithm.hp)
    fns       = model functions (functional_call) at train.precision
    backend   = select.choose(workload, train.executor) -> select.build(...)   (engine/select.py)

`build` does every data-dependent check before anything is written (docs/architecture.md §8).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedcli.algorithms import ALGORITHMS
from fedcli.algorithms.base import Algorithm, OptimConfig
from fedcli.config.checks import make_hyperparameters
from fedcli.config.sections import RunConfig
from fedcli.datasets import augment as augmentation
from fedcli.datasets.federated import FederatedData, choose_store, federated_data
from fedcli.datasets.registry import resolve_task
from fedcli.datasets.tasks import Task, TaskData, TaskOptions
from fedcli.datasets.yours.model import is_reference, vmap_obstacle
from fedcli.engine import select
from fedcli.engine.backends import BackendSetup, CohortBackend, Workload
from fedcli.engine.cohort import RoundPlan
from fedcli.engine.distributed import placement
from fedcli.engine.footprint import client_step_bytes
from fedcli.engine.machine import available_cores
from fedcli.engine.model import ModelFunctions, build_user_model, model_functions, with_precision
from fedcli.engine.seeding import Stream, derive_seed
from fedcli.errors import ConfigError

if TYPE_CHECKING:
    from fedcli.datasets.partition.spec import PartitionSpec
    from fedcli.engine.distributed import Peers

log = logging.getLogger(__name__)


@dataclass
class Setup:
    """Everything built once before the first round."""

    cfg: RunConfig
    task: Task
    data: TaskData
    fed: FederatedData
    fns: ModelFunctions
    alg: Algorithm
    hp: Any  # the algorithm's hyperparameter dataclass
    device: torch.device
    backend: CohortBackend  # runs each round's local training (engine/backends/)
    init_params: dict[str, torch.Tensor]
    partition: Sequence[np.ndarray] | None = None  # client -> example indices actually used
    partition_spec: PartitionSpec | None = None  # the PartitionSpec that produced it
    executor_reason: str = ""  # why the back end was chosen (logged, tagged)
    opt: OptimConfig = field(
        default_factory=OptimConfig
    )  # cfg.train's optimiser, client_lr None -> the task's
    model: torch.nn.Module | None = None  # the module behind `fns` (its parameters are init_params)
    prefetched: dict[int, RoundPlan] = field(
        default_factory=dict
    )  # the next round's plan, built during this one

    @property
    def executor(self) -> str:
        """train.executor as it runs: the back end's name without its flag (`vmap` for `vmap + graph`)."""
        return self.backend.name.split(" + ")[0]


def resolve_device(name: str) -> torch.device:
    """Map auto|cpu|cuda|cuda:N|mps to a torch.device; ConfigError if unavailable."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device is {name!r} but CUDA is not available here; use --device cpu.")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("train.device is 'mps' but MPS is not available here; use --device cpu.")
    return torch.device(name)


def client_partition(
    cfg: RunConfig, data: TaskData, name: str | None = None
) -> tuple[Sequence[np.ndarray], Any]:
    """Return (client -> example indices, PartitionSpec) from a partition file or the scheme.

    A partition file must have been made for this data (its fingerprint is checked). A scheme
    is drawn from the run's seed; `natural` with --clients N keeps the first N natural clients.
    """
    from fedcli.datasets.partition.files import load_partition
    from fedcli.datasets.partition.make import make_partition

    part, task = cfg.partition, name or cfg.data.task  # name: the resolved task's (byo-<name> for your data)
    if part.file is not None:
        return load_partition(Path(part.file), dataset=task, fingerprint=data.fingerprint)
    spec = part.spec(seed=derive_seed(cfg.seed, Stream.PARTITION) % (2**31))
    if part.scheme == "natural":
        if not data.client_indices:
            raise ConfigError(f"task {task} has no natural clients; choose --scheme iid|dirichlet|... .")
        if part.num_clients is not None and part.num_clients > len(data.client_indices):
            raise ConfigError(
                f"partition.num_clients={part.num_clients} exceeds the {len(data.client_indices)} "
                f"natural clients of task {task}; lower --clients."
            )
        return data.client_indices[: part.num_clients or len(data.client_indices)], spec
    return make_partition(spec, labels=data.y.numpy(), natural=data.client_indices or None), spec


def build(
    cfg: RunConfig,
    *,
    peers: Peers | None = None,
    model_change: str = "refuse",
    data_cache: dict[tuple[Any, ...], TaskData] | None = None,
) -> Setup:
    """Load data, build the model, the algorithm and the back end; data-dependent checks.

    `peers` is this process's place in the torchrun group under `--executor distributed`.
    `data_cache`: the caller's store of task data across runs (a sweep worker's, `load_data`).
    `model_change`: what a user model whose source changed since its recorded sha256 gets,
    "refuse" (a run, its resume) or "warn" (`fedcli evaluate`; docs/bring-your-own.md).
    """
    device = resolve_device(cfg.train.device)
    threads = cfg.train.threads or available_cores()  # issue: two threads on a loaded 2-core box
    if cfg.train.executor == "distributed":  # this rank's GPU (LOCAL_RANK) and share of its host's cores
        device, threads = placement(cfg, device, peers)
    torch.set_num_threads(threads)
    task = resolve_task(cfg.data.task, cfg.data.model, cfg.data.file)
    data = load_data(
        task,
        cfg,
        TaskOptions(
            seed=cfg.seed,
            data_dir=Path(cfg.data.data_dir) if cfg.data.data_dir else None,
            download=cfg.data.download,
            max_clients=cfg.data.max_clients,
            data_store=cfg.data.data_store,
        ),
        data_cache,
    )
    store = choose_store(cfg.data.data_store, data.x.nbytes + data.y.nbytes, data.store is not None)
    if (
        store == "disk" and data.store is None
    ):  # loaded in memory: written to a disk store once, reopened from it
        from fedcli.datasets.formats.diskstore import store_task_data

        data = store_task_data(data, f"task {task.name}")
    transforms = augmentation.parse(
        cfg.data.augment
    )  # crop / flip / normalize (docs/your-data.md, "Augmentation")
    augmentation.check(transforms, task, data.x)
    task = augmentation.with_normalisation(task, transforms)
    indices, spec = client_partition(cfg, data, task.name)
    if cfg.train.clients_per_round > len(indices):
        raise ConfigError(
            f"train.clients_per_round={cfg.train.clients_per_round} exceeds the "
            f"{len(indices)} clients of the partition; lower --clients-per-round."
        )
    check_plan_size(cfg, max((len(ix) for ix in indices), default=0))
    with torch.random.fork_rng(devices=[]):  # model init from its own stream, global RNG untouched
        torch.manual_seed(derive_seed(cfg.seed, Stream.INIT))
        model_name = cfg.data.model or task.default_model
        if is_reference(
            model_name
        ):  # your own model: built, checked on a real batch, recorded (engine/model.py)
            task, model, cfg = build_user_model(cfg, task, data, on_change=model_change)
        elif model_name not in task.models:
            raise ConfigError(
                f"data.model must be one of {', '.join(task.models)} for task {task.name}; "
                f"got {model_name!r}."
            )
        else:
            model = task.models[model_name]()
    model = model.to(device)
    init_params = {k: v.detach().clone() for k, v in model.named_parameters()}
    fed = federated_data(data.x, data.y, indices, device, store)
    if store == "disk":
        log.info("data store: disk, %s (cohorts read from its memory maps each round)", data.store)
    alg = ALGORITHMS[cfg.algorithm.name]
    hp = make_hyperparameters(alg.name, cfg.algorithm.hp)
    refusal = alg.check_model(model, hp, vmap_obstacle(model)) if alg.check_model is not None else None
    if refusal is not None:  # the algorithm's own passes (FOLA's per-example Fisher) cannot run on this model
        raise ConfigError(refusal)
    fns = with_precision(
        model_functions(task, model, fed, bn_stats_of(cfg, alg, model)), cfg.train.precision, device
    )
    if transforms.random:  # training batches only; nothing added to the step without data.augment
        fns = replace(fns, augment=augmentation.augmenter(transforms))
    t = cfg.train
    workers = min(t.workers or available_cores(), t.clients_per_round)  # the process back end's processes
    estimate = t.executor in ("auto", "process") and device.type == "cpu" and not (t.compile or t.graph)
    workload = Workload(
        alg=alg,
        task=task,
        model=model,
        device=device,
        precision=t.precision,
        clients_per_round=t.clients_per_round,
        compile=t.compile,
        graph=t.graph,
        augment=transforms.random,
        slots=workers,
        client_bytes=client_step_bytes(fns, init_params, t.batch_size) if estimate else 0,
    )
    choice = select.choose(workload, t.executor, launched=peers is not None)
    if (
        fed.store == "disk"
        and choice.backend not in DISK_EXECUTORS
        and t.executor == "auto"
        and not t.compile
        and not t.graph
    ):  # auto spread the loop over worker processes: the disk store's cohorts stay in-process
        name, why = select.in_process(workload)
        choice = select.Choice(
            name, name, None, f"{why}; the disk data store reads each cohort in this process"
        )
    if fed.store == "disk" and choice.backend not in DISK_EXECUTORS:
        raise ConfigError(
            f"the disk data store (data.data_store={cfg.data.data_store}) runs with --executor "
            f"{'|'.join(DISK_EXECUTORS)} without --compile/--graph; got {choice.backend!r}. Use one of "
            "those, or --data-store memory if the examples fit in memory."
        )
    backend = select.build(
        choice, BackendSetup(cfg=cfg, model=model, fed=fed, device=device, workers=workers, peers=peers)
    )
    return Setup(
        cfg,
        task,
        data,
        fed,
        fns,
        alg,
        hp,
        device,
        backend,
        init_params,
        indices,
        spec,
        choice.why,
        t.optim(task.client_lr),
        model,
    )


def bn_stats_of(cfg: RunConfig, alg: Algorithm, model: torch.nn.Module) -> str:
    """train.bn_stats as the run uses it: `aggregate` needs the algorithm's declared local training
    (Algorithm.local: the clients' statistics are carried through its SGD steps, engine/local.py);
    an algorithm with its own client_update gets `estimate`, said in one INFO line."""
    requested = cfg.train.bn_stats
    if requested == "estimate" or alg.local is not None:
        return requested
    if any(
        isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats
        for m in model.modules()
    ):
        log.info(
            "BatchNorm statistics: %s runs its own client update, which cannot carry them; the server "
            "estimates them before each evaluation (train.bn_stats=estimate)",
            alg.name,
        )
    return "estimate"


DISK_EXECUTORS = (
    "loop",
    "vmap",
    "fused",
)  # back ends that read each round's batches from job.fns (CohortPlan.data)


def load_data(
    task: Task, cfg: RunConfig, options: TaskOptions, cache: dict[tuple[Any, ...], TaskData] | None = None
) -> TaskData:
    """`task.load(options)`, kept in `cache` when the caller keeps one (a long-lived sweep worker,
    fedcli/sweep/worker.py), keyed by the task, its data file and every loader option (the seed
    included: synthetic tasks draw from it). Training reads the tensors and never writes them, so
    trials share them. None, the default, loads per run."""
    if cache is None:
        return task.load(options)
    key = (task.name, cfg.data.task, cfg.data.file, cfg.data.model, options)
    if key not in cache:
        cache[key] = task.load(options)
    return cache[key]


PLAN_LIMIT = (
    2**28
)  # example slots of one round's padded plan: 3 GiB of indices and weights (docs/architecture.md §8)


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
            "--clients-per-round."
        )
