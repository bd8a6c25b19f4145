"""The sections of a run's config as frozen dataclasses, RunConfig, and its hash (docs/style.md rule 18).

Part of the package fedcli.config (fedcli/config/__init__.py).
Also the tracking URLs' resolution from the environment (`given_url`: FEDCLI_STORE,
MLFLOW_TRACKING_URI), which the TrackingConfig properties read. Imports no other part of
fedcli.config. Each field is declared once with `opt`: its default, its help text, and where it
has them its choices and bounds, in the field's metadata. pydantic reads that metadata: the values
of a config are validated against it (fedcli/config/checks.py `validated`) and the JSON Schema of a
run config is generated from it (fedcli/config/schema.py, docs/schema/run-config.schema.json).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BeforeValidator, ConfigDict

from fedcli.algorithms.base import SERVER_OPTIMIZERS, OptimConfig
from fedcli.errors import ConfigError
from fedcli.tracking.urls import is_masked, mask_url

if TYPE_CHECKING:
    from fedcli.datasets.partition.spec import PartitionSpec

EXECUTORS = ("auto", "loop", "vmap", "fused", "process", "distributed")  # distributed: under torchrun
PRECISIONS = ("fp32", "tf32", "bf16")  # reduced precision only when asked for
SCHEMES = ("natural", "iid", "dirichlet", "shards", "labels", "quantity", "two-level")
THREADS_MAX = 1024  # train.threads and train.workers: more is a typo, not a machine


def opt(
    default: Any = MISSING,
    doc: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    choices: tuple[str, ...] = (),
    ge: int | float | None = None,
    le: int | float | None = None,
    fix: str = "",
    **extra: Any,
) -> Any:
    """A config field: its default (or default `factory`), help text `doc`, allowed `choices`, bounds
    `ge`/`le`, and `fix` (the sentence an error past `le` ends with), kept in the field's metadata.

    pydantic reads `description`, `ge`, `le` and `json_schema_extra` from a stdlib dataclass field's
    metadata (validation and JSON Schema); `choices` and `fix` are read by fedcli/config/checks.py.
    `extra` goes to the JSON Schema only (e.g. a `pattern` that is checked by hand).
    """
    meta: dict[str, Any] = {"description": doc} if doc else {}
    meta.update({k: v for k, v in (("ge", ge), ("le", le)) if v is not None})
    if choices:
        meta["choices"] = choices
        extra = {"enum": list(choices), **extra}
    if extra:
        meta["json_schema_extra"] = extra
    if fix:
        meta["fix"] = fix
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _items(value: Any) -> Any:
    """data.augment: a list of names, or "a,b" on the CLI -> a tuple (None when empty); else unchanged."""
    items = value.split(",") if isinstance(value, str) else value
    if isinstance(items, (list, tuple)) and all(isinstance(v, str) for v in items):
        return tuple(v.strip() for v in items if v.strip()) or None
    return value


SECTION = ConfigDict(extra="forbid")  # pydantic: a key the section does not declare is refused


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    __pydantic_config__ = SECTION
    task: str = opt("femnist", "a name from `fedcli list tasks`")
    model: str | None = opt(
        None,
        "None = the task's default model; `pkg.mod:factory` / `file.py:factory`: your own",
    )
    model_sha256: str | None = opt(
        None,
        "your own model (datasets/yours/model.py): sha256 of its module's source, filled in when the config is built",
    )
    model_args: str | None = opt(
        None, "your own model: JSON of the keyword arguments its factory got (recorded by the run)"
    )
    data_dir: str | None = opt(None, "None = the bundled / default copy of the data")
    file: str | None = opt(None, "bring your own data: .npz/.csv/.parquet (see `fedcli train --help`)")
    download: bool = opt(False, "fetch missing public files into data_dir (needs a network)")
    max_clients: int | None = opt(None, "natural-client data sets: read only the first N clients")
    data_store: str = opt(
        "auto",
        "auto | memory | disk: where the examples live (datasets/federated.py, docs/scaling.md)",
        choices=("auto", "memory", "disk"),
    )
    augment: Annotated[tuple[str, ...] | None, BeforeValidator(_items)] = opt(
        None,
        'per-example transforms, e.g. ["crop:4", "flip", "normalize:0.5:0.25"] (datasets/augment.py); None = none',
    )


@dataclass(frozen=True, kw_only=True)
class PartitionConfig:
    __pydantic_config__ = SECTION
    scheme: str = opt(
        "natural", "natural = the data's own owners (writers, users, subjects)", choices=SCHEMES
    )
    num_clients: int | None = opt(None, "None = every natural client")
    alpha: float | None = opt(None, "Dirichlet concentration (dirichlet, two-level)")
    shards_per_client: int | None = opt(None, "pathological shards")
    labels_per_client: int | None = opt(None, "NIID-Bench noniid-#labelK")
    sigma: float | None = opt(None, "quantity skew: log-normal sigma of client sizes")
    size_alpha: float = opt(1.0, "two-level: Dirichlet alpha of client shares (Bayesian-ADMM paper)")
    balanced: bool = opt(False, "dirichlet: equal client sizes (FedLab's balanced variant)")
    min_size: int = opt(10, "minimum examples per client (NIID-Bench redraw)")
    file: str | None = opt(None, "a partition file written by `fedcli partition`")

    def spec(self, seed: int = 0) -> PartitionSpec:
        """The partition these settings draw (`file` aside), with the partition stream's `seed`."""
        from fedcli.datasets.partition.spec import PartitionSpec

        return PartitionSpec(
            scheme=self.scheme,
            num_clients=self.num_clients,
            alpha=self.alpha,
            shards_per_client=self.shards_per_client,
            labels_per_client=self.labels_per_client,
            min_size=self.min_size,
            seed=seed,
            balanced=self.balanced,
            sigma=self.sigma,
            size_alpha=self.size_alpha,
        )


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    __pydantic_config__ = SECTION
    name: str = opt("fedavg", "a name from `fedcli list algos`")
    hp: Mapping[str, Any] = opt(
        factory=dict, doc="resolved hyperparameters (defaults filled); `fedcli list algos NAME` lists them"
    )


