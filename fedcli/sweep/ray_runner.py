"""`fedcli sweep --backend ray`: trials in long-lived Ray actors on a cluster (docs/scaling.md, "Sweeps on Ray").

The sweep plans as with the local backend (fedcli.sweep: `plan_trials`, the MLflow parent
run, the live table read from the store); only where a trial's `fedcli train` process runs
changes. `RayScheduler` is the local `Scheduler` with long-lived Ray actors for workers (docs/sweeps.md):
each actor (fedcli.sweep.ray_actor.TrialActor) holds `--cpus-per-trial` CPUs and `--gpus-per-trial`
GPUs and runs one sweep worker (fedcli/sweep/worker.py) on its node, which trains many trials
in-process (imports and data once per actor), each trial's `train.workers` and `train.threads`
set to the actor's CPUs and its config sent as text. At most `--workers` actors exist, by default
as many as the cluster's nodes hold. A resumed trial goes preferably to an actor on the node of
its run (its checkpoints may be on that node's disk only). Nothing is retried by Ray: a trial
whose actor or node dies reads `interrupted` in the store and the next rerun resumes it. Trials
are claimed in the store by the driver as with the local backend (`TrialClaims`, through
`Scheduler._step`), so a Ray sweep and a local one, or two Ray sweeps, of one spec split the
trials. The driver runs the sweep's one MLflow mirror (tracking/mlflow/sweep_mirror.py).

Results go to the store and MLflow URIs the driver resolved, passed to each trial, so every
node must reach them: on a cluster of more than one node a SQLite store or a file-based
MLflow URI is refused before anything is written (`check_cluster`, fedcli/sweep/ray_checks.py). A stop (SIGINT, SIGTERM,
SIGHUP) asks each busy actor to stop: it sends SIGTERM to its worker, whose trial checkpoints
and reads `interrupted`; actors still busy `KILL_AFTER_S` later are killed.

A URL's password never travels as a Ray argument (Ray keeps task and actor arguments in its GCS and
may log them): actors get the store and MLflow URIs, and the pruning hook its storage, masked
(`user:***@host`), and take the real ones from FEDCLI_STORE / MLFLOW_TRACKING_URI in their own
process environment. `connect` exports them before `ray.init`, so a Ray instance it starts on this
machine passes them on to its workers; on a running cluster they must be set where `ray start` ran,
which `RayCluster.check` verifies (comparing masked forms) before anything is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedcli.errors import ConfigError
from fedcli.sweep.plan import RESUME, Plan
from fedcli.sweep.ray_actor import TrialActor
from fedcli.sweep.ray_checks import (
    check_cluster,
    check_secrets,
    first_line,
    probe,
    secret_env,
    use_token_if_there,
)
from fedcli.sweep.scheduler import KILL_AFTER_S as TRIAL_KILL_AFTER_S
from fedcli.sweep.scheduler import Scheduler, TrialClaims, TrialOutcome
from fedcli.sweep.spec import Trial

if TYPE_CHECKING:
    from fedcli.config.sections import TrackingConfig
    from fedcli.tracking.store.records import RunRecord

INSTALL = "pip install 'fedcli[ray]'"
KILL_AFTER_S = (
    TRIAL_KILL_AFTER_S + 30.0
)  # a stop's wait before busy actors are killed: the local one's and a margin


@dataclass
class RayCluster:
    """A connected Ray cluster: the `ray` module, its alive nodes, and the resources of one trial."""

    ray: Any
    nodes: list[dict[str, Any]]
    cpus: int
    gpus: float

    def check(self, track: TrackingConfig) -> None:
        """Refuse stores the trials cannot share, trials no node can hold (check_cluster), and a URL with a
        password that the cluster's workers do not have in their environment (check_secrets)."""
        check_cluster(self.nodes, track, self.cpus, self.gpus)
        check_secrets(self.ray, secret_env(track))

    def default_workers(self) -> int:
        """Trials the cluster holds at once: per node, its CPUs (and GPUs) over one trial's, summed."""
        total = 0
        for node in self.nodes:
            res = node.get("Resources", {})
            fit = int(res.get("CPU", 0) // self.cpus)
            if self.gpus > 0:
                fit = min(fit, int(res.get("GPU", 0) // self.gpus))
            total += fit
        return max(1, total)

    def scheduler(
        self,
        plans: Sequence[Plan],
        *,
        workers: int | None,
        parent_run: str | None,
        recheck: Callable[[Plan], Plan],
        read_runs: Callable[[], list[RunRecord]],
        track: TrackingConfig,
        claims: TrialClaims | None = None,
        mirror: Any = None,
        source: Any = None,
    ) -> RayScheduler:
        from fedcli.tracking.urls import mask_url

        env = {"FEDCLI_STORE": track.store_url}
        if track.use_mlflow:
            env["MLFLOW_TRACKING_URI"] = track.mlflow_uri
        env = {
            key: mask_url(value) for key, value in env.items()
        }  # the actors read the password from their env
        return RayScheduler(
            plans,
            cluster=self,
            workers=workers or self.default_workers(),
            parent_run=parent_run,
            recheck=recheck,
            read_runs=read_runs,
            env=env,
            cwd=str(Path.cwd()),
            claims=claims,
            mirror=mirror,
            source=source,
        )


@contextmanager
def connect(
    address: str | None, cpus: int, gpus: float, track: TrackingConfig | None = None
) -> Iterator[RayCluster]:
    """Connect to the Ray cluster at `address` for the duration of the block (None: Ray's default,
    RAY_ADDRESS, else the cluster `ray start` started on this machine, else a new local instance).

    `track`: its URLs that hold a password are exported to this process's environment first, so that a
    Ray instance `ray.init` starts here hands them to its workers (never as arguments: module docstring).

    Raises:
        ConfigError: Ray is not installed, or the cluster cannot be reached.
    """
    use_token_if_there()  # before Ray reads its config
    if track is not None:
        os.environ.update(
            secret_env(track)
        )  # inherited by the raylet and workers of an instance started here
    try:
        import ray
    except ImportError:
        raise ConfigError(
            f"--backend ray needs Ray, which is not installed; install it with: {INSTALL}"
        ) from None
    if address not in (None, "auto", "local"):
        probe(address)
    extra: dict[str, Any] = (
        {} if address else {"include_dashboard": False}
    )  # only for an instance ray.init starts
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False, **extra)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as err:
        raise ConfigError(
            f"cannot connect to the Ray cluster at {address or 'RAY_ADDRESS'!r} ({first_line(err)}); "
            "start one with `ray start --head` or pass --address of a running cluster."
        ) from None
    try:
        yield RayCluster(ray, [n for n in ray.nodes() if n.get("Alive")], cpus, gpus)
    finally:
        ray.shutdown()


def absolute_root(trials: Sequence[Trial]) -> list[Trial]:
    """The trials with tracking.root made absolute (their checkpoints land there on any node)."""

    def pinned(cfg: Any) -> Any:
        return dataclasses.replace(
            cfg, tracking=dataclasses.replace(cfg.tracking, root=str(Path(cfg.tracking.root).resolve()))
        )

    return [Trial(t.name, pinned(t.config)) for t in trials]


# --------------------------------------------------------------------------- the trial tasks


def masked_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A trial message (fedcli.sweep.worker_pool.trial_message) with its URLs masked: the hook's storage and a
    resumed trial's tracking.store / tracking.tracking_uri. The actor (TrialActor.run) and the worker
    (fedcli.config.sections.given_url) take the real URLs from their environment."""
    from fedcli.tracking.urls import mask_url

    out = dict(message)
    if isinstance(out.get("hook"), Mapping) and isinstance(out["hook"].get("storage"), str):
        out["hook"] = {**out["hook"], "storage": mask_url(out["hook"]["storage"])}
    if isinstance(out.get("overrides"), Mapping):
        out["overrides"] = {
            k: mask_url(v) if k in ("tracking.store", "tracking.tracking_uri") and isinstance(v, str) else v
            for k, v in out["overrides"].items()
        }
    return out


@dataclass
class Actor:
    """One `TrialActor` of the sweep: its handle, the host it runs on (once known), the trial it runs."""

    handle: Any
    host: str | None = None
    busy: RayTrial | None = None


@dataclass
class RayTrial:
    """A submitted (or ended) trial; read by the sweep's tables as a TrialProcess."""

    plan: Plan
    ref: Any  # the ObjectRef of its TrialActor.run call
    actor: Actor | None = None
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    run_id: str | None = None
    stopped: bool = False  # ended by the sweep's stop
    result: dict[str, Any] | None = None  # what TrialActor.run returned (always with a `status`)
    error: str | None = None  # the Ray error that ended the task instead (cancelled, worker died)

    @property
    def elapsed_s(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    @property
    def status(self) -> str:
        if self.ended is None:
            return "running"
        if self.result is None:  # the Ray call failed (the actor or its node died, or it was cancelled)
            return "interrupted" if self.stopped else "failed"
        status = str(self.result["status"])
        return "interrupted" if self.stopped and status == "failed" else status

    def last_error(self) -> str:
        """The trial's reason, else the Ray error, else its exit code."""
        if self.result is not None and self.result.get("reason"):
            return str(self.result["reason"])
        return self.error or f"exit code {None if self.result is None else self.result.get('code')}"

    def locate(self, records: Sequence[RunRecord]) -> str | None:
        """The id of the run this trial trains: the one its worker reported, else the run of its config
        hash (planned new right before it was submitted, so none of that hash existed then)."""
        if self.run_id is not None:
            return self.run_id
        key = self.plan.trial.config.config_hash
        found = [r.id for r in records if (r.tags.get("fedcli.config_hash") or r.config_hash) == key]
        return found[-1] if found else None


class RayScheduler(Scheduler):
    """Scheduler whose trials run in long-lived Ray actors (`TrialActor`), at most `workers` at once.

    Each actor holds `--cpus-per-trial` CPUs and `--gpus-per-trial` GPUs and runs one sweep worker
    (fedcli/sweep/worker.py) that trains many trials in-process, as the local backend's workers do;
    a new actor is created only while fewer than `workers` exist. A resumed trial goes preferably
    to an idle actor on the host of its run (its checkpoints may be on that node's disk only), a
    new actor is placed there when none is idle. An actor whose worker or node died costs its trial
    (`failed`, with how it died; its run reads `interrupted`, and a rerun resumes it) and is
    replaced. A stop asks each busy actor to stop its trial (SIGTERM to its worker: checkpointed,
    `interrupted`); actors still busy KILL_AFTER_S later are killed. `mirror`: the sweep's one
    MLflow mirror (tracking/mlflow/sweep_mirror.py), given each ended trial's run.
    """

    def __init__(
        self,
        plans: Sequence[Plan],
        *,
        cluster: RayCluster,
        workers: int,
        parent_run: str | None,
        recheck: Callable[[Plan], Plan],
        read_runs: Callable[[], list[RunRecord]],
        env: Mapping[str, str],
        cwd: str,
        claims: TrialClaims | None = None,
        mirror: Any = None,
        source: Any = None,
    ) -> None:
        super().__init__(
            plans,
            workers=workers,
            cores=cluster.cpus,
            parent_run=parent_run,
            recheck=recheck,
            claims=claims,
            source=source,
            threads=cluster.cpus,
        )
        self.cluster, self.read_runs, self.env, self.cwd = cluster, read_runs, dict(env), cwd
        self.processes: list[RayTrial] = []  # type: ignore[assignment]
        self.actors: list[Actor] = []
        self.mirror = mirror
        self._actor_class = cluster.ray.remote(TrialActor)
        self._killed = False

    def _actor(self, plan: Plan) -> Actor:
        """An idle actor (on the resumed run's host when there is one), else a new one."""
        host = self._host_of(plan)
        idle = [a for a in self.actors if a.busy is None]
        if idle:
            return next((a for a in idle if host is not None and a.host == host), idle[0])
        options: dict[str, Any] = {
            "num_cpus": self.cores,
            "num_gpus": self.cluster.gpus,
            "max_concurrency": 2,
            "max_restarts": 0,
        }
        node = (
            next((n["NodeID"] for n in self.cluster.nodes if n.get("NodeManagerHostname") == host), None)
            if host is not None and len(self.cluster.nodes) > 1
            else None
        )
        if node is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
        actor = Actor(self._actor_class.options(**options).remote(self.cwd, self.env))
        self.actors.append(actor)
        return actor

    def start(self, plan: Plan) -> RayTrial:  # type: ignore[override]
        from fedcli.sweep.worker_pool import trial_message

        actor = self._actor(plan)
        hook = self.source.hook(plan) if self.source is not None else None
        ref = actor.handle.run.remote(masked_message(trial_message(plan, self.cores, self.cores, hook)))
        trial = RayTrial(plan, ref, actor=actor, run_id=plan.run_id)
        actor.busy = trial
        self.processes.append(trial)
        return trial

    def _host_of(self, plan: Plan) -> str | None:
        """The host where a resumed trial's run trained last (None: any will do)."""
        if plan.action != RESUME or len(self.cluster.nodes) < 2:
            return None
        return next((r.host for r in self.read_runs() if r.id == plan.run_id), None)

    @property
    def running(self) -> list[RayTrial]:  # type: ignore[override]
        return [p for p in self.processes if p.ended is None]

    def _reap(self) -> bool:
        by_ref = {p.ref: p for p in self.running}
        if not by_ref:
            return False
        ray = self.cluster.ray
        ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)
        for ref in ready:
            trial = by_ref[ref]
            actor = trial.actor
            try:
                trial.result = ray.get(ref)
            except ray.exceptions.RayError as err:  # the actor or its node died, fedcli missing there
                trial.error = first_line(err)
            result = trial.result or {}
            trial.run_id = result.get("run_id") or trial.run_id
            trial.ended = time.monotonic()
            if actor is not None:
                actor.busy, actor.host = None, result.get("host") or actor.host
                if trial.result is None or result.get("event") == "died" or result.get("signal"):
                    self._drop(
                        actor
                    )  # its worker is gone (or stopping with the sweep): a new actor replaces it
            self._told(
                trial.plan,
                TrialOutcome(
                    trial.status,
                    trial.run_id,
                    "" if trial.status == "finished" else trial.last_error(),
                    result.get("round"),
                    dict(result.get("metrics") or {}),
                ),
            )
            if self.mirror is not None and trial.run_id is not None:
                self.mirror.add(trial.run_id)
        return bool(ready)

    def _drop(self, actor: Actor) -> None:
        if actor in self.actors:
            self.actors.remove(actor)
        with contextlib.suppress(Exception):
            self.cluster.ray.kill(actor.handle, no_restart=True)

    def _stop(self) -> None:
        """Ask the busy actors to stop their trials once; kill the actors still busy after KILL_AFTER_S."""
        now = time.monotonic()
        if self._forwarded_at is None:
            self._forwarded_at = now
            for trial in self.running:
                trial.stopped = True
                if trial.actor is not None:
                    trial.actor.handle.stop.remote()
        elif now - self._forwarded_at > KILL_AFTER_S and not self._killed:
            self._killed = True
            for trial in self.running:
                if trial.actor is not None:
                    self._drop(trial.actor)

    def cleanup(self) -> None:
        """End the actors (their idle workers exit), then the Scheduler's cleanup."""
        for actor in list(self.actors):
            self._drop(actor)
        super().cleanup()
