"""Sweeps: expand a grid (algorithms x hyperparameters x seeds) into run configs and run them.

A sweep spec (YAML, docs/architecture.md §9)::

    experiment: femnist-fedpa-vs-fedavg
    base: {task: femnist, rounds: 200, clients_per_round: 10, local_epochs: 5}
    grid: {algo: [fedavg, fedpa], hp.rho: [0.01, 0.1]}
    seeds: [0, 1, 2]
    report: {metric: accuracy, thresholds: [0.7, 0.8], at: [100, 200]}

Keys are config keys: dotted (`train.rounds`), short (`rounds`, `task`, `algo`, the last part
of a dotted key when unambiguous) or `hp.<name>` for algorithm hyperparameters. A grid
value applies only to algorithms that have that hyperparameter (so `hp.rho` does not
multiply FedAvg's runs).

A sweep owns its trials:

- `plan_trials` matches each trial to the experiment's runs with the same config hash: a
  finished run is skipped, a live one (another process trains it) is never started again,
  an interrupted or failed run is resumed from its newest checkpoint with
  `fedcli train --resume` (a diverged one is not: it would diverge again), and only a trial
  without a run starts a new one. Rerunning the same command therefore continues a sweep.
- `TrialClaims`: right before a trial starts, the sweep claims it in the store
  (`SqlStore.claim_trial`: one row per (experiment, config hash), taken atomically) and plans
  it again; a trial claimed by another live sweep reads "running elsewhere" and is left to
  it, so two sweeps of one spec split the trials between them. The claim is released when
  the trial's process ends; one whose sweep died is taken over.
- `Scheduler` starts the trials from the main thread as child processes in the sweep's
  process group, each with PR_SET_PDEATHSIG=SIGTERM (Linux), so a SIGKILLed sweep still
  stops its trials in order (they checkpoint and read as `interrupted`). SIGTERM, SIGINT
  and SIGHUP to the sweep are forwarded to its running trials as SIGTERM; it waits for
  them to checkpoint and exit, starts nothing new, and reports the signal.
- `parent_run` makes the sweep one MLflow parent run (tags `fedcli.sweep`,
  `fedcli.sweep_spec_hash`) whose trials are nested children; a rerun reuses it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from fedcli.config import (
    NAME_MAX_BYTES,
    SECTIONS,
    AlgorithmConfig,
    RunConfig,
    build_config,
    read_yaml,
    suggest,
)
from fedcli.errors import ConfigError
from fedcli.tracking.urls import has_password, mask_url

if TYPE_CHECKING:
    from fedcli.tracking.mlflow_sink import MlflowSink
    from fedcli.tracking.store import Claim, RunRecord

SPEC_KEYS = ("experiment", "base", "grid", "variants", "seeds", "report", "description", "paper", "smoke", "study",
             "max_trials")
REPORT_KEYS = ("metric", "thresholds", "at", "window", "smooth", "group_by", "output", "columns")  # `fedcli report` options
MAX_TRIALS = 1000  # trials a spec may expand to unless it says `max_trials: N` (checked before expanding)

@dataclass(frozen=True)
class Trial:
    """One run of a sweep: a readable name (`fedpa rho=0.1 s0`, also its run name) and its config."""

    name: str
    config: RunConfig


def short_keys() -> dict[str, str]:
    """Map unambiguous short names (`rounds`, `task`) to dotted config keys."""
    names: dict[str, list[str]] = {}
    for section, cls in SECTIONS.items():
        for item in dataclasses.fields(cls):
            names.setdefault(item.name, []).append(f"{section}.{item.name}")
    out = {name: dotted[0] for name, dotted in names.items() if len(dotted) == 1}
    out.update({"algo": "algorithm.name", "model": "data.model", "scheme": "partition.scheme",
                "clients": "partition.num_clients", "alpha": "partition.alpha"})
    return out


def load_spec(path: Path | None, recipe: str | None, *, smoke: bool = False) -> dict[str, Any]:
    """Read a spec file or a built-in recipe (fedcli.recipes); check its top-level keys.

    `smoke` applies the spec's `smoke:` overrides (fedcli.recipes.smoke_spec).
    """
    from fedcli import recipes

    if recipe is not None:
        try:
            spec = recipes.read_recipe(recipe)
        except KeyError:
            raise ConfigError(f"unknown recipe {recipe!r}{suggest(recipe, recipes.recipe_names())}; "
                              "`fedcli sweep --list-recipes` lists them.") from None
    elif path is not None:
        spec = read_yaml(path)
    else:
        raise ConfigError("fedcli sweep needs a SPEC.yaml or --recipe NAME.")
    if not isinstance(spec, Mapping):
        raise ConfigError(f"a sweep spec must be a mapping of {', '.join(SPEC_KEYS)}; got {type(spec).__name__}.")
    for key in spec:
        if key not in SPEC_KEYS:
            raise ConfigError(f"unknown sweep key {key!r}{suggest(key, list(SPEC_KEYS))}; valid: {', '.join(SPEC_KEYS)}.")
    if "experiment" not in spec:
        raise ConfigError("a sweep spec needs `experiment: NAME`.")
    if spec.get("smoke") is not None and not isinstance(spec["smoke"], Mapping):
        raise ConfigError(f"smoke must be a mapping such as {{base: {{rounds: 2}}, seeds: [0]}}; got {spec['smoke']!r}.")
    if smoke:
        if not spec.get("smoke") and not spec.get("study"):
            raise ConfigError("--smoke needs a spec with a `smoke:` block (e.g. {base: {rounds: 2}, seeds: [0]}).")
        spec = recipes.smoke_spec(spec)
    check_spec_values(spec)
    variants = spec.get("variants")
    if variants is not None and not (isinstance(variants, list) and all(isinstance(v, Mapping) for v in variants)):
        raise ConfigError("variants must be a list of mappings such as [{label: FedAvg-1E, algo: fedavg, "
                          f"local_epochs: 1}}]; got {variants!r}.")
    report = spec.get("report")
    if report is not None and not isinstance(report, Mapping):
        raise ConfigError(f"report must be a mapping such as {{metric: accuracy, thresholds: [0.8]}}; got {report!r}.")
    for key in report or {}:
        if key not in REPORT_KEYS:
            raise ConfigError(f"unknown report key {key!r}{suggest(key, list(REPORT_KEYS))}; "
                              f"valid: {', '.join(REPORT_KEYS)}.")
    check_report_values(report or {})
    return spec


def check_spec_values(spec: Mapping[str, Any]) -> None:
    """The type of every top-level value (a spec is data, not code: nothing is coerced)."""
    from fedcli.config import INT_MAX, check_name

    if not isinstance(spec["experiment"], str):
        raise ConfigError(f"experiment must be a name (text); got {spec['experiment']!r}.")
    check_name("experiment", spec["experiment"], "`experiment:`")
    for key in ("base", "grid"):
        if spec.get(key) is not None and not isinstance(spec[key], Mapping):
            example = "{task: lsq, rounds: 20}" if key == "base" else "{algo: [fedavg, fedprox], hp.mu: [0.01, 0.1]}"
            raise ConfigError(f"{key} must be a mapping of config keys to values such as {example}; got {spec[key]!r}.")
    for key, values in (spec.get("grid") or {}).items():
        if isinstance(values, list) and not values:
            raise ConfigError(f"grid key {key} must have at least one value; got []. Give its values, or drop it.")
        if isinstance(values, Mapping):
            raise ConfigError(f"grid key {key} must be a list of values such as [0.01, 0.1]; got {values!r}.")
    seeds = spec.get("seeds", [0])
    if not (isinstance(seeds, list) and seeds and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
        raise ConfigError(f"seeds must be a non-empty list of integer seeds such as [0, 1, 2]; got {seeds!r}.")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds must not repeat a seed (a repeated seed is the same run); got {seeds!r}.")
    for key in ("description", "paper", "study"):
        if spec.get(key) is not None and not isinstance(spec[key], str):
            raise ConfigError(f"{key} must be text; got {spec[key]!r}.")
    limit = spec.get("max_trials", MAX_TRIALS)
    if not (isinstance(limit, int) and not isinstance(limit, bool) and 1 <= limit <= INT_MAX):
        raise ConfigError(f"max_trials must be an integer >= 1; got {limit!r}.")


def check_report_values(block: Mapping[str, Any]) -> None:
    """The values of a spec's `report:` block, as `fedcli report` checks its options (before any trial runs)."""
    def fail(key: str, what: str) -> ConfigError:
        return ConfigError(f"report.{key} must be {what}; got {block[key]!r}.")

    def numbers(key: str, kind: type) -> None:
        values = block.get(key)
        if values is None:
            return
        if not isinstance(values, list) or not values:
            raise fail(key, f"a list of {'round numbers' if kind is int else 'numbers'} such as "
                            f"{'[100, 200]' if kind is int else '[0.7, 0.8]'}")
        for value in values:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if kind is int:
                ok = ok and isinstance(value, int) and value >= 1
            if not ok or not math.isfinite(value):
                raise fail(key, "finite numbers" if kind is float else "round numbers >= 1")

    for key in ("metric", "output"):
        if key in block and not (isinstance(block[key], str) and block[key].strip()):
            raise fail(key, "a metric name such as accuracy or eval/loss" if key == "metric" else "a file path")
    numbers("thresholds", float)
    numbers("at", int)
    for key in ("window", "smooth"):
        value = block.get(key)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise fail(key, "an integer number of rounds >= 1")
    group_by = block.get("group_by")
    if group_by is not None and not (isinstance(group_by, str) and group_by.strip(" ,")
                                     or isinstance(group_by, list) and group_by
                                     and all(isinstance(k, str) and k.strip() for k in group_by)):
        raise fail("group_by", "config keys such as \"algo,hp.rho\" or [algo, hp.rho]")
    columns = block.get("columns")
    if columns is not None and not (isinstance(columns, list) and columns
                                    and all(isinstance(k, str) and k.strip() for k in columns)):
        raise fail("columns", "a list of logged metric keys such as [fedsparse/sparsity]")