def _workers_fix(flag: str) -> str:
    return f"Give the cores to use ({flag} N), or leave it out for the cores this process may use."


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    __pydantic_config__ = SECTION
    rounds: int = opt(50, "R; communication rounds", ge=1)
    clients_per_round: int = opt(10, "M; sampled uniformly without replacement each round", ge=1)
    batch_size: int = opt(20, "B; Reddi et al. EMNIST default", ge=1)
    local_epochs: int = opt(1, "E", ge=1)
    client_lr: float | None = opt(
        None,
        "eta_l; None = the task's tuned default (Task.client_lr: 0.1 on the FEMNIST and MNIST image tasks, "
        "0.01 elsewhere; docs/architecture.md §5), recorded in the resolved config",
        exclusiveMinimum=0,
    )
    client_momentum: float = opt(0.0, "client SGD momentum", minimum=0, exclusiveMaximum=1)
    server_opt: str = opt("sgd", "sgd | momentum | adam | adagrad | yogi", choices=SERVER_OPTIMIZERS)
    server_lr: float = opt(1.0, "eta_g", exclusiveMinimum=0)
    server_momentum: float = opt(0.9, "server momentum (server_opt momentum)", minimum=0, exclusiveMaximum=1)
    server_beta1: float = opt(0.9, "Adam/Yogi beta1", minimum=0, exclusiveMaximum=1)
    server_beta2: float = opt(0.99, "Adam/Yogi/Adagrad beta2", minimum=0, exclusiveMaximum=1)
    server_tau: float = opt(
        1e-3, "adaptivity tau of FedAdam/FedYogi/FedAdagrad (Reddi et al. §3)", exclusiveMinimum=0
    )
    server_bias_correction: bool = opt(False, "Adam/Yogi: divide moments by 1 - beta^t (PyTorch's Adam form)")
    server_adagrad_beta1: float = opt(
        0.0,
        "FedAdagrad momentum b1: 0 = Reddi et al.'s code (Keras Adagrad), 0.9 = Alg. 2",
        minimum=0,
        exclusiveMaximum=1,
    )
    eval_every: int = opt(1, "rounds between evaluations (the last round is always evaluated)", ge=1)
    eval_sample: int | None = opt(
        None,
        "evaluate on a fixed sample of N test examples; None = the task's paper default (StackOverflow: "
        "10,000; fedcli/engine/evaluation.py PAPER_EVAL_SAMPLE), 0 = the whole test split",
        ge=0,
    )
    checkpoint_every: int | None = opt(
        None,
        "rounds between checkpoints; None = auto (every round while a checkpoint costs <= 3 % of a round, "
        "else spaced to cost that); 0 = only at the end and on a stop",
        ge=0,
    )
    keep_checkpoints: int = opt(3, "newest checkpoints kept per run (older ones are deleted)", ge=1)
    executor: str = opt(
        "auto",
        "auto | loop | vmap | process (cohort split across CPU worker processes)",
        choices=EXECUTORS,
    )
    cohort_chunk: int | None = opt(
        None, "vmap chunk size, clients grouped by length; None = whole cohort", ge=1
    )
    device: str = opt(
        "auto", "auto | cpu | cuda | cuda:N | mps", pattern=r"^(auto|cpu|cuda|mps|cuda:[0-9]+)$"
    )
    # --- speed (docs/scaling.md)
    workers: int | None = opt(
        None,
        "process executor: processes training clients, main included; None = CPU cores",
        ge=1,
        le=THREADS_MAX,
        fix=_workers_fix("--workers"),
    )
    threads: int | None = opt(
        None,
        "intra-op threads of this process; None = the cores it may use (affinity, quota)",
        ge=1,
        le=THREADS_MAX,
        fix=_workers_fix("--threads"),
    )
    compile: bool = opt(
        False, "torch.compile: vmap -> the cohort's update; loop/process -> each client's step"
    )
    graph: bool = opt(
        False,
        "vmap's cohort update built once per shape and replayed: a CUDA graph on CUDA, a trace on CPU "
        "(engine/backends/graphed.py)",
    )
    precision: str = opt(
        "fp32",
        "fp32 | tf32 (CUDA matmul/conv) | bf16 (autocast); recorded with the run",
        choices=PRECISIONS,
    )
    # --- client state out of RAM (docs/architecture.md §3, its client-state store)
    state_store: str = opt(
        "auto",
        "auto | ram | disk; auto = disk when every client's state would exceed the cache",
        choices=("auto", "ram", "disk"),
    )
    state_cache_mb: int = opt(
        512, "disk store: MiB of client states kept in RAM (an LRU, the cohort's at least)", ge=0
    )
    state_precision: str = opt(
        "state",
        "state (each leaf's own dtype) | bf16 | fp16: how client states are stored",
        choices=("state", "bf16", "fp16"),
    )
    # --- BatchNorm statistics (docs/bring-your-own.md, "BatchNorm")
    bn_stats: str = opt(
        "aggregate",
        "aggregate = the clients carry the running statistics, the server averages them (example-weighted); "
        "local = each client keeps its own (FedBN); estimate = the server re-estimates them before each "
        "evaluation (engine/model.py)",
        choices=("aggregate", "local", "estimate"),
    )

    def optim(self, default_client_lr: float) -> OptimConfig:
        """The optimiser settings algorithms receive; client_lr None takes `default_client_lr`
        (the task's, Task.client_lr)."""
        names = {f.name for f in dataclasses.fields(OptimConfig)}
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k in names}
        if fields["client_lr"] is None:
            fields["client_lr"] = default_client_lr
        return OptimConfig(**fields)


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    __pydantic_config__ = SECTION
    root: str = opt("fedcli-runs", "folder of the default stores, models and checkpoints")
    store: str | None = opt(None, "SQLAlchemy URL; None = FEDCLI_STORE or sqlite under root")
    tracking_uri: str | None = opt(None, "MLflow URI; None = MLFLOW_TRACKING_URI or sqlite under root")
    use_mlflow: bool = opt(True, "mirror the run to MLflow")
    experiment: str = opt("default", "experiment name")
    run_name: str | None = opt(None, "run name; None = one made from the algorithm and settings")

    @property
    def store_url(self) -> str:
        """`store`, else FEDCLI_STORE, else `sqlite:///<root>/fedcli.db`; with its password (see `given_url`)."""
        return given_url("tracking.store", self.store, "FEDCLI_STORE", "--store") or (
            f"sqlite:///{Path(self.root).resolve() / 'fedcli.db'}"
        )

    @property
    def mlflow_uri(self) -> str:
        """`tracking_uri`, else MLFLOW_TRACKING_URI, else `sqlite:///<root>/mlflow.db`; with its password."""
        return given_url(
            "tracking.tracking_uri", self.tracking_uri, "MLFLOW_TRACKING_URI", "--tracking-uri"
        ) or (f"sqlite:///{Path(self.root).resolve() / 'mlflow.db'}")


