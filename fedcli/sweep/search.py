"""Search instead of a grid: a sweep spec's `search:` and `pruner:` blocks, run with Optuna (docs/sweeps.md).

    search: {sampler: tpe, trials: 50, metric: accuracy, direction: max, seed: 0,
             space: {client_lr: {log_uniform: [1e-3, 1]}, hp.rho: [0.01, 0.1, 1], local_epochs: {int: [1, 5]}}}
    pruner: {type: median, warmup: 5}

- `SearchBlock`, `PrunerBlock` (fedcli/sweep/spec_keys.py): the blocks declared and checked whole before
  anything runs (ConfigError: exit 2, one line).
- here: the study's name, sampler, pruner and storage (the store's own SQL database), a sampled
  config as a trial (`trial_of`, `suggest_params`) and the space's checks (`check_space_configs`,
  `unnamed_code`).
- `SearchSource` (fedcli/sweep/search_source.py): the trial source the sweep's `Scheduler` consumes
  (the interface of docs/sweeps.md, "How a search runs"): `ask()` the next trial as a `Plan`,
  `tell(plan, outcome)` its end.
- `make_on_eval(spec)`: the per-round pruning hook a trial's training calls at evaluation rounds
  (fedcli.engine.train `on_eval`): it reports the metric to the study and says whether to stop.

Optuna is imported lazily (`pip install 'fedcli[search]'`); a spec without `search:` never imports it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from fedcli.config.build import build_config
from fedcli.config.checks import NAME_MAX_BYTES
from fedcli.errors import ConfigError
from fedcli.sweep.spec import Trial, check_hp_keys, dotted_key, has_hp, short_keys


def study_name(experiment: str) -> str:
    return f"fedcli:{experiment}"


def make_pruner(block: Mapping[str, Any] | None) -> Any:
    """The Optuna pruner of a `pruner:` block (None: never prune). A step is a round. `warmup` W: the
    first W rounds of a trial are never pruned (the median pruner's n_warmup_steps = W + 1: Optuna
    prunes a step >= n_warmup_steps); successive halving and hyperband take it as their minimum
    resource (rounds a trial runs before its first rung)."""
    import optuna

    if not block:
        return optuna.pruners.NopPruner()
    kind, warmup = block["type"], block.get("warmup")
    if kind == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=block.get("startup_trials", 5),
            n_warmup_steps=(warmup or 0) + 1,
            interval_steps=block.get("interval", 1),
        )
    if kind == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=warmup or "auto",
            reduction_factor=block.get("reduction_factor", 4),
            min_early_stopping_rate=block.get("min_early_stopping_rate", 0),
        )
    return optuna.pruners.HyperbandPruner(
        min_resource=warmup or 1, reduction_factor=block.get("reduction_factor", 3)
    )


def make_sampler(search: Mapping[str, Any], seed: int | None) -> Any:
    import optuna

    kind = search.get("sampler", "tpe")
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if kind == "grid":
        return optuna.samplers.GridSampler({k: list(v) for k, v in search["space"].items()}, seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def storage(url: str) -> Any:
    """Optuna's RDBStorage on the store's own database (SQLite waits for the write lock like the store);
    `url` with its password (`connect_url`)."""
    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    for attempt in range(
        20
    ):  # sweeps started together race to create Optuna's tables: the loser sees them made
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
        except SQLAlchemyError as err:
            text = str(err).lower()
            if attempt == 19 or not any(w in text for w in ("already exists", "duplicate", "unique")):
                raise
            time.sleep(0.1 + 0.05 * attempt)
    raise AssertionError("unreachable")


def search_metric(search: Mapping[str, Any], spec: Mapping[str, Any]) -> str:
    from fedcli.tracking.report.model import resolve_metric

    return resolve_metric(search.get("metric") or (spec.get("report") or {}).get("metric") or "accuracy")


def suggest_params(trial: Any, space: Mapping[str, Any]) -> dict[str, Any]:
    """Draw one value per space key from an Optuna trial (the key is the parameter name)."""
    params = {}
    for key, value in space.items():
        if isinstance(value, list):
            params[key] = trial.suggest_categorical(key, value)
            continue
        kind, (low, high) = next(iter(value.items()))
        if kind == "int":
            params[key] = trial.suggest_int(key, low, high)
        else:
            params[key] = trial.suggest_float(key, float(low), float(high), log=kind == "log_uniform")
    return params


def trial_of(
    spec: Mapping[str, Any], params: Mapping[str, Any], number: int, tracking: Mapping[str, Any] | None = None
) -> Trial:
    """The fedcli trial (name `#3 client_lr=0.0123 rho=0.1 s0`, validated RunConfig) of sampled params."""
    aliases = short_keys()
    values = {dotted_key(k, aliases): v for k, v in (spec.get("base") or {}).items()}
    values.update({dotted_key(k, aliases): v for k, v in params.items()})
    algo = values.get("algorithm.name", "fedavg")
    hp = {k[3:]: v for k, v in values.items() if k.startswith("hp.") and has_hp(algo, k[3:])}
    overrides = {k: v for k, v in values.items() if not k.startswith("hp.")}
    seed = spec.get("seeds", [0])[0]
    cfg = build_config(
        overrides={**overrides, **(tracking or {}), "seed": seed, "tracking.experiment": spec["experiment"]},
        hp=hp,
    )
    shown = " ".join(
        f"{k.split('.')[-1]}={v:.4g}" if isinstance(v, float) else f"{k.split('.')[-1]}={v}"
        for k, v in params.items()
        if not k.startswith("hp.") or k[3:] in hp
    )
    name = f"#{number} {cfg.algorithm.name} {shown} s{seed}".replace("  ", " ")
    return Trial(name=name[:NAME_MAX_BYTES], config=cfg)


CODE_KEYS = {
    "data.model": "model",
    "data.file": "data function",
}  # config keys whose value may name user code


def unnamed_code(spec: Mapping[str, Any], params: Mapping[str, Any]) -> str | None:
    """`key=value` of the first trial parameter that names user code (a model or data function reference)
    the spec's `base` or search space does not name, or None. An Optuna trial's parameters come from the
    study in the store, which anyone who can write the store can fill: a sweep adopts only trials whose
    code its spec names (docs/operations.md, "Security"). Nothing is imported here."""
    from fedcli.datasets.yours.data import is_data_ref
    from fedcli.datasets.yours.model import is_reference

    aliases = short_keys()

    def dotted(key: str) -> str | None:
        try:
            return dotted_key(key, aliases)
        except ConfigError:
            return None

    named: set[str] = set()
    for key, value in {**(spec.get("base") or {}), **spec["search"]["space"]}.items():
        if dotted(key) in CODE_KEYS:
            named.update(_canonical(str(v)) for v in (value if isinstance(value, list) else [value]))
    for key, value in params.items():
        what = CODE_KEYS.get(dotted(key) or "")
        if what is None or not isinstance(value, str):
            continue
        code = (
            is_reference(value) if what == "model" else is_data_ref(value) and not value.startswith("python:")
        )
        if code and _canonical(value) not in named:
            return f"{key}={value}"
    return None


def _canonical(value: str) -> str:
    """A model or data reference with its file path made absolute (as a run records it); nothing imported."""
    source, sep, attr = value.rpartition(":")
    if sep and source.endswith(".py"):
        return f"{os.path.abspath(os.path.expanduser(source))}:{attr}"
    return value


def check_space_configs(spec: Mapping[str, Any], tracking: Mapping[str, Any] | None = None) -> None:
    """Build the configs at the space's corners (every low, every high, each choice) so that a bad key or a
    value out of a config key's range fails before anything runs."""
    space = spec["search"]["space"]
    aliases = short_keys()
    check_hp_keys(
        {dotted_key(k, aliases): v for k, v in (spec.get("base") or {}).items()},
        {dotted_key(k, aliases): v if isinstance(v, list) else [] for k, v in space.items()},
        [{}],
    )
    lows = {k: v[0] if isinstance(v, list) else next(iter(v.values()))[0] for k, v in space.items()}
    highs = {k: v[-1] if isinstance(v, list) else next(iter(v.values()))[1] for k, v in space.items()}
    trial_of(spec, lows, 0, tracking)
    trial_of(spec, highs, 0, tracking)
    for key, value in space.items():
        for choice in value if isinstance(value, list) else []:
            trial_of(spec, {**lows, key: choice}, 0, tracking)


def make_on_eval(spec: Mapping[str, Any]) -> Callable[[int, dict[str, float]], bool]:
    """The pruning hook of one trial (spec from `SearchSource.hook`): at each evaluation round it reports
    the metric as the trial's intermediate value at step = round and returns True when the pruner stops it."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(
        study_name=spec["study"], storage=storage(spec["storage"]), pruner=make_pruner(spec.get("pruner"))
    )
    trial = optuna.trial.Trial(study, spec["trial_id"])
    metric = spec["metric"]

    def on_eval(round_idx: int, metrics: dict[str, float]) -> bool:
        value = metrics.get(metric)
        if value is None or not math.isfinite(value):
            return False
        try:
            trial.report(float(value), round_idx)
            return bool(trial.should_prune())
        except Exception as err:  # noqa: BLE001 - the study unreachable a moment: the trial trains on, unpruned
            logging.getLogger(__name__).warning(
                "pruning: could not report round %d to the study (%s); the trial goes on",
                round_idx,
                type(err).__name__,
            )  # no text: it may hold a URL
            return False

    return on_eval
