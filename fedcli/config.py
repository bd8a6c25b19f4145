"""RunConfig: the typed, validated, frozen configuration of one run (docs/style.md rule 18).

Built from a YAML file (`--config run.yaml`) overridden by CLI flags, validated once, then
never changed. Sections: data, partition, algorithm, train, tracking, plus the root seed.
Every user-facing check lives here and raises `ConfigError` with the message format of
docs/style.md rule 11. Environment variables are read only here (FEDCLI_STORE, MLFLOW_TRACKING_URI).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedcli.algorithms.base import HyperparameterError, OptimConfig
from fedcli.errors import ConfigError

EXECUTORS = ("auto", "loop", "vmap", "fused", "process", "distributed")  # distributed: under torchrun
PRECISIONS = ("fp32", "tf32", "bf16")  # issue 7: reduced precision only when asked for
SCHEMES = ("natural", "iid", "dirichlet", "shards", "labels", "quantity", "two-level")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    task: str = "femnist"  # a name from `fedcli list tasks`
    model: str | None = None  # None = the task's default model
    data_dir: str | None = None  # None = the bundled / default copy of the data
    file: str | None = None  # bring your own data: .npz/.csv/.parquet (see `fedcli train --help`)
    download: bool = False  # fetch missing public files into data_dir (needs a network)
    max_clients: int | None = None  # natural-client data sets: read only the first N clients


@dataclass(frozen=True, kw_only=True)
class PartitionConfig:
    scheme: str = "natural"  # natural = the data's own owners (writers, users, subjects)
    num_clients: int | None = None  # None = every natural client
    alpha: float | None = None  # Dirichlet concentration (dirichlet, two-level)
    shards_per_client: int | None = None  # pathological shards
    labels_per_client: int | None = None  # NIID-Bench noniid-#labelK
    sigma: float | None = None  # quantity skew: log-normal sigma of client sizes
    size_alpha: float = 1.0  # two-level: Dirichlet alpha of client shares (Bayesian-ADMM paper)
    balanced: bool = False  # dirichlet: equal client sizes (FedLab's balanced variant)
    min_size: int = 10  # minimum examples per client (NIID-Bench redraw)
    file: str | None = None  # a partition file written by `fedcli partition`


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    name: str = "fedavg"
    hp: Mapping[str, Any] = field(default_factory=dict)  # resolved hyperparameters (defaults filled)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    rounds: int = 50  # R; communication rounds
    clients_per_round: int = 10  # M; sampled uniformly without replacement each round
    batch_size: int = 20  # B; Reddi et al. EMNIST default
    local_epochs: int = 1  # E
    client_lr: float | None = None  # eta_l; None = the task's tuned default (Task.client_lr: 0.1 on the
    # FEMNIST and MNIST image tasks, 0.01 elsewhere; docs/architecture.md §5), recorded in the resolved config
    client_momentum: float = 0.0
    server_opt: str = "sgd"
    server_lr: float = 1.0  # eta_g
    server_momentum: float = 0.9
    server_beta1: float = 0.9
    server_beta2: float = 0.99
    server_tau: float = 1e-3
    server_bias_correction: bool = False  # Adam/Yogi: divide moments by 1 - beta^t (PyTorch's Adam form)
    server_adagrad_beta1: float = 0.0  # FedAdagrad momentum b1: 0 = Reddi et al.'s code (Keras Adagrad), 0.9 = Alg. 2
    eval_every: int = 1  # rounds between evaluations (the last round is always evaluated)
    checkpoint_every: int | None = None  # rounds between checkpoints; None = auto (every round while a
    # checkpoint costs <= 3 % of a round, else spaced to cost that); 0 = only at the end and on a stop
    keep_checkpoints: int = 3  # newest checkpoints kept per run (older ones are deleted)
    executor: str = "auto"  # auto | loop | vmap | process (cohort split across CPU worker processes)
    cohort_chunk: int | None = None  # vmap chunk size, clients grouped by length; None = whole cohort
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    # --- issue 7 (speed)
    workers: int | None = None  # process executor: processes training clients, main included; None = CPU cores
    threads: int | None = None  # intra-op threads of this process; None = the cores it may use (affinity, quota)
    compile: bool = False  # torch.compile: vmap -> the cohort's update; loop/process -> each client's step
    graph: bool = False  # vmap's cohort update built once per shape and replayed: a CUDA graph on CUDA, a trace on CPU (engine/graphed.py)
    precision: str = "fp32"  # fp32 | tf32 (CUDA matmul/conv) | bf16 (autocast); recorded with the run

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
    root: str = "fedcli-runs"  # folder of the default stores, models and checkpoints
    store: str | None = None  # SQLAlchemy URL; None = FEDCLI_STORE or sqlite under root
    tracking_uri: str | None = None  # MLflow URI; None = MLFLOW_TRACKING_URI or sqlite under root
    use_mlflow: bool = True
    experiment: str = "default"
    run_name: str | None = None

    @property
    def store_url(self) -> str:
        if self.store:
            return self.store
        env = os.environ.get("FEDCLI_STORE")
        return env or f"sqlite:///{Path(self.root).resolve() / 'fedcli.db'}"

    @property
    def mlflow_uri(self) -> str:
        if self.tracking_uri:
            return self.tracking_uri
        env = os.environ.get("MLFLOW_TRACKING_URI")
        return env or f"sqlite:///{Path(self.root).resolve() / 'mlflow.db'}"


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    seed: int = 0  # root of every random stream (cohorts, batch order, init, noise)
    data: DataConfig = field(default_factory=DataConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def to_dict(self) -> dict[str, Any]:
        """Return the config as plain nested dicts (the stored, resolved form)."""
        out = dataclasses.asdict(self)
        out["algorithm"]["hp"] = dict(self.algorithm.hp)
        return out

    @property
    def config_hash(self) -> str:
        """sha256 of the canonical JSON of everything that determines results.

        Left out: the tracking section and the `NOT_HASHED` train keys (resources and
        bookkeeping that do not change results: how many processes share the cohort, how
        often to checkpoint; `fedcli sweep --workers N` sets workers per trial).
        """
        body = {k: v for k, v in self.to_dict().items() if k != "tracking"}
        body["train"] = {k: v for k, v in body["train"].items() if k not in NOT_HASHED
                         and not (k in HASHED_UNLESS_DEFAULT and v == HASHED_UNLESS_DEFAULT[k])}
        return hashlib.sha256(canonical_json(body).encode()).hexdigest()


NOT_HASHED = ("workers", "threads", "checkpoint_every", "keep_checkpoints")
# train keys added after runs were stored: left out of the hash at their default, so a config
# that does not use them keeps the hash it had before they existed (sweeps find its runs)
HASHED_UNLESS_DEFAULT: Mapping[str, object] = {"graph": False}

SECTIONS: Mapping[str, type] = {
    "data": DataConfig, "partition": PartitionConfig, "algorithm": AlgorithmConfig,
    "train": TrainConfig, "tracking": TrackingConfig,
}


def canonical_json(obj: object) -> str:
    """Return sorted-key compact JSON (the form that is hashed and stored)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping; ConfigError naming the file when it is malformed."""
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"config file {path} is not valid YAML: {first}") from exc
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {path} must be a mapping of sections; got {type(doc).__name__}.")
    return doc


def suggest(name: str, options: list[str] | tuple[str, ...]) -> str:
    """Return ' (did you mean 'x'?)' for the closest option, or ''."""
    match = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def parse_value(text: str) -> Any:
    """Parse a CLI value ('0.1', 'true', '[1,2]') as YAML; fall back to the string."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_assignments(items: list[str], flag: str) -> dict[str, Any]:
    """Parse ['key=value', ...] into {key: typed value}; ConfigError on a malformed item."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag} must be KEY=VALUE; got {item!r}.")
        if key.strip() in out:
            raise ConfigError(f"{flag} {key.strip()} must be given once; got {key.strip()}={out[key.strip()]!r} and "
                              f"{item!r}. Keep one.")
        out[key.strip()] = parse_value(value.strip())
    return out


def coerce(key: str, annotation: object, value: Any) -> Any:
    """Check `value` against a dataclass field annotation (as written); int -> float is allowed."""
    text = str(annotation)
    if value is None:
        if "None" in text:
            return None
        raise ConfigError(f"{key} must be set; got None.")
    kinds = {part.strip() for part in text.split("|")}
    if isinstance(value, bool):
        if "bool" in kinds:
            return value
    elif isinstance(value, int) and ("int" in kinds or "float" in kinds):
        return value if "int" in kinds else float(value)
    elif isinstance(value, float) and "float" in kinds:
        return value
    elif isinstance(value, str) and "float" in kinds and _is_number(value):
        return float(value)  # YAML 1.1 reads 5e-5 (no dot) as a string
    elif isinstance(value, str) and "str" in kinds:
        return value
    elif isinstance(value, Mapping) and any(k.startswith("Mapping") or k.startswith("dict") for k in kinds):
        return dict(value)
    expected = " or ".join(sorted(k for k in kinds if k != "None"))
    raise ConfigError(f"{key} must be {expected}; got {value!r}.")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def build_section(name: str, cls: type, values: Mapping[str, Any]) -> Any:
    """Construct one frozen section from a mapping, naming unknown keys and bad types."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"unknown config key '{name}.{key}'{suggest(key, list(known))}.")
        kwargs[key] = coerce(f"{name}.{key}", known[key].type, value)
    try:
        return cls(**kwargs)
    except HyperparameterError as exc:
        raise ConfigError(str(exc)) from None