def check_report_keys(block: Mapping[str, Any], trials: Sequence[Trial]) -> None:
    """What can be known of a `report:` block before the trials run: its group-by keys name config
    keys of the trials, and an `eval/` metric is one the trials' tasks log (classification:
    accuracy, loss; regression and LSA: loss, dist_to_opt; other kinds are checked by the report)."""
    from fedcli.datasets.registry import TASKS
    from fedcli.tracking.keys import flatten_config
    from fedcli.tracking.report import resolve_key, resolve_metric

    group_by = block.get("group_by")
    if group_by is not None:
        known = sorted({k for t in trials for k in flatten_config({k: v for k, v in t.config.to_dict().items()
                                                                    if k != "tracking"})})
        for key in group_by.split(",") if isinstance(group_by, str) else group_by:
            if key.strip():
                resolve_key(key.strip(), known)
    metric = block.get("metric")
    if not metric:
        return
    name = resolve_metric(metric)
    kinds = {TASKS[t.config.data.task].kind if t.config.data.file is None else "byo" for t in trials}
    logged = {"classification": {"eval/loss", "eval/accuracy", "eval/dist_to_opt"},
              "regression": {"eval/loss", "eval/dist_to_opt"}, "lsa": {"eval/loss", "eval/dist_to_opt"}}
    if name.startswith("eval/") and kinds <= set(logged) and not any(name in logged[k] for k in kinds):
        possible = sorted(set().union(*(logged[k] for k in kinds)))
        raise ConfigError(f"report.metric {metric!r} is not logged by the sweep's tasks ({', '.join(sorted(kinds))}); "
                          f"they log {', '.join(possible)}. Pick one of those.")


