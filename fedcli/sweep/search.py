"""Search instead of a grid: a sweep spec's `search:` and `pruner:` blocks, run with Optuna (docs/sweeps.md).

    search: {sampler: tpe, trials: 50, metric: accuracy, direction: max, seed: 0,
             space: {client_lr: {log_uniform: [1e-3, 1]}, hp.rho: [0.01, 0.1, 1], local_epochs: {int: [1, 5]}}}
    pruner: {type: median, warmup: 5}

- `check_search(spec)`: the blocks checked whole before anything runs (ConfigError: exit 2, one line).
- `SearchSource`: the trial source the sweep's `Scheduler` consumes (the interface of docs/sweeps.md,
  "How a search runs"): `ask()` the next trial as a `Plan` (a complete fedcli run: own id, config
  hash, claim), `tell(plan, outcome)` its end. The study lives in the store's own SQL database
  (Optuna's RDBStorage on the store URL, study `fedcli:<experiment>`), so a search resumes after a
  kill (a trial left RUNNING by a dead sweep is adopted: its run resumed, or started) and several
  sweep processes share one study (each trial claimed in the store before it runs).
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
from typing import Any, Literal

from fedcli.config.build import build_config
from fedcli.config.checks import NAME_MAX_BYTES
from fedcli.errors import ConfigError
from fedcli.sweep.plan import DIVERGED, NEW, RESUME, SKIP, Plan, plan_trials
from fedcli.sweep.search_spec import budget, check_search  # noqa: F401 - re-exported
from fedcli.sweep.spec import Trial, _dotted, _has_hp, check_hp_keys, short_keys
from fedcli.tracking.urls import connect_url

TRIAL_TAG, STUDY_TAG = "fedcli.search_trial", "fedcli.search_study"
POLL_S = 1.0  # how often a source with nothing to hand out looks at the study again
ORPHAN_S = 60.0  # a RUNNING Optuna trial with no fedcli config this old was asked by a sweep that died


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


def _metric(search: Mapping[str, Any], spec: Mapping[str, Any]) -> str:
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
    values = {_dotted(k, aliases): v for k, v in (spec.get("base") or {}).items()}
    values.update({_dotted(k, aliases): v for k, v in params.items()})
    algo = values.get("algorithm.name", "fedavg")
    hp = {k[3:]: v for k, v in values.items() if k.startswith("hp.") and _has_hp(algo, k[3:])}
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
    code its spec names (docs/architecture.md, "Security"). Nothing is imported here."""
    from fedcli.datasets.yours.data import is_data_ref
    from fedcli.datasets.yours.model import is_reference

    aliases = short_keys()

    def dotted(key: str) -> str | None:
        try:
            return _dotted(key, aliases)
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
        {_dotted(k, aliases): v for k, v in (spec.get("base") or {}).items()},
        {_dotted(k, aliases): v if isinstance(v, list) else [] for k, v in space.items()},
        [{}],
    )
    lows = {k: v[0] if isinstance(v, list) else next(iter(v.values()))[0] for k, v in space.items()}
    highs = {k: v[-1] if isinstance(v, list) else next(iter(v.values()))[1] for k, v in space.items()}
    trial_of(spec, lows, 0, tracking)
    trial_of(spec, highs, 0, tracking)
    for key, value in space.items():
        for choice in value if isinstance(value, list) else []:
            trial_of(spec, {**lows, key: choice}, 0, tracking)