def make_hyperparameters(algo_name: str, values: Mapping[str, Any]) -> Any:
    """Build the algorithm's hyperparameter dataclass from user values (keys without 'hp.')."""
    from fedcli.algorithms import ALGORITHMS

    if algo_name not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm {algo_name!r}{suggest(algo_name, list(ALGORITHMS))}; "
                          f"choose one of: {', '.join(ALGORITHMS)}.")
    cls = ALGORITHMS[algo_name].config_cls
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            valid = ", ".join(known) or "none"
            raise ConfigError(f"unknown hyperparameter 'hp.{key}' for {algo_name}{suggest(key, list(known))}; "
                              f"valid: {valid}.")
        kwargs[key] = coerce(f"hp.{key}", known[key].type, value)
    try:
        return cls(**kwargs)
    except HyperparameterError as exc:
        raise ConfigError(str(exc)) from None
    except TypeError as exc:  # a required hyperparameter is missing
        raise ConfigError(f"{algo_name}: {exc}; pass it with --hp KEY=VALUE.") from None


def build_config(*, file: Path | None = None, overrides: Mapping[str, Any] | None = None,
                 hp: Mapping[str, Any] | None = None, doc: Mapping[str, Any] | None = None) -> RunConfig:
    """Load YAML (optional), apply dotted CLI overrides (None = not given), validate, freeze.

    Args:
        file: a YAML file with any of the sections and `seed`.
        overrides: {"train.rounds": 10, "seed": 3, ...}; None values are ignored.
        hp: algorithm hyperparameters from --hp (override the file's algorithm.hp).
    """
    doc = dict(doc) if doc is not None else read_yaml(file) if file else {}
    for key in doc:
        if key != "seed" and key not in SECTIONS:
            raise ConfigError(f"unknown config section {key!r}{suggest(key, [*SECTIONS, 'seed'])}.")
    for name in SECTIONS:
        if not isinstance(doc.get(name) or {}, Mapping):
            raise ConfigError(f"config section {name!r} must be a mapping of keys to values; got "
                              f"{doc[name]!r}. Write it as `{name}: {{key: value}}`.")
    merged: dict[str, dict[str, Any]] = {name: dict(doc.get(name) or {}) for name in SECTIONS}
    seed = doc.get("seed", 0)
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        if dotted == "seed":
            seed = value
            continue
        section, _, key = dotted.partition(".")
        merged[section][key] = value
    file_hp = merged["algorithm"].pop("hp", None) or {}
    if not isinstance(file_hp, Mapping):
        raise ConfigError(f"algorithm.hp must be a mapping of hyperparameters; got {file_hp!r}. "
                          "Write it as `hp: {rho: 0.1}`.")
    hp_values = {**dict(file_hp), **dict(hp or {})}
    algo_name = str(merged["algorithm"].get("name", AlgorithmConfig.name))
    hyper = make_hyperparameters(algo_name, hp_values)
    sections = {name: build_section(name, cls, merged[name]) for name, cls in SECTIONS.items()
                if name != "algorithm"}
    algorithm = AlgorithmConfig(name=algo_name, hp=dataclasses.asdict(hyper))
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0; got {seed!r}.")
    cfg = RunConfig(seed=seed, algorithm=algorithm, **sections)
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    """Cross-field and range checks that do not need data; ConfigError on the first problem."""
    from fedcli.datasets.registry import TASKS

    t = cfg.train
    for key, value, low in (("rounds", t.rounds, 1), ("clients_per_round", t.clients_per_round, 1),
                            ("batch_size", t.batch_size, 1), ("eval_every", t.eval_every, 1),
                            ("checkpoint_every", 0 if t.checkpoint_every is None else t.checkpoint_every, 0),
                            ("keep_checkpoints", t.keep_checkpoints, 1)):
        if value < low:
            raise ConfigError(f"train.{key} must be >= {low}; got {value!r}.")
    if t.executor not in EXECUTORS:
        raise ConfigError(f"train.executor must be one of {', '.join(EXECUTORS)}; got {t.executor!r}.")
    if t.cohort_chunk is not None and t.cohort_chunk < 1:
        raise ConfigError(f"train.cohort_chunk must be >= 1; got {t.cohort_chunk!r}.")
    if t.workers is not None and t.workers < 1:
        raise ConfigError(f"train.workers must be >= 1; got {t.workers!r}.")
    if t.threads is not None and t.threads < 1:
        raise ConfigError(f"train.threads must be >= 1; got {t.threads!r}.")
    if t.precision not in PRECISIONS:
        raise ConfigError(f"train.precision must be one of {', '.join(PRECISIONS)}; got {t.precision!r}.")
    if not (t.device in ("auto", "cpu", "cuda", "mps") or t.device.startswith("cuda:")):
        raise ConfigError(f"train.device must be auto, cpu, cuda, cuda:N or mps; got {t.device!r}.")
    try:
        t.optim(default_client_lr=1.0)  # constructing validates the settings (a task's own lr is > 0)
    except HyperparameterError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.data.file is not None:
        from fedcli.datasets.byo import MODELS, SUFFIXES, has_client

        if not Path(cfg.data.file).is_file():
            raise ConfigError(f"data.file {cfg.data.file!r} does not exist; pass an .npz/.csv/.parquet file to --data.")
        if Path(cfg.data.file).suffix not in SUFFIXES:
            raise ConfigError(f"data.file must be a {', '.join(SUFFIXES)} file; got {cfg.data.file!r}. "
                              "Save your arrays with numpy.savez or your table as CSV/Parquet.")
        defaults = DataConfig()
        ignored = [(k, flag) for k, flag in (("task", "--task"), ("data_dir", "--data-dir"), ("download", "--download"),
                                             ("max_clients", "--max-clients"))
                   if getattr(cfg.data, k) != getattr(defaults, k)]
        if ignored:
            key, flag = ignored[0]
            raise ConfigError(f"data.{key} must be left unset with data.file; got data.{key}="
                              f"{getattr(cfg.data, key)!r} and data.file={cfg.data.file!r}. Drop {flag}: "
                              "--data is the whole data set.")
        if cfg.data.model is not None and cfg.data.model not in MODELS:
            raise ConfigError(f"data.model must be one of {', '.join(MODELS)} with --data; got {cfg.data.model!r}"
                              f"{suggest(cfg.data.model, MODELS)}.")
        if cfg.partition.file is None and cfg.partition.scheme == "natural" and has_client(Path(cfg.data.file)) is False:
            raise ConfigError(f"partition.scheme 'natural' needs a client array or column in {Path(cfg.data.file).name};"
                              " got none. Pass --scheme iid --clients N (or dirichlet, shards, ...), or add `client`.")
    elif cfg.data.task not in TASKS:
        raise ConfigError(f"unknown task {cfg.data.task!r}{suggest(cfg.data.task, list(TASKS))}; "
                          f"choose one of: {', '.join(TASKS)}.")
    task = TASKS.get(cfg.data.task)
    if task is not None and cfg.data.file is None:
        require_max_clients_support(task, cfg.data.max_clients)
    if task is not None and cfg.data.file is None and cfg.data.model is not None and cfg.data.model not in task.models:
        raise ConfigError(f"data.model must be one of {', '.join(task.models)} for task {task.name}; "
                          f"got {cfg.data.model!r}.")
    if cfg.partition.scheme not in SCHEMES:
        raise ConfigError(f"partition.scheme must be one of {', '.join(SCHEMES)}; got {cfg.partition.scheme!r}.")
    validate_partition(cfg.partition, cfg.data)