def expand(spec: Mapping[str, Any], tracking: Mapping[str, Any] | None = None) -> list[Trial]:
    """Return the validated trials of a spec, in variant order, then grid order, then seed order.

    Each of `variants` (named overrides, e.g. FedPA's FedAvg-1E / FedAvg-ME / FedPA-ME) is crossed
    with the grid and the seeds; a variant's keys win over the grid's, the grid's over `base`.
    """
    aliases = short_keys()
    base = {_dotted(k, aliases): v for k, v in (spec.get("base") or {}).items()}
    grid = {_dotted(k, aliases): v if isinstance(v, list) else [v] for k, v in (spec.get("grid") or {}).items()}
    short = {_dotted(k, aliases): k for k in (spec.get("grid") or {})}  # the names the user wrote, for labels
    seeds = spec.get("seeds", [0])
    variants = [(v.get("label"), {_dotted(k, aliases): x for k, x in v.items() if k != "label"})
                for v in spec.get("variants") or [{}]]
    count = len(variants) * math.prod(len(values) for values in grid.values()) * len(seeds)
    limit = spec.get("max_trials", MAX_TRIALS)
    if count > limit:  # before any config is built: a huge grid is refused by its size, in no time
        sizes = " x ".join(str(n) for n in (len(variants), *(len(v) for v in grid.values()), len(seeds)))
        raise ConfigError(f"the sweep spec expands to {count:,} trials (variants x grid values x seeds: {sizes}), more "
                          f"than max_trials = {limit}; shrink the grid, or raise the limit with `max_trials: {count}` "
                          "in the spec.")
    check_hp_keys(base, grid, [v for _, v in variants])
    trials, seen = [], set()
    for (label, variant), combo in itertools.product(variants, itertools.product(*grid.values())):
        values = {**base, **dict(zip(grid, combo, strict=True)), **variant}
        algo = values.get("algorithm.name", "fedavg")
        hp = {k[3:]: v for k, v in values.items() if k.startswith("hp.") and _has_hp(algo, k[3:])}
        overrides = {k: v for k, v in values.items() if not k.startswith("hp.")}
        for seed in seeds:
            cfg = build_config(overrides={**overrides, **(tracking or {}), "seed": seed,
                                          "tracking.experiment": spec["experiment"]}, hp=hp)
            if cfg.config_hash in seen:
                continue
            seen.add(cfg.config_hash)
            shown = [(short[k], v) for k, v in zip(grid, combo, strict=True)
                     if k != "algorithm.name" and k not in variant and (not k.startswith("hp.") or k[3:] in hp)]
            name = trial_name(label or cfg.algorithm.name, shown, seed)
            if len(name.encode()) > NAME_MAX_BYTES:
                raise ConfigError(f"trial name {name[:60]!r}... (its run name) must be at most {NAME_MAX_BYTES} bytes; "
                                  f"got {len(name.encode())}. Shorten the variant labels or the grid's values and keys.")
            trials.append(Trial(name=name, config=cfg))
    return trials


