"""RunConfig: the typed, validated, frozen configuration of one run (docs/style.md rule 18).

Built from a YAML file (`--config run.yaml`) overridden by CLI flags, validated once, then
never changed. Sections: data, partition, algorithm, train, tracking, plus the root seed.
Every user-facing check lives in this module and the two below, and raises `ConfigError` with the
message format of docs/style.md rule 11. Environment variables are read only there (FEDCLI_STORE,
MLFLOW_TRACKING_URI).

The two other modules of the package (fedcli/config/__init__.py): `sections` (the frozen dataclasses,
RunConfig, the hash) and `checks` (parsing, coercion, validation). This module builds a run's config
(`build_config`: merge, recommended settings, validate, freeze), reports degenerate settings and
rebuilds a stored run's config for `--resume`. Import direction: sections <- checks <- this.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedcli.algorithms import ALGORITHMS
from fedcli.config.checks import (
    INT_MAX,
    build_section,
    make_hyperparameters,
    read_yaml,
    suggest,
)
from fedcli.config.sections import (
    HP_ADDED,
    SECTIONS,
    AlgorithmConfig,
    DataConfig,
    RunConfig,
    TrainConfig,
    canonical_json,
)
from fedcli.config.validation import record_model_source, validate
from fedcli.errors import ConfigError

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

    return RunFacts(
        task=task.name if task is not None else "byo",
        kind=task.kind if task is not None else "byo",
        model=str(model),
        rounds=whole("rounds"),
        clients_per_round=whole("clients_per_round"),
        given=given,
        num_clients=task.num_clients if task is not None else None,
    )


def resolve_recommended(
    algo_name: str, merged: dict[str, dict[str, Any]], hp_values: dict[str, Any]
) -> dict[str, str]:
    """Fill the keys the user left unset with the task's default partition and the algorithm's advice.

    Mutates `merged` (the sections) and `hp_values`; returns {key: "value: why"} of what it filled,
    which becomes `RunConfig.recommended` (the run's tag fedcli.recommended). A name that is not a task
    or an algorithm fills nothing (validation names it later).
    """
    from fedcli.datasets.registry import TASKS

    filled: dict[str, str] = {}
    data, part = merged["data"], merged["partition"]
    task = TASKS.get(str(data.get("task", DataConfig.task)))
    if (
        task is not None
        and task.default_partition
        and data.get("file") is None
        and part.get("file") is None
        and "scheme" not in part
    ):
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
        if key in given or not (
            (section == "hp" and name in names)
            or (section == "train" and name in {f.name for f in dataclasses.fields(TrainConfig)})
        ):
            continue
        (hp_values if section == "hp" else merged["train"])[name] = advice.value
        filled[key] = f"{advice.value}: {advice.why}"
    return filled


def degeneracies(cfg: RunConfig, shortfalls: bool = False) -> list[Any]:
    """The `Degeneracy` records the algorithm's `degenerate` hook returns for a validated config: where the
    algorithm is another one or a key is inert; with `shortfalls`, those of kind "shortfall" instead (the
    algorithm acts as itself but is measured to trail FedAvg under this config; docs/out-of-the-box.md,
    "Known shortfalls")."""
    from fedcli.datasets.registry import TASKS

    record = ALGORITHMS[cfg.algorithm.name]
    if record.degenerate is None:
        return []
    task = TASKS.get(cfg.data.task) if cfg.data.file is None else None
    merged = {
        "data": {k: v for k, v in dataclasses.asdict(cfg.data).items() if v is not None},
        "train": {"rounds": cfg.train.rounds, "clients_per_round": cfg.train.clients_per_round},
    }
    found = record.degenerate(
        make_hyperparameters(cfg.algorithm.name, cfg.algorithm.hp),
        cfg.train.optim(task.client_lr if task is not None else 0.01),
        _facts(cfg.algorithm.name, merged, frozenset()),
    )
    return [d for d in found if (d.kind == "shortfall") == shortfalls]


def run_tags(cfg: RunConfig) -> dict[str, str]:
    """The tags a run records about its settings: fedcli.recommended and fedcli.degenerate (when any).

    fedcli.degenerate holds `code: message` per degeneracy, joined by " | "; `fedcli report` footnotes it;
    fedcli.shortfall the same for the known shortfalls.
    """
    tags = {}
    if cfg.recommended:
        tags["fedcli.recommended"] = "; ".join(
            f"{k}={v.split(':', 1)[0]}" for k, v in sorted(cfg.recommended.items())
        )
    for tag, found in (
        ("fedcli.degenerate", degeneracies(cfg)),
        ("fedcli.shortfall", degeneracies(cfg, shortfalls=True)),
    ):
        if found:
            tags[tag] = " | ".join(f"{d.code}: {d.message}" for d in found)[:4000]
    return tags


# train.* keys each server optimiser reads (algorithms/optim.py server_opt_step): the others are inert
SERVER_OPT_KEYS: Mapping[str, tuple[str, ...]] = {
    "sgd": (),
    "momentum": ("server_momentum",),
    "adagrad": ("server_adagrad_beta1", "server_tau"),
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
        for d in degeneracies(cfg, shortfalls=True):
            lines[f"{cfg.algorithm.name} is known to trail FedAvg here: {d.message}"] = None
        for d in degeneracies(cfg):
            lines[f"{cfg.algorithm.name} is degenerate here: {d.message}"] = None
            for key in d.inert:
                if key in swept or f"algorithm.{key}" in swept:
                    inert.setdefault(key, []).append(cfg.algorithm.name)
        for key in optimiser_keys - set(SERVER_OPT_KEYS.get(cfg.train.server_opt, ())):
            if f"train.{key}" in swept:
                inert.setdefault(f"train.{key}", []).append(f"server_opt={cfg.train.server_opt}")
    for key, where in inert.items():
        lines[
            f"swept key {key} has no effect in {len(where)} trial(s) ({', '.join(sorted(set(where)))}): their runs "
            "repeat each other; drop it from the grid or fix what makes it inert (above)."
        ] = None
    for key in sorted({k for cfg in cfgs for k in cfg.recommended if k.startswith("train.")}):
        name = key.partition(".")[2]
        values = {cfg.algorithm.name: getattr(cfg.train, name) for cfg in cfgs}
        if len(set(values.values())) > 1:
            by = ", ".join(f"{algo} {value}" for algo, value in sorted(values.items()))
            lines[
                f"trials differ in {key} through recommendations ({by}): set {name} in the spec's base to "
                "compare at equal settings."
            ] = None
    return list(lines)


def build_config(
    *,
    file: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    hp: Mapping[str, Any] | None = None,
    doc: Mapping[str, Any] | None = None,
) -> RunConfig:
    """Load YAML (optional), apply dotted CLI overrides (None = not given), validate, freeze.

    Args:
        file: a YAML file with any of the sections and `seed`.
        overrides: {"train.rounds": 10, "seed": 3, ...}; None values are ignored.
        hp: algorithm hyperparameters from --hp (override the file's algorithm.hp).
    """
    doc = dict(doc) if doc is not None else read_yaml(file) if file else {}
    noted = doc.pop("recommended", None) or {}  # a sweep trial's config names what its sweep recommended
    if not isinstance(noted, Mapping):
        raise ConfigError(
            f"config key 'recommended' must be a mapping of key to 'value: why'; got {noted!r}."
        )
    for key in doc:
        if key != "seed" and key not in SECTIONS:
            raise ConfigError(f"unknown config section {key!r}{suggest(key, [*SECTIONS, 'seed'])}.")
    for name in SECTIONS:
        if not isinstance(doc.get(name) or {}, Mapping):
            raise ConfigError(
                f"config section {name!r} must be a mapping of keys to values; got "
                f"{doc[name]!r}. Write it as `{name}: {{key: value}}`."
            )
    merged: dict[str, dict[str, Any]] = {name: dict(doc.get(name) or {}) for name in SECTIONS}
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    seed = given.pop("seed", doc.get("seed", 0))
    for dotted, value in given.items():
        section, _, key = dotted.partition(".")
        merged[section][key] = value
    file_hp = merged["algorithm"].pop("hp", None) or {}
    if not isinstance(file_hp, Mapping):
        raise ConfigError(
            f"algorithm.hp must be a mapping of hyperparameters; got {file_hp!r}. "
            "Write it as `hp: {rho: 0.1}`."
        )
    hp_values = {**dict(file_hp), **dict(hp or {})}
    extra = sorted(map(str, set(merged["algorithm"]) - {"name"}))
    if extra:  # `algorithm: {name: fedpa, rho: 0.1}` trained with the default rho
        raise ConfigError(
            f"unknown config key 'algorithm.{extra[0]}'; the algorithm section holds name and hp: "
            f"write hyperparameters as `hp: {{{extra[0]}: ...}}` (or --hp {extra[0]}=VALUE)."
        )
    algo_name = merged["algorithm"].get("name", AlgorithmConfig.name)
    if not isinstance(algo_name, str):  # `name: 5` or an empty `name:` were looked up as '5' / 'None'
        raise ConfigError(
            f"algorithm.name must be an algorithm name (`fedcli list algos`); got {algo_name!r}."
        )
    recommended = {
        **{str(k): str(v) for k, v in noted.items()},
        **resolve_recommended(algo_name, merged, hp_values),
    }
    hyper = make_hyperparameters(algo_name, hp_values)
    sections = {
        name: build_section(name, cls, merged[name]) for name, cls in SECTIONS.items() if name != "algorithm"
    }
    algorithm = AlgorithmConfig(name=algo_name, hp=dataclasses.asdict(hyper))
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0; got {seed!r}.")
    if seed > INT_MAX:
        raise ConfigError(f"seed must be <= {INT_MAX} (2**31 - 1, what the stores keep); got {seed!r}.")
    cfg = RunConfig(seed=seed, algorithm=algorithm, recommended=recommended, **sections)
    validate(cfg)
    return record_model_source(
        cfg
    )  # a user model: its reference made canonical, its source's sha256 recorded


RESUMABLE_OVERRIDES = (
    "train.rounds",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.threads",
    "train.device",
    "train.executor",
    "train.cohort_chunk",
    "train.workers",
    "train.state_store",
    "train.state_cache_mb",
    "tracking.root",
    "tracking.store",
    "tracking.tracking_uri",
    "tracking.use_mlflow",
    "data.data_store",
)


def same_run_config(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """True when two stored configs (`RunConfig.to_dict()`) differ at most in what `--resume` may change
    (RESUMABLE_OVERRIDES): a checkpoint written before a resume that added rounds still fits its run."""

    def fixed(doc: Mapping[str, Any]) -> str:
        body = {k: v for k, v in doc.items() if k != "tracking"}
        body["train"] = {
            k: v for k, v in dict(body.get("train") or {}).items() if f"train.{k}" not in RESUMABLE_OVERRIDES
        }
        body["data"] = {
            k: v for k, v in dict(body.get("data") or {}).items() if f"data.{k}" not in RESUMABLE_OVERRIDES
        }
        return canonical_json(body)

    return fixed(a) == fixed(b)


def resume_config(stored: Mapping[str, Any], overrides: Mapping[str, Any]) -> RunConfig:
    """Rebuild a stored run's config; only rounds, checkpointing, device and tracking may change.

    Raises:
        ConfigError: when an override would change the results of the resumed run.
    """
    changing = sorted(k for k, v in overrides.items() if v is not None and k not in RESUMABLE_OVERRIDES)
    if changing:
        raise ConfigError(
            f"--resume continues a run with its stored config; {', '.join(changing)} cannot "
            "change. Start a new run instead, or drop those options."
        )
    doc = {k: dict(v) if isinstance(v, Mapping) else v for k, v in stored.items()}
    hp = {
        **HP_ADDED.get(str(doc["algorithm"].get("name", AlgorithmConfig.name)), {}),
        **dict(doc["algorithm"].pop("hp", {}) or {}),
    }
    return build_config(doc=doc, overrides=overrides, hp=hp)