def require_max_clients_support(task: Any, max_clients: int | None) -> None:
    """--max-clients only for tasks whose loader reads it (else it would be ignored without a word)."""
    from fedcli.datasets.registry import TASKS

    if max_clients is None or task.reads_max_clients:
        return
    readers = ", ".join(name for name, t in TASKS.items() if t.reads_max_clients)
    raise ConfigError(f"data.max_clients is not used by task {task.name!r}; got {max_clients!r}. Drop --max-clients "
                      f"(it applies to {readers}); --clients N keeps the first N natural clients of any task.")


# CLI flag of each partition field; a partition file fixes all of them.
PARTITION_FLAGS = {"scheme": "--scheme", "num_clients": "--clients", "alpha": "--alpha",
                   "shards_per_client": "--shards-per-client", "labels_per_client": "--labels-per-client",
                   "sigma": "--sigma", "size_alpha": "--size-alpha", "balanced": "--balanced", "min_size": "--min-size"}


def validate_partition(part: PartitionConfig, data: DataConfig) -> None:
    """A partition file excludes the scheme options; otherwise the scheme's options must fit it.

    Without this check `--partition p.json --scheme iid --clients 5` trained on the file's
    partition but stored `scheme: iid, num_clients: 5` with the run.
    """
    from fedcli.datasets.partition import PartitionSpec, check_partition_file, check_unused_defaults

    defaults = PartitionConfig()
    if part.file is not None:
        given = [k for k in PARTITION_FLAGS if getattr(part, k) != getattr(defaults, k)]
        if given:
            values = ", ".join(f"partition.{k}={getattr(part, k)!r}" for k in given)
            raise ConfigError(f"partition.{given[0]} must be left unset with partition.file; got {values} and "
                              f"partition.file={part.file!r}. Drop {'/'.join(PARTITION_FLAGS[k] for k in given)}: "
                              "the partition file fixes them.")
        check_partition_file(Path(part.file), dataset=data.task if data.file is None else None)
        return
    check_unused_defaults(PartitionSpec(
        scheme=part.scheme, num_clients=part.num_clients, alpha=part.alpha, shards_per_client=part.shards_per_client,
        labels_per_client=part.labels_per_client, min_size=part.min_size, balanced=part.balanced, sigma=part.sigma,
        size_alpha=part.size_alpha))