def check_hp_keys(base: Mapping[str, Any], grid: Mapping[str, list], variants: Sequence[Mapping[str, Any]]) -> None:
    """Every `hp.<name>` key of a spec must be a hyperparameter of at least one of its algorithms
    (a key that applies to none would sweep nothing, silently)."""
    from fedcli.algorithms import ALGORITHMS

    names = {str(v) for v in grid.get("algorithm.name", [])}
    names |= {str(src["algorithm.name"]) for src in (base, *variants) if "algorithm.name" in src}
    if "algorithm.name" not in base and "algorithm.name" not in grid and any("algorithm.name" not in v
                                                                            for v in variants):
        names.add(AlgorithmConfig.name)  # trials that name no algorithm run the default
    known = {n: {f.name for f in dataclasses.fields(ALGORITHMS[n].config_cls)} for n in names if n in ALGORITHMS}
    if not known:
        return  # only unknown algorithms: build_config names them
    for key in [*base, *grid, *(k for v in variants for k in v)]:
        if key.startswith("hp.") and not any(key[3:] in fields for fields in known.values()):
            valid = "; ".join(f"{n}: {', '.join(f'hp.{f}' for f in sorted(fields)) or 'none'}"
                              for n, fields in sorted(known.items()))
            raise ConfigError(f"sweep key {key} is a hyperparameter of none of the sweep's algorithms "
                              f"({', '.join(sorted(known))}){suggest(key, [f'hp.{f}' for fs in known.values() for f in fs])}; "
                              f"valid: {valid}.")


def trial_name(algo: str, shown: Sequence[tuple[str, Any]], seed: int) -> str:
    """`fedpa rho=0.1 s0`: the algorithm, each varying grid value under its last key part, the seed."""
    parts = [f"{key.split('.')[-1]}={value}" for key, value in shown]
    return " ".join([algo, *parts, f"s{seed}"])


def spec_hash(spec: Mapping[str, Any]) -> str:
    """sha256 of what decides a sweep's trials (experiment, base, grid, seeds); its MLflow parent's tag."""
    body = {key: spec.get(key) for key in ("experiment", "base", "grid", "seeds")}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def _dotted(key: str, aliases: Mapping[str, str]) -> str:
    if key.startswith("hp.") or key == "seed" or "." in key:
        return key
    if key not in aliases:
        raise ConfigError(f"unknown sweep key {key!r}{suggest(key, list(aliases))}; use a config key such as "
                          "train.rounds or hp.<name>.")
    return aliases[key]


def _has_hp(algo: str, name: str) -> bool:
    from fedcli.algorithms import ALGORITHMS

    record = ALGORITHMS.get(algo)
    return record is not None and name in {f.name for f in dataclasses.fields(record.config_cls)}


# --------------------------------------------------------------------------- what each trial needs


NEW, RESUME, SKIP, ELSEWHERE, DIVERGED = "new", "resume", "skip", "running elsewhere", "diverged"


@dataclass(frozen=True)
class Plan:
    """What a sweep does with one trial: `action` is NEW, RESUME (run `run_id`), SKIP, ELSEWHERE or DIVERGED."""

    trial: Trial
    action: str
    run_id: str | None = None
    note: str = ""  # e.g. "interrupted: stopped by SIGTERM during round 4"


def plan_trials(trials: Sequence[Trial], records: Sequence[RunRecord]) -> list[Plan]:
    """Match each trial to the runs of its config hash (`records`: the experiment's runs, oldest first).

    A live run wins (never train a config twice at once), then a finished one, then the
    newest interrupted or failed run, which is resumed; a run that diverged is not retried
    (the same config and seed diverge again at the same round).
    """
    by_hash: dict[str, list[RunRecord]] = {}
    for record in records:
        by_hash.setdefault(record.tags.get("fedcli.config_hash") or record.config_hash, []).append(record)
    plans = []
    for trial in trials:
        runs = by_hash.get(trial.config.config_hash, [])
        alive = [r for r in runs if r.is_alive]
        done = [r for r in runs if r.status == "finished"]
        if alive:
            plans.append(Plan(trial, ELSEWHERE, alive[-1].id, f"pid {alive[-1].pid} on {alive[-1].host}"))
        elif done:
            plans.append(Plan(trial, SKIP, done[-1].id, "finished before"))
        elif runs and runs[-1].diverged_at_round is not None:
            plans.append(Plan(trial, DIVERGED, runs[-1].id, f"diverged at round {runs[-1].diverged_at_round}"))
        elif runs:
            last = runs[-1]
            plans.append(Plan(trial, RESUME, last.id, f"{last.status}: {last.failure_reason or 'no reason stored'}"))
        else:
            plans.append(Plan(trial, NEW))
    return plans