def given_url(key: str, value: str | None, env_name: str, flag: str) -> str | None:
    """The URL a tracking key gives, or the environment's when it gives none.

    A stored config holds a URL's password masked (`user:***@host`, docs/operations.md,
    "Security"), so a masked value (a resumed or evaluated run's, or one pasted from a hint)
    stands for the URL with its password, which only the environment can give back.

    Raises:
        ConfigError: the value is masked and `env_name` is not set.
    """
    env = os.environ.get(env_name) or None
    if value and not is_masked(value):
        return value
    if value and env is None:
        raise ConfigError(
            f"{key} must carry its password; got {value!r} (fedcli stores and shows URLs with the "
            f"password masked). Pass the full URL with {flag}, or set {env_name}."
        )
    return env


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    __pydantic_config__ = SECTION
    seed: int = opt(0, "root of every random stream (cohorts, batch order, init, noise)", ge=0, le=2**31 - 1)
    data: DataConfig = opt(factory=DataConfig, doc="the data set and model")
    partition: PartitionConfig = opt(factory=PartitionConfig, doc="how the data is split into clients")
    algorithm: AlgorithmConfig = opt(factory=AlgorithmConfig, doc="the algorithm and its hyperparameters")
    train: TrainConfig = opt(factory=TrainConfig, doc="rounds, cohorts, optimisers, executor and resources")
    tracking: TrackingConfig = opt(factory=TrackingConfig, doc="where runs are stored and mirrored")
    # kept out of to_dict and the hash (the values are in the sections), recorded as the run's tag
    # fedcli.recommended
    recommended: Mapping[str, str] = field(
        default_factory=dict,
        compare=False,
        metadata={
            "description": 'key -> "value: why" of every setting filled in by a recommendation (the '
            "algorithm's or the task's, `resolve_recommended`) rather than by the user"
        },
    )

    def to_dict(self) -> dict[str, Any]:
        """Return the config as plain nested dicts (the stored, resolved form)."""
        out = dataclasses.asdict(self)
        out.pop("recommended")
        out["algorithm"]["hp"] = dict(self.algorithm.hp)
        for key in (
            "store",
            "tracking_uri",
        ):  # never a password in what is stored (docs/operations.md, "Security")
            out["tracking"][key] = out["tracking"][key] and mask_url(out["tracking"][key])
        return out

    @property
    def config_hash(self) -> str:
        """sha256 of the canonical JSON of everything that determines results.

        Left out: the tracking section and the `NOT_HASHED` train keys (resources and
        bookkeeping that do not change results: how many processes share the cohort, how
        often to checkpoint; `fedcli sweep --workers N` sets workers per trial).
        """
        return config_hash_of(self.to_dict())