def store_file(url: str) -> Path | None:
    """The database file of a SQLite store URL; None for other databases and in-memory SQLite."""
    if not url.startswith("sqlite:///"):
        return None
    database = url.removeprefix("sqlite:///").split("?", 1)[0]
    return None if database in ("", ":memory:") or database.startswith("file:") else Path(database).expanduser()


def require_store(url: str) -> None:
    """For commands that only read runs: the store must exist (opening a missing SQLite file creates it)."""
    path = store_file(url)
    if path is None or path.is_file():
        return
    what = "a directory" if path.is_dir() else "no such file"
    raise ConfigError(f"tracking.store must be an existing results store; got {url!r} ({what}). Train a run "
                      "into it first (fedcli train), or pass --store / set FEDCLI_STORE to the store you trained into.")


RESUMABLE_OVERRIDES = ("train.rounds", "train.checkpoint_every", "train.keep_checkpoints", "train.threads",
                       "train.device",
                       "train.executor",
                       "train.cohort_chunk", "train.workers", "tracking.root", "tracking.store", "tracking.tracking_uri",
                       "tracking.use_mlflow")


def resume_config(stored: Mapping[str, Any], overrides: Mapping[str, Any]) -> RunConfig:
    """Rebuild a stored run's config; only rounds, checkpointing, device and tracking may change.

    Raises:
        ConfigError: when an override would change the results of the resumed run.
    """
    changing = sorted(k for k, v in overrides.items() if v is not None and k not in RESUMABLE_OVERRIDES)
    if changing:
        raise ConfigError(f"--resume continues a run with its stored config; {', '.join(changing)} cannot "
                          "change. Start a new run instead, or drop those options.")
    doc = {k: dict(v) if isinstance(v, Mapping) else v for k, v in stored.items()}
    hp = dict(doc["algorithm"].pop("hp", {}) or {})
    return build_config(doc=doc, overrides=overrides, hp=hp)