SETTLE_S = 5.0  # how long a sweep waits for runs alive elsewhere to end before it plans them as running


def plan_settled(trials: Sequence[Trial], read_runs: Callable[[], list[RunRecord]],
                 settle_s: float = SETTLE_S) -> list[Plan]:
    """`plan_trials`, giving runs alive in another process up to `settle_s` seconds to end first.

    A sweep killed a moment ago leaves its trials a second or two to checkpoint and read
    `interrupted`; a rerun started right away should resume them, not skip them as running.
    """
    deadline = time.monotonic() + settle_s
    while True:
        plans = plan_trials(trials, read_runs())
        if time.monotonic() >= deadline or not any(p.action == ELSEWHERE for p in plans):
            return plans
        time.sleep(0.5)


def trial_command(plan: Plan, config_path: Path, cores: int, parent_run: str | None,
                  threads: int | None = None) -> list[str]:
    """The `fedcli train` command line of a planned trial (a new run, or `--resume` of its run).

    `cores`: the trial's share of the CPU, given as train.workers unless its config sets it
    (so N trials at once do not each start a worker per core); not part of the config hash.
    `threads` (the Ray backend): train.threads likewise; None leaves it to `fedcli train`.
    A new run's config is written to `config_path` (trial_config_text).
    """
    text = trial_config_text(plan, cores, threads)
    if text is not None:
        config_path.write_text(text)
    return [sys.executable, "-m", "fedcli", "-q", "train", *trial_args(plan, config_path, cores, parent_run, threads)]


def trial_config_text(plan: Plan, cores: int, threads: int | None = None) -> str | None:
    """The YAML config a new trial's `fedcli train --config` reads; None for a resumed one."""
    if plan.action == RESUME:
        return None
    body = plan.trial.config.to_dict()
    if plan.trial.config.recommended:  # which values were recommended: the trial's tag fedcli.recommended
        body["recommended"] = dict(plan.trial.config.recommended)
    body["train"]["workers"] = plan.trial.config.train.workers or cores
    if threads is not None:
        body["train"]["threads"] = plan.trial.config.train.threads or threads
    return yaml.safe_dump(body, sort_keys=True)


def trial_env(track: Any) -> dict[str, str] | None:
    """The environment of a trial process: this one's, plus FEDCLI_STORE / MLFLOW_TRACKING_URI where the
    sweep's URLs carry a password, which the trial's config file and command line hold masked
    (docs/architecture.md, "Security"); None (inherit) when neither does."""
    extra = {name: url for name, url in (("FEDCLI_STORE", track.store_url), ("MLFLOW_TRACKING_URI", track.mlflow_uri))
             if has_password(url)}
    return {**os.environ, **extra} if extra else None


def trial_args(plan: Plan, config_path: Path | str, cores: int, parent_run: str | None,
               threads: int | None = None) -> list[str]:
    """The arguments after `fedcli train` of trial_command."""
    cfg = plan.trial.config
    workers = cfg.train.workers or cores
    if plan.action == RESUME:
        assert plan.run_id is not None
        command = ["--resume", plan.run_id, "--root", cfg.tracking.root, "--workers", str(workers)]
        if threads is not None:
            command += ["--threads", str(cfg.train.threads or threads)]
        if cfg.tracking.store:  # a password masked: the trial gets the URL from its environment (trial_env)
            command += ["--store", mask_url(cfg.tracking.store)]
        if cfg.tracking.tracking_uri:
            command += ["--tracking-uri", mask_url(cfg.tracking.tracking_uri)]
        if not cfg.tracking.use_mlflow:
            command.append("--no-mlflow")
    else:
        command = ["--config", str(config_path), "--run-name", plan.trial.name]
    if parent_run is not None:
        command += ["--parent-run", parent_run]
    return command


# --------------------------------------------------------------------------- the trial processes


PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
KILL_AFTER_S = 180.0  # a stopped trial still running this long after SIGTERM is killed (it reads interrupted)


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A `preexec_fn`: the child gets SIGTERM when the sweep dies, even by SIGKILL (Linux; no-op elsewhere).

    The signal is tied to the thread that forks, so trials are started from the main thread.
    libc is loaded here, before the fork, so the child only makes two system calls.
    """
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None

    def preexec() -> None:
        if libc is None:
            return
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent_pid:  # the sweep died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


@dataclass
class TrialProcess:
    """A running (or ended) trial: its plan, process, log files and what the store says about it."""

    plan: Plan
    proc: subprocess.Popen[bytes]
    folder: Path
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    run_id: str | None = None
    stopped: bool = False  # ended by the sweep's stop

    @property
    def elapsed_s(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    @property
    def status(self) -> str:
        code = self.proc.returncode
        if code is None:
            return "running"
        if code == 0:
            return "finished"
        return "interrupted" if self.stopped or code in {128 + s for s in STOP_SIGNALS} else "failed"

    def last_error(self) -> str:
        """The trial's last non-empty stderr line (why it failed), else its exit code."""
        path = self.folder / "stderr.txt"
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()] \
            if path.exists() else []
        return lines[-1] if lines else f"exit code {self.proc.returncode}"

    def locate(self, records: Sequence[RunRecord]) -> str | None:
        """The id of the run this process trains: the store's run of its host, pid and config hash,
        else the id it printed."""
        from fedcli.tracking.store import HOSTNAME

        key = (HOSTNAME, self.proc.pid, self.plan.trial.config.config_hash)
        found = [r.id for r in records if (r.host, r.pid, r.tags.get("fedcli.config_hash")) == key]
        return found[-1] if found else self.printed_run_id()

    def printed_run_id(self) -> str | None:
        """The run id `fedcli train` printed on stdout (only once it finished)."""
        path = self.folder / "stdout.txt"
        words = path.read_text(errors="replace").split() if path.exists() else []
        return words[-1] if words and len(words[-1]) == 32 else None


class TrialClaims:
    """A sweep's claims on its trials in the store: one process runs each trial at a time.

    `take` claims a trial right before it starts (`SqlStore.claim_trial`, atomic); `release`
    gives it back when the trial's process has ended; `refresh` renews the claims' heartbeat
    every `HEARTBEAT_S` (what tells a sweep on another host that this one is alive). Both
    backends use it through `Scheduler`: the claims are the sweep process's, wherever the
    trial runs.
    """

    def __init__(self, store: Any, experiment: str) -> None:
        self.store, self.experiment = store, experiment
        self.held: set[str] = set()  # config hashes this sweep holds
        self._refreshed = time.monotonic()

    def take(self, plan: Plan) -> Claim | None:
        """Claim the trial: None when it is this sweep's now, else the live claim of another process."""
        key = plan.trial.config.config_hash
        other = self.store.claim_trial(self.experiment, key)
        if other is None:
            self.held.add(key)
        return other

    def release(self, plan: Plan) -> None:
        """Give the trial back (its process ended, or it needs no run); a no-op when not held."""
        key = plan.trial.config.config_hash
        if key in self.held:
            self.held.discard(key)
            self.store.release_trial(self.experiment, key)

    def refresh(self) -> None:
        """Renew this sweep's claims every HEARTBEAT_S seconds (cheap to call often)."""
        from fedcli.tracking.store import HEARTBEAT_S, stale_s

        if self.held and time.monotonic() - self._refreshed >= min(HEARTBEAT_S, stale_s() / 4):
            self._refreshed = time.monotonic()
            self.store.refresh_claims(self.experiment)

    def release_all(self) -> None:
        for key in sorted(self.held):
            self.store.release_trial(self.experiment, key)
        self.held.clear()