class SearchSource:
    """The trials of a `search:` sweep, asked of an Optuna study in the store's database.

    `ask()` first adopts a trial a dead sweep left RUNNING (its run is resumed, or started), then asks
    the study for a new one while the budget (`search.trials`) lasts; a sampled config that a run
    already holds (the same config hash) is told that run's result at once, without training.
    `tell(plan, outcome)` records a finished (its final `metric`), pruned or failed trial; an
    interrupted one stays RUNNING for the next sweep. `hook(plan)` is the pruning hook's spec.
    """

    def __init__(
        self, spec: Mapping[str, Any], tracking: Mapping[str, Any], db: Any, *, create: bool = True
    ) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.spec, self.search, self.tracking, self.db = spec, spec["search"], dict(tracking), db
        self.metric = _metric(self.search, spec)
        self.maximize = self.search.get("direction", "max") == "max"
        self.budget = budget(self.search)
        self.experiment = spec["experiment"]
        self.storage = storage(connect_url(db))
        name = study_name(self.experiment)
        direction: Literal["maximize", "minimize"] = "maximize" if self.maximize else "minimize"
        try:
            existing = optuna.load_study(study_name=name, storage=self.storage)
        except KeyError:
            existing = None
        if existing is not None and existing.direction.name.lower() != direction:
            raise ConfigError(
                f"study {name} was started with direction {existing.direction.name.lower()[:3]}; "
                f"got search.direction {self.search.get('direction', 'max')}. Keep the direction, or "
                "use a new experiment name."
            )
        self.seed = self.search.get("seed", 0)
        self.study = optuna.create_study(
            study_name=name,
            storage=self.storage,
            direction=direction,
            sampler=make_sampler(self.search, self.seed),
            pruner=make_pruner(spec.get("pruner")),
            load_if_exists=True,
        )
        self.study.set_user_attr("fedcli.metric", self.metric)
        self.in_flight: dict[str, int] = {}  # config hash -> Optuna trial number, trials this process runs
        self._ids: dict[int, int] = {}  # trial number -> trial id
        self._exhausted: tuple[float, bool] | None = None  # (when read, the answer)
        self.adopted: set[int] = set()  # trial numbers adopted from a dead sweep (not asked here)
        from fedcli.tracking.store.common import HOSTNAME

        self._owner = f"{HOSTNAME}:{os.getpid()}"  # user attribute fedcli.owner: who runs a RUNNING trial
        self._idle_until = 0.0  # after an ask that found nothing: the next look at the study

    # ------------------------------------------------------------------ the study's state
    def _trials(self) -> list[Any]:
        return self.study.get_trials(deepcopy=False)

    def used(self) -> int:
        """Trials that count against the budget: all but those a duplicate or an overrun ended, and those
        enqueued by hand (`study.enqueue_trial`, WAITING) which the next asks take first."""
        import optuna

        return sum(
            1
            for t in self._trials()
            if "fedcli.void" not in t.user_attrs and t.state != optuna.trial.TrialState.WAITING
        )

    @property
    def exhausted(self) -> bool:
        """True once the budget is spent and no dead sweep's trial is left to adopt (read at most once a
        second: the scheduler asks every step)."""
        now = time.monotonic()
        if self._exhausted is None or now - self._exhausted[0] >= POLL_S:
            self._exhausted = (now, self.used() >= self.budget and not self._orphans())
        return self._exhausted[1]

    def _orphans(self) -> list[Any]:
        """RUNNING trials with a config that no live process runs (their sweep died): adopt them."""
        import optuna

        running = [
            t
            for t in self._trials()
            if t.state == optuna.trial.TrialState.RUNNING and t.number not in self.in_flight.values()
        ]
        if not running:
            return []
        from fedcli.tracking.store.common import HOSTNAME
        from fedcli.tracking.store.liveness import _pid_alive

        claims = self.db.live_claims(self.experiment)
        alive = {r.tags.get("fedcli.config_hash") or r.config_hash for r in self._runs() if r.is_alive}
        out = []
        for t in running:
            key, owner = t.user_attrs.get("fedcli.config_hash"), str(t.user_attrs.get("fedcli.owner", ":"))
            old = t.datetime_start is not None and time.time() - t.datetime_start.timestamp() > ORPHAN_S
            host, _, pid = owner.rpartition(":")
            if key is None:
                if old:
                    self._void(t.number, "asked by a sweep that ended before it built the trial")
                continue
            if key in claims or key in alive:
                continue
            # the sweep that asked (or adopted) it: on this host, gone; elsewhere, no claim nor run for ORPHAN_S
            if not _pid_alive(int(pid)) if host == HOSTNAME and pid.isdigit() else old:
                out.append(t)
        return out

    def _runs(self) -> list[Any]:
        from fedcli.sweep.rows import experiment_runs

        return experiment_runs(self.db, self.experiment)

    def _set_attr(self, number: int, key: str, value: Any) -> bool:
        """Set a user attribute of a trial; False when it ended meanwhile (another sweep told it)."""
        import optuna

        try:
            self.study._storage.set_trial_user_attr(self._trial_id(number), key, value)
        except optuna.exceptions.UpdateFinishedTrialError:
            return False
        return True

    def _void(self, number: int, why: str) -> None:
        import optuna

        if self._set_attr(number, "fedcli.void", why):
            self.study.tell(number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)

    def _trial_id(self, number: int) -> int:
        if number not in self._ids:
            self._ids[number] = self.study._storage.get_trial_id_from_study_id_trial_number(
                self.study._study_id, number
            )
        return self._ids[number]

    # ------------------------------------------------------------------ the trial source
    def ask(self) -> Plan | None:
        """The next trial to run now, or None (budget spent, or only trials other sweeps run)."""
        if time.monotonic() < self._idle_until:
            return None
        plan = self._ask()
        self._idle_until = 0.0 if plan is not None else time.monotonic() + POLL_S
        return plan

    def _ask(self) -> Plan | None:
        for orphan in self._orphans():
            unnamed = unnamed_code(self.spec, orphan.params)
            if (
                unnamed is not None
            ):  # a trial the spec could not have asked: its code is not the user's to run
                logging.getLogger(__name__).warning(
                    "trial #%d of study %s is not adopted: its parameter %s names code the sweep's spec does not "
                    "name (datasets/yours/trust.py)",
                    orphan.number,
                    study_name(self.experiment),
                    unnamed,
                )
                self._void(
                    orphan.number, f"its parameter {unnamed} names code the sweep's spec does not name"
                )
                continue
            self._set_attr(orphan.number, "fedcli.owner", self._owner)
            plan = self._plan(trial_of(self.spec, orphan.params, orphan.number, self.tracking), orphan.number)
            if plan is not None:
                self.adopted.add(orphan.number)
                return plan
        self._drop_lost()
        while self.used() < self.budget:
            # the sampler's seed for this draw: the search's seed and the trials so far, so one process drawing from
            # start to end is reproducible, and a rerun or a second sweep process does not repeat earlier draws
            self.study.sampler = make_sampler(
                self.search, (self.seed * 1_000_003 + len(self._trials()) * 7919) % 2**31
            )
            trial = self.study.ask()
            if trial.number >= self.budget + 1000:  # a space whose every config runs now: try again later
                self._void(trial.number, "over budget")
                return None
            if self.used() > self.budget:  # another sweep asked the last trial at the same time
                self._void(trial.number, "over budget (asked together with another sweep)")
                return None
            params = suggest_params(trial, self.search["space"])
            unnamed = unnamed_code(
                self.spec, params
            )  # a trial enqueued by hand may fix a value outside the space
            if unnamed is not None:
                self._void(trial.number, f"its parameter {unnamed} names code the sweep's spec does not name")
                continue
            built = trial_of(self.spec, params, trial.number, self.tracking)
            trial.set_user_attr("fedcli.owner", self._owner)
            trial.set_user_attr("fedcli.config_hash", built.config.config_hash)
            trial.set_user_attr("fedcli.run_name", built.name)
            plan = self._plan(built, trial.number)
            if plan is not None:
                return plan
        return None

    def _drop_lost(self) -> None:
        """Trials this process asked whose config another sweep process claimed first (the scheduler then
        planned them "running elsewhere"): not ours to end; voided, that process runs the config."""
        from fedcli.tracking.store.common import HOSTNAME

        claims = self.db.live_claims(self.experiment)
        for key, number in list(self.in_flight.items()):
            claim = claims.get(key)
            if claim is not None and (claim.host, claim.pid) != (HOSTNAME, os.getpid()):
                del self.in_flight[key]
                if (
                    number in self.adopted
                ):  # another sweep adopted the same dead sweep's trial first: its trial now
                    self.adopted.discard(number)
                else:  # a config this process drew that another process runs as its own trial
                    self._void(number, f"its config was {claim}")

    def _plan(self, trial: Trial, number: int) -> Plan | None:
        """Plan an asked or adopted trial against the store's runs; a config already run is told its result."""
        if self.in_flight.get(trial.config.config_hash, number) != number:  # the same config runs here now
            self._void(number, f"its config runs now as trial #{self.in_flight[trial.config.config_hash]}")
            return None
        plan = plan_trials([trial], self._runs())[0]
        if plan.action == NEW and trial.config.config_hash in self.db.live_claims(self.experiment):
            self._void(number, "its config is claimed by another sweep process")  # about to run there
            return None
        if plan.action in (NEW, RESUME):
            self.in_flight[trial.config.config_hash] = number
            self._ids.setdefault(number, self._trial_id(number))
            return plan
        if (
            plan.action == SKIP and plan.run_id is not None
        ):  # the same config ran before: its result, no training
            record = self.db.get_run(plan.run_id)
            self._tell_run(number, record.status, plan.run_id)
            return None
        if plan.action == DIVERGED and plan.run_id is not None:  # the same config diverges again: a failure
            self._tell_run(number, "failed", plan.run_id)
            return None
        self._void(number, f"duplicate of a trial {plan.action} ({plan.note})")  # running now: not counted
        return None

    def hook(self, plan: Plan) -> dict[str, Any] | None:
        """The pruning hook's spec for `make_on_eval` (holds the store URL: keep it in memory and pipes)."""
        number = self.in_flight.get(plan.trial.config.config_hash)
        if number is None:
            return None
        return {
            "storage": connect_url(self.db),
            "study": study_name(self.experiment),
            "trial_id": self._trial_id(number),
            "number": number,
            "metric": self.metric,
            "pruner": dict(self.spec.get("pruner") or {}),
        }

    def tell(self, plan: Plan, outcome: Any) -> None:
        """A trial ended: finished -> its final metric, pruned -> PRUNED, failed -> FAIL; interrupted or
        run elsewhere: left RUNNING (the next sweep, or the one that runs it, ends it)."""
        self._idle_until, self._exhausted = 0.0, None  # a slot is free: look at the study again now
        number = self.in_flight.pop(plan.trial.config.config_hash, None)
        status, run_id = getattr(outcome, "status", None), getattr(outcome, "run_id", None)
        if number is None or status not in ("finished", "pruned", "failed"):
            return
        if (
            run_id is None
        ):  # a trial process that ended before the scheduler learnt its run: the store knows it
            runs = [
                r
                for r in self._runs()
                if (r.tags.get("fedcli.config_hash") or r.config_hash) == plan.trial.config.config_hash
            ]
            run_id, status = (runs[-1].id, runs[-1].status) if runs else (None, status)
        if run_id is not None:
            self._tell_run(number, status, run_id)
        else:
            self._void(number, getattr(outcome, "reason", "") or "failed before its run started")

    def _tell_run(self, number: int, status: str, run_id: str) -> None:
        import optuna

        if not self._set_attr(number, "fedcli.run_id", run_id):
            return  # told already (by the sweep that ran it)
        self.db.set_tags(run_id, {STUDY_TAG: study_name(self.experiment), TRIAL_TAG: str(number)})
        if status == "pruned":
            self.study.tell(number, state=optuna.trial.TrialState.PRUNED, skip_if_finished=True)
            return
        value = final_value(self.db, run_id, self.metric) if status == "finished" else None
        if value is None:
            self.study.tell(number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        else:
            self.study.tell(number, value, skip_if_finished=True)


def final_value(db: Any, run_id: str, metric: str) -> float | None:
    """The run's `metric` at its last logged round (None when it never logged it)."""
    frame = db.metrics_frame([run_id], [metric])
    if frame.empty:
        return None
    return float(frame.sort_values("round_idx")["value"].iloc[-1])


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
