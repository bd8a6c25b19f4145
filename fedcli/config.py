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
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedcli.algorithms.base import HyperparameterError, OptimConfig
from fedcli.errors import ConfigError
from fedcli.tracking.urls import is_masked, mask_url

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
    graph: bool = False  # vmap's cohort update built once per shape and replayed: a CUDA graph on CUDA, a trace on CPU (engine/backends/graphed.py)
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
        """`store`, else FEDCLI_STORE, else `sqlite:///<root>/fedcli.db`; with its password (see `given_url`)."""
        url = given_url("tracking.store", self.store, "FEDCLI_STORE", "--store")
        return url or f"sqlite:///{Path(self.root).resolve() / 'fedcli.db'}"

    @property
    def mlflow_uri(self) -> str:
        """`tracking_uri`, else MLFLOW_TRACKING_URI, else `sqlite:///<root>/mlflow.db`; with its password."""
        url = given_url("tracking.tracking_uri", self.tracking_uri, "MLFLOW_TRACKING_URI", "--tracking-uri")
        return url or f"sqlite:///{Path(self.root).resolve() / 'mlflow.db'}"


def given_url(key: str, value: str | None, env_name: str, flag: str) -> str | None:
    """The URL a tracking key gives, or the environment's when it gives none.

    A stored config holds a URL's password masked (`user:***@host`, docs/architecture.md,
    "Security"), so a masked value (a resumed or evaluated run's, or one pasted from a hint)
    stands for the URL with its password, which only the environment can give back.

    Raises:
        ConfigError: the value is masked and `env_name` is not set.
    """
    env = os.environ.get(env_name) or None
    if value and not is_masked(value):
        return value
    if value and env is None:
        raise ConfigError(f"{key} must carry its password; got {value!r} (fedcli stores and shows URLs with the "
                          f"password masked). Pass the full URL with {flag}, or set {env_name}.")
    return env


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    seed: int = 0  # root of every random stream (cohorts, batch order, init, noise)
    data: DataConfig = field(default_factory=DataConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # key -> "value: why" of every setting filled in by a recommendation (the algorithm's or the task's,
    # `resolve_recommended`) rather than by the user; kept out of to_dict and the hash (the values are in
    # the sections), recorded as the run's tag fedcli.recommended
    recommended: Mapping[str, str] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """Return the config as plain nested dicts (the stored, resolved form)."""
        out = dataclasses.asdict(self)
        out.pop("recommended")
        out["algorithm"]["hp"] = dict(self.algorithm.hp)
        for key in ("store", "tracking_uri"):  # never a password in what is stored (docs/architecture.md, "Security")
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
    body["train"] = {k: v for k, v in body["train"].items() if k not in NOT_HASHED
                     and not (k in HASHED_UNLESS_DEFAULT and v == HASHED_UNLESS_DEFAULT[k])}
    added = HP_ADDED.get(str(body["algorithm"].get("name")), {})
    body["algorithm"] = {**body["algorithm"], "hp": {k: v for k, v in (body["algorithm"].get("hp") or {}).items()
                                                     if not (k in added and v == added[k])}}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


NOT_HASHED = ("workers", "threads", "checkpoint_every", "keep_checkpoints")
# train keys added after runs were stored: left out of the hash at their default, so a config
# that does not use them keeps the hash it had before they existed (sweeps find its runs)
HASHED_UNLESS_DEFAULT: Mapping[str, object] = {"graph": False}
# hyperparameters added after runs were stored, with the value that reproduces those runs (issue 24): left
# out of the hash at that value, and given to a stored config that lacks the key (`resume_config`), so an
# earlier run resumes as it ran and keeps its hash
HP_ADDED: Mapping[str, Mapping[str, object]] = {"bayesadmm": {"dual_scope": "seen"}}

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


INT_MAX = 2**31 - 1  # the largest integer setting: the stores keep seeds and rounds as 32-bit integers on PostgreSQL
NAME_MAX_BYTES = 200  # experiment and run names (UTF-8): both stores and MLflow keep them; a report file is named after one
THREADS_MAX = 1024  # train.threads and train.workers: more is a typo, not a machine


def coerce(key: str, annotation: object, value: Any) -> Any:
    """Check `value` against a dataclass field annotation (as written); int -> float is allowed.

    Numbers must also be storable: a float finite, an int within +-INT_MAX (docs/architecture.md §8).
    """
    checked = _coerce(key, annotation, value)
    if isinstance(checked, float) and not math.isfinite(checked):
        raise ConfigError(f"{key} must be a finite number; got {value!r}.")
    if isinstance(checked, int) and not isinstance(checked, bool) and abs(checked) > INT_MAX:
        raise ConfigError(f"{key} must be at most {INT_MAX} (2**31 - 1) in size; got {value!r}.")
    return checked


def _coerce(key: str, annotation: object, value: Any) -> Any:
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


# --------------------------------------------------------------------------- recommended settings, degeneracy
# (docs/architecture.md §7, "Recommended settings"): an algorithm may recommend run settings for the run at
# hand (Algorithm.recommend) and a task without natural clients names a default partition (Task.default_partition);
# both fill only keys the user did not set, and the config holds the values that run, so the hash of a config
# changes only where a recommendation changed what runs.


def _facts(algo_name: str, merged: Mapping[str, Mapping[str, Any]], given: frozenset[str]) -> Any:
    """The RunFacts of a merged (not yet validated) config: its task, model, rounds and cohort."""
    from fedcli.algorithms.base import RunFacts
    from fedcli.datasets.registry import TASKS

    data, train = merged["data"], merged["train"]
    task = TASKS.get(str(data.get("task", DataConfig.task))) if data.get("file") is None else None
    model = data.get("model") or (task.default_model if task is not None else "mlp")

    def whole(key: str) -> int:
        value = train.get(key, getattr(TrainConfig, key))
        return value if isinstance(value, int) and not isinstance(value, bool) else getattr(TrainConfig, key)

    return RunFacts(task=task.name if task is not None else "byo", kind=task.kind if task is not None else "byo",
                    model=str(model), rounds=whole("rounds"), clients_per_round=whole("clients_per_round"),
                    given=given)


def resolve_recommended(algo_name: str, merged: dict[str, dict[str, Any]], hp_values: dict[str, Any]) -> dict[str, str]:
    """Fill the keys the user left unset with the task's default partition and the algorithm's advice.

    Mutates `merged` (the sections) and `hp_values`; returns {key: "value: why"} of what it filled,
    which becomes `RunConfig.recommended` (the run's tag fedcli.recommended). A name that is not a task
    or an algorithm fills nothing (validation names it later).
    """
    from fedcli.algorithms import ALGORITHMS
    from fedcli.datasets.registry import TASKS

    filled: dict[str, str] = {}
    data, part = merged["data"], merged["partition"]
    task = TASKS.get(str(data.get("task", DataConfig.task)))
    if task is not None and task.default_partition and data.get("file") is None and part.get("file") is None \
            and "scheme" not in part:
        for key, value in task.default_partition.items():
            if key not in part:
                part[key] = value
                filled[f"partition.{key}"] = f"{value}: {task.default_partition_why}"
    record = ALGORITHMS.get(algo_name)
    if record is None or record.recommend is None:
        return filled
    given = frozenset({f"hp.{k}" for k in hp_values} | {f"train.{k}" for k in merged["train"]})
    names = {f.name for f in dataclasses.fields(record.config_cls)}
    for key, advice in record.recommend(_facts(algo_name, merged, given)).items():
        section, _, name = key.partition(".")
        if key in given or not ((section == "hp" and name in names) or (section == "train" and name in
                                                                        {f.name for f in dataclasses.fields(TrainConfig)})):
            continue
        (hp_values if section == "hp" else merged["train"])[name] = advice.value
        filled[key] = f"{advice.value}: {advice.why}"
    return filled


def degeneracies(cfg: RunConfig) -> list[Any]:
    """The `Degeneracy` records of a validated config: where the algorithm is another one or a key is inert."""
    from fedcli.algorithms import ALGORITHMS
    from fedcli.datasets.registry import TASKS

    record = ALGORITHMS[cfg.algorithm.name]
    if record.degenerate is None:
        return []
    task = TASKS.get(cfg.data.task) if cfg.data.file is None else None
    merged = {"data": {k: v for k, v in dataclasses.asdict(cfg.data).items() if v is not None},
              "train": {"rounds": cfg.train.rounds, "clients_per_round": cfg.train.clients_per_round}}
    facts = _facts(cfg.algorithm.name, merged, frozenset())
    opt = cfg.train.optim(task.client_lr if task is not None else 0.01)
    return list(record.degenerate(make_hyperparameters(cfg.algorithm.name, cfg.algorithm.hp), opt, facts))


def run_tags(cfg: RunConfig) -> dict[str, str]:
    """The tags a run records about its settings: fedcli.recommended and fedcli.degenerate (when any).

    fedcli.degenerate holds `code: message` per degeneracy, joined by " | "; `fedcli report` footnotes it.
    """
    tags = {}
    if cfg.recommended:
        tags["fedcli.recommended"] = "; ".join(f"{k}={v.split(':', 1)[0]}" for k, v in sorted(cfg.recommended.items()))
    found = degeneracies(cfg)
    if found:
        tags["fedcli.degenerate"] = " | ".join(f"{d.code}: {d.message}" for d in found)[:4000]
    return tags


# train.* keys each server optimiser reads (algorithms/optim.py server_opt_step): the others are inert
SERVER_OPT_KEYS: Mapping[str, tuple[str, ...]] = {
    "sgd": (), "momentum": ("server_momentum",), "adagrad": ("server_adagrad_beta1", "server_tau"),
    "adam": ("server_beta1", "server_beta2", "server_tau", "server_bias_correction"),
    "yogi": ("server_beta1", "server_beta2", "server_tau", "server_bias_correction"),
}


def warn_degenerate(cfgs: Sequence[RunConfig], swept: Sequence[str] = ()) -> list[str]:
    """One warning line per distinct degeneracy of `cfgs` (a run, or a sweep's trials), each naming the fix;
    for a sweep, also one line per swept key (`swept`: dotted keys) that has no effect in some trials."""
    lines: dict[str, None] = {}
    inert: dict[str, list[str]] = {}
    optimiser_keys = {k for keys in SERVER_OPT_KEYS.values() for k in keys}
    for cfg in cfgs:
        for d in degeneracies(cfg):
            lines[f"{cfg.algorithm.name} is degenerate here: {d.message}"] = None
            for key in d.inert:
                if key in swept or f"algorithm.{key}" in swept:
                    inert.setdefault(key, []).append(cfg.algorithm.name)
        for key in optimiser_keys - set(SERVER_OPT_KEYS.get(cfg.train.server_opt, ())):
            if f"train.{key}" in swept:
                inert.setdefault(f"train.{key}", []).append(f"server_opt={cfg.train.server_opt}")
    for key, where in inert.items():
        lines[f"swept key {key} has no effect in {len(where)} trial(s) ({', '.join(sorted(set(where)))}): their runs "
              "repeat each other; drop it from the grid or fix what makes it inert (above)."] = None
    for key in sorted({k for cfg in cfgs for k in cfg.recommended if k.startswith("train.")}):
        name = key.partition(".")[2]
        values = {cfg.algorithm.name: getattr(cfg.train, name) for cfg in cfgs}
        if len(set(values.values())) > 1:
            by = ", ".join(f"{algo} {value}" for algo, value in sorted(values.items()))
            lines[f"trials differ in {key} through recommendations ({by}): set {name} in the spec's base to "
                  "compare at equal settings."] = None
    return list(lines)


def build_config(*, file: Path | None = None, overrides: Mapping[str, Any] | None = None,
                 hp: Mapping[str, Any] | None = None, doc: Mapping[str, Any] | None = None) -> RunConfig:
    """Load YAML (optional), apply dotted CLI overrides (None = not given), validate, freeze.

    Args:
        file: a YAML file with any of the sections and `seed`.
        overrides: {"train.rounds": 10, "seed": 3, ...}; None values are ignored.
        hp: algorithm hyperparameters from --hp (override the file's algorithm.hp).
    """
    doc = dict(doc) if doc is not None else read_yaml(file) if file else {}
    noted = doc.pop("recommended", None) or {}  # a sweep trial's config names what its sweep recommended
    if not isinstance(noted, Mapping):
        raise ConfigError(f"config key 'recommended' must be a mapping of key to 'value: why'; got {noted!r}.")
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
    recommended = {**{str(k): str(v) for k, v in noted.items()}, **resolve_recommended(algo_name, merged, hp_values)}
    hyper = make_hyperparameters(algo_name, hp_values)
    sections = {name: build_section(name, cls, merged[name]) for name, cls in SECTIONS.items()
                if name != "algorithm"}
    algorithm = AlgorithmConfig(name=algo_name, hp=dataclasses.asdict(hyper))
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0; got {seed!r}.")
    if seed > INT_MAX:
        raise ConfigError(f"seed must be <= {INT_MAX} (2**31 - 1, what the stores keep); got {seed!r}.")
    cfg = RunConfig(seed=seed, algorithm=algorithm, recommended=recommended, **sections)
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
    for key, count in (("workers", t.workers), ("threads", t.threads)):
        if count is not None and count > THREADS_MAX:
            raise ConfigError(f"train.{key} must be <= {THREADS_MAX}; got {count!r}. Give the cores to use "
                              f"(--{key} N), or leave it out for the cores this process may use.")
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
    validate_tracking(cfg.tracking)


def check_name(key: str, value: str, flag: str) -> None:
    """An experiment, run or trial name: 1 to NAME_MAX_BYTES bytes of UTF-8, no control characters.

    One limit for every store: PostgreSQL and MLflow refuse longer names where SQLite would keep
    them, a report file is named after the experiment (255 bytes per file name), and PostgreSQL
    refuses NUL characters.
    """
    if not value.strip():
        raise ConfigError(f"{key} must be a non-empty name; got {value!r}. Pass {flag} NAME, or leave it out.")
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > NAME_MAX_BYTES:
        raise ConfigError(f"{key} must be at most {NAME_MAX_BYTES} bytes (UTF-8); got {size} bytes "
                          f"({value[:40]!r}...). Pass {flag} a shorter name.")
    bad = sorted({c for c in value if ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) <= 0xDFFF})
    if bad:
        raise ConfigError(f"{key} must not hold control characters; got {value!r} (with {bad[0]!r}). "
                          f"Pass {flag} a name of printable characters.")