class Scheduler:
    """Run planned trials, at most `workers` at once, as children of this (main) thread.

    `run(tick)` calls `tick(processes)` about every `tick_s` seconds and after each start
    and exit. A stop signal forwards SIGTERM to the running trials (once; `fedcli train`
    then checkpoints its last round and exits 128 + 15), starts nothing new and returns
    the signal number once every trial has exited. With `claims`, each trial is claimed
    before it starts (then `recheck`ed) and released when its process ends; a trial another
    live sweep claimed is planned ELSEWHERE and not started.
    """

    def __init__(self, plans: Sequence[Plan], *, workers: int, cores: int, parent_run: str | None,
                 recheck: Callable[[Plan], Plan] | None = None, claims: TrialClaims | None = None) -> None:
        self.plans = list(plans)  # as planned, each replaced by its recheck when its turn comes
        self.pending = [p for p in plans if p.action in (NEW, RESUME)]
        self.recheck = recheck  # plans a trial again right before it starts (another process may have taken it)
        self.claims = claims
        self.workers, self.cores, self.parent_run = workers, cores, parent_run
        self.processes: list[TrialProcess] = []
        self.signum: int | None = None
        self._forwarded_at: float | None = None
        self._tmp = Path(tempfile.mkdtemp(prefix="fedcli-sweep-"))

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signum = self.signum or signum

    def start(self, plan: Plan) -> TrialProcess:
        folder = self._tmp / f"trial-{len(self.processes)}"
        folder.mkdir()
        command = trial_command(plan, folder / "run.yaml", self.cores, self.parent_run)
        with open(folder / "stdout.txt", "wb") as out, open(folder / "stderr.txt", "wb") as err:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    preexec_fn=die_with_parent(os.getpid()), env=trial_env(plan.trial.config.tracking))
        process = TrialProcess(plan, proc, folder, run_id=plan.run_id)
        self.processes.append(process)
        return process

    def run(self, tick: Callable[[list[TrialProcess]], None], tick_s: float = 1.0) -> int | None:
        in_main = threading.current_thread() is threading.main_thread()  # only it may set handlers
        previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS} if in_main else {}
        try:
            last_tick = 0.0
            # after a stop, pending trials never start: wait for the running ones only (before: a
            # stop with trials still waiting looped forever, printing "sweep: 1/2 done; 1 waiting")
            while self.running or (self.pending and self.signum is None):
                changed = self._step()
                if changed or time.monotonic() - last_tick >= tick_s:
                    tick(self.processes)
                    last_tick = time.monotonic()
                time.sleep(0.1)
            tick(self.processes)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return self.signum

    @property
    def running(self) -> list[TrialProcess]:
        return [p for p in self.processes if p.proc.returncode is None]

    def _step(self) -> bool:
        """Reap exited trials, forward a stop, start pending trials; True when something changed."""
        changed = self._reap()
        if self.claims is not None:
            for process in self.processes:
                if process.ended is not None:
                    self.claims.release(process.plan)
            self.claims.refresh()
        if self.signum is not None:
            self._stop()
            return changed
        while self.pending and len(self.running) < self.workers:
            plan = self.pending.pop(0)
            fresh = self._take(plan)
            self.plans[self.plans.index(plan)] = plan = fresh
            if plan.action in (NEW, RESUME):
                self.start(plan)
            changed = True
        return changed

    def _take(self, plan: Plan) -> Plan:
        """The trial's plan right before it starts: claimed first (claims), then planned again
        against the store (recheck), so a trial that another process took meanwhile is not
        started twice; a trial that needs no run gives its claim back."""
        if self.claims is not None:
            other = self.claims.take(plan)
            if other is not None:
                return Plan(plan.trial, ELSEWHERE, None, str(other))
        fresh = self.recheck(plan) if self.recheck is not None else plan
        if self.claims is not None and fresh.action not in (NEW, RESUME):
            self.claims.release(fresh)
        return fresh

    def _reap(self) -> bool:
        """Note the trials that exited since the last step; True when one did."""
        changed = False
        for process in self.running:
            if process.proc.poll() is not None:
                process.ended, changed = time.monotonic(), True
        return changed

    def _stop(self) -> None:
        """Forward SIGTERM once (a second signal while a trial checkpoints would cut its checkpoint short).

        A Ctrl-C in the terminal already reached every process of the foreground group, the
        trials included, so a SIGINT is forwarded only when the sweep is not that group.
        """
        now = time.monotonic()
        if self._forwarded_at is None:
            self._forwarded_at = now
            forward = not (self.signum == signal.SIGINT and in_terminal_foreground())
            for process in self.running:
                process.stopped = True
                if forward:
                    with_suppressed_lookup(process.proc.send_signal, signal.SIGTERM)
        elif now - self._forwarded_at > KILL_AFTER_S:
            for process in self.running:
                with_suppressed_lookup(process.proc.kill)

    def cleanup(self) -> None:
        """Give back the claims still held; remove the trials' temporary files (configs, captured output)."""
        import shutil

        if self.claims is not None:
            from fedcli.errors import TrackingError

            try:
                self.claims.release_all()
            except TrackingError as err:  # the claims are dead-owner claims once this process exits
                import logging

                logging.getLogger(__name__).warning("could not release the sweep's trial claims: %s", err)
        shutil.rmtree(self._tmp, ignore_errors=True)


def in_terminal_foreground() -> bool:
    """True when this process's group is the foreground group of its controlling terminal."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def with_suppressed_lookup(call: Callable[..., object], *args: object) -> None:
    """Signal a process that may just have exited."""
    try:
        call(*args)
    except ProcessLookupError:
        pass


# --------------------------------------------------------------------------- what the store says


METRIC_KEYS = ("eval/accuracy", "eval/dist_to_opt", "eval/loss")  # shown when the spec names no report metric


@dataclass(frozen=True)
class TrialRow:
    """One line of the sweep's live and final tables."""

    name: str
    status: str  # finished, failed, interrupted, running, waiting, running elsewhere, diverged, not started
    round_idx: int | None  # last round logged
    rounds: int
    metric: float | None  # latest value of the table's metric
    elapsed_s: float | None  # of this sweep's process; None for trials it did not run
    run_id: str | None
    note: str = ""