def config_hash_of(doc: Mapping[str, Any]) -> str:
    """`RunConfig.config_hash` of a stored config (`RunConfig.to_dict()`, e.g. a checkpoint's)."""
    body = {k: v for k, v in doc.items() if k != "tracking"}
    body["data"] = {
        k: v
        for k, v in (body.get("data") or {}).items()
        if k not in DATA_NOT_HASHED and not (k in DATA_HASHED_UNLESS_NONE and v is None)
    }
    body["train"] = {
        k: v
        for k, v in body["train"].items()
        if k not in NOT_HASHED and not (k in HASHED_UNLESS_DEFAULT and v == HASHED_UNLESS_DEFAULT[k])
    }
    added = HP_ADDED.get(str(body["algorithm"].get("name")), {})
    body["algorithm"] = {
        **body["algorithm"],
        "hp": {
            k: v for k, v in (body["algorithm"].get("hp") or {}).items() if not (k in added and v == added[k])
        },
    }
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


NOT_HASHED = ("workers", "threads", "checkpoint_every", "keep_checkpoints", "state_store", "state_cache_mb")
# data keys: a user model's source hash counts where set (an edited model is another config); left out
# while None, so configs of built-in models keep their hashes. model_args follows from the data: never hashed
DATA_HASHED_UNLESS_NONE = (
    "model_sha256",
    "augment",
)  # augment: None keeps the hashes of runs before it existed
DATA_NOT_HASHED = ("model_args", "data_store")  # data_store: where the examples live, not what they are
# train keys added after runs were stored: left out of the hash at their default, so a config
# that does not use them keeps the hash it had before they existed (sweeps find its runs)
HASHED_UNLESS_DEFAULT: Mapping[str, object] = {
    "graph": False,
    "state_precision": "state",
    "eval_sample": None,
    "bn_stats": "aggregate",
}
# hyperparameters added after runs were stored, with the value that reproduces those runs: left
# out of the hash at that value, and given to a stored config that lacks the key (`resume_config`), so an
# earlier run resumes as it ran and keeps its hash
HP_ADDED: Mapping[str, Mapping[str, object]] = {"bayesadmm": {"dual_scope": "seen"}}

SECTIONS: Mapping[str, type] = {
    "data": DataConfig,
    "partition": PartitionConfig,
    "algorithm": AlgorithmConfig,
    "train": TrainConfig,
    "tracking": TrackingConfig,
}


def canonical_json(obj: object) -> str:
    """Return sorted-key compact JSON (the form that is hashed and stored)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