MLFLOW_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks")  # MLflow's SQL and REST stores


def validate_tracking(track: TrackingConfig) -> None:
    """Names, and an MLflow URI MLflow can write, before anything is (docs/architecture.md §8)."""
    check_name("tracking.experiment", track.experiment, "--experiment")
    if track.run_name is not None:
        check_name("tracking.run_name", track.run_name, "--run-name")
    for key, flag, what in (("root", "--root", "a folder"), ("store", "--store", "a SQLAlchemy URL"),
                            ("tracking_uri", "--tracking-uri", "an MLflow URI")):
        value = getattr(track, key)
        if value is not None and not value.strip():  # e.g. `--store "$STORE"` with STORE unset
            raise ConfigError(f"tracking.{key} must be {what}; got {value!r}. Pass {flag} a value, or leave it out "
                              "for the default.")
    if not track.use_mlflow:
        return
    # a stored config's URI has its password masked (given_url asks for it when MLflow is used): check its scheme
    uri = track.tracking_uri if track.tracking_uri and is_masked(track.tracking_uri) else track.mlflow_uri
    source = "--tracking-uri" if track.tracking_uri else "MLFLOW_TRACKING_URI"
    scheme = uri.partition(":")[0].partition("+")[0].lower() if "://" in uri or uri.startswith("databricks") else ""
    if scheme in MLFLOW_SCHEMES:
        return
    if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("1", "true") and scheme in ("", "file"):
        return  # MLflow's folder store, allowed by the user (MLflow 3 refuses it otherwise)
    raise ConfigError(f"tracking.tracking_uri must be an MLflow store URI such as sqlite:///PATH/mlflow.db, "
                      f"postgresql://HOST/DB or http://HOST:PORT; got {masked(uri)!r} (from {source}). Fix {source}, "
                      "or pass --no-mlflow.")


def masked(url: str) -> str:
    """`scheme://user:***@host/...`: a URL as it may be shown (no password)."""
    return re.sub(r"(//[^:/@]*):[^@/]*@", r"\1:***@", url)


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


def same_run_config(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """True when two stored configs (`RunConfig.to_dict()`) differ at most in what `--resume` may change
    (RESUMABLE_OVERRIDES): a checkpoint written before a resume that added rounds still fits its run."""
    def fixed(doc: Mapping[str, Any]) -> str:
        body = {k: v for k, v in doc.items() if k != "tracking"}
        body["train"] = {k: v for k, v in dict(body.get("train") or {}).items()
                         if f"train.{k}" not in RESUMABLE_OVERRIDES}
        return canonical_json(body)

    return fixed(a) == fixed(b)


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
    hp = {**HP_ADDED.get(str(doc["algorithm"].get("name", AlgorithmConfig.name)), {}), **hp}
    return build_config(doc=doc, overrides=overrides, hp=hp)