def trial_rows(store: Any, experiment: str, plans: Sequence[Plan], processes: Sequence[TrialProcess],
               metric_keys: Sequence[str], stopped: bool = False) -> tuple[list[TrialRow], str]:
    """Rows of every planned trial, rounds and metric read from the store; and the metric key shown.

    `processes`: TrialProcess, or any object with its attributes (fedcli.sweep_ray.RayTrial).
    """
    records = experiment_runs(store, experiment)
    for started in processes:
        if started.run_id is None:  # a new run: the store knows it by the trial process's pid
            started.run_id = started.locate(records)
    by_plan = {id(p.plan): p for p in processes}
    elsewhere = {id(p): _run_of(p.trial, records) for p in plans if p.action == ELSEWHERE and id(p) not in by_plan}
    ids = [i for i in (by_plan[id(p)].run_id if id(p) in by_plan else
                       getattr(elsewhere.get(id(p)), "id", None) or p.run_id for p in plans) if i]
    frame = store.metrics_frame(ids, keys=list(metric_keys)) if ids else None
    key = next((k for k in metric_keys if frame is not None and (frame["key"] == k).any()), metric_keys[0])
    latest = {} if frame is None else frame[frame["key"] == key].groupby("run_id")["value"].last().to_dict()
    rows = []
    for plan in plans:
        process = by_plan.get(id(plan))
        run_id = process.run_id if process else plan.run_id
        status, note = _row_status(plan, process, stopped)
        other = elsewhere.get(id(plan))
        if other is not None:  # the run another process trains for this trial: how it stands now
            run_id = other.id
            status = ELSEWHERE if other.is_alive else f"{other.status} elsewhere"
        rows.append(TrialRow(plan.trial.name, status, store.last_round(run_id) if run_id else None,
                             plan.trial.config.train.rounds, latest.get(run_id),
                             None if process is None else process.elapsed_s, run_id, note))
    return rows, key


def _run_of(trial: Trial, records: Sequence[RunRecord]) -> RunRecord | None:
    """The newest run of the trial's config hash, if any."""
    same = [r for r in records if (r.tags.get("fedcli.config_hash") or r.config_hash) == trial.config.config_hash]
    return same[-1] if same else None


def experiment_runs(store: Any, experiment: str) -> list[RunRecord]:
    """The experiment's runs, oldest first; none for an experiment the store does not know yet."""
    try:
        return list(store.list_runs(experiment=experiment))
    except ConfigError:  # unknown experiment: a new sweep
        return []


def _row_status(plan: Plan, process: TrialProcess | None, stopped: bool) -> tuple[str, str]:
    if process is not None:
        status = process.status
        return status, process.last_error() if status in ("failed", "interrupted") else (
            "resumed" if plan.action == RESUME else "")
    if plan.action in (NEW, RESUME):
        return ("not started" if stopped else "waiting"), ("to resume" if plan.action == RESUME else "")
    return {SKIP: "finished (skip)", ELSEWHERE: ELSEWHERE, DIVERGED: "diverged (skip)"}[plan.action], plan.note


# --------------------------------------------------------------------------- the MLflow parent run


SWEEP_TAG, SPEC_HASH_TAG = "fedcli.sweep", "fedcli.sweep_spec_hash"


def parent_run(tracking_uri: str, spec: Mapping[str, Any]) -> MlflowSink:
    """Open the sweep's MLflow parent run: the experiment's run tagged with this spec, else a new one.

    Raises:
        TrackingError: MLflow cannot be opened or written.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from fedcli.errors import TrackingError
    from fedcli.tracking.mirror import schema_lock
    from fedcli.tracking.mlflow_sink import MlflowSink

    experiment, digest = spec["experiment"], spec_hash(spec)
    with schema_lock(tracking_uri):  # N processes on a fresh root set MLflow's schema up once
        sink = MlflowSink(tracking_uri, experiment)
    quoted = experiment.replace("\\", "\\\\").replace("'", "\\'")
    try:
        found = MlflowClient(tracking_uri=tracking_uri).search_runs(
            [sink.experiment_id], filter_string=f"tags.`{SWEEP_TAG}` = '{quoted}' AND tags.`{SPEC_HASH_TAG}` = '{digest}'",
            order_by=["attributes.start_time ASC"], max_results=1)
    except MlflowException as err:
        raise TrackingError(f"MLflow store {mask_url(tracking_uri)!r} could not be searched: {mask_url(str(err))}; "
                            "pass --tracking-uri with a reachable MLflow store or use --no-mlflow") from err
    if found:
        sink.attach(found[0].info.run_id)
        return sink
    sink.start_run(run_name=f"sweep {experiment}", params={},
                   tags={SWEEP_TAG: experiment, SPEC_HASH_TAG: digest, "fedcli.kind": "sweep"})
    sink.log_text(yaml.safe_dump(dict(spec), sort_keys=False), "sweep.yaml")
    return sink
