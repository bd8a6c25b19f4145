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
and reads `interrupted`; actors still busy `RayScheduler.kill_after_s` later are killed.

A URL's password never travels as a Ray argument (Ray keeps task and actor arguments in its GCS and
may log them): actors get the store and MLflow URIs, and the pruning hook its storage, masked
(`user:***@host`), and take the real ones from FEDCLI_STORE / MLFLOW_TRACKING_URI in their own
process environment. `connect` exports them before `ray.init`, so a Ray instance it starts on this
machine passes them on to its workers; on a running cluster they must be set where `ray start` ran,
which `connect` verifies (comparing masked forms) before anything is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
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
from fedcli.sweep.scheduler import Scheduler, TrialClaims, TrialOutcome, TrialProcess
from fedcli.sweep.spec import Trial

if TYPE_CHECKING:
    from fedcli.config.sections import TrackingConfig
    from fedcli.tracking.store.records import RunRecord

INSTALL = "pip install 'fedcli[ray]'"


@dataclass
class RayCluster:
    """A connected Ray cluster: the `ray` module, its alive nodes, and the resources of one trial."""

    ray: Any
    nodes: list[dict[str, Any]]
    cpus: int
    gpus: float

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


@contextmanager
def connect(address: str | None, cpus: int, gpus: float, track: TrackingConfig) -> Iterator[RayCluster]:
    """Connect to the Ray cluster at `address` for the duration of the block (None: Ray's default,
    RAY_ADDRESS, else the cluster `ray start` started on this machine, else a new local instance).

    `track`: its URLs that hold a password are exported to this process's environment first, so that a
    Ray instance `ray.init` starts here hands them to its workers (never as arguments: module docstring).
    Before anything is written, the cluster is refused when its nodes cannot share the stores or hold a
    trial (check_cluster), or its workers lack a URL with a password in their environment (check_secrets).

    Raises:
        ConfigError: Ray is not installed, the cluster cannot be reached, or it is refused.
    """
    use_token_if_there()  # before Ray reads its config
    os.environ.update(secret_env(track))  # inherited by the raylet and workers of an instance started here
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
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        check_cluster(nodes, track, cpus, gpus)
        check_secrets(ray, secret_env(track))
        yield RayCluster(ray, nodes, cpus, gpus)
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


@dataclass(kw_only=True)
class RayTrial(TrialProcess):
    """A submitted (or ended) trial."""

    ref: Any  # the ObjectRef of its TrialActor.run call
    actor: Actor


class RayScheduler(Scheduler):
    """Scheduler whose trials run in long-lived Ray actors (`TrialActor`), at most `workers` at once.

    Each actor holds `--cpus-per-trial` CPUs and `--gpus-per-trial` GPUs and runs one sweep worker
    (fedcli/sweep/worker.py) that trains many trials in-process, as the local backend's workers do;
    a new actor is created only while fewer than `workers` exist. A resumed trial goes preferably
    to an idle actor on the host of its run (its checkpoints may be on that node's disk only), a
    new actor is placed there when none is idle. An actor whose worker or node died costs its trial
    (`failed`, with how it died; its run reads `interrupted`, and a rerun resumes it) and is
    replaced. A stop asks each busy actor to stop its trial (SIGTERM to its worker: checkpointed,
    `interrupted`); actors still busy `kill_after_s` later are killed. `mirror`: the sweep's one
    MLflow mirror (tracking/mlflow/sweep_mirror.py), given each ended trial's run. `workers` None: as
    many as the cluster holds (`RayCluster.default_workers`).
    """

    kill_after_s = Scheduler.kill_after_s + 30.0  # a stop's wait before busy actors are killed: a margin more

    def __init__(
        self,
        plans: Sequence[Plan],
        *,
        cluster: RayCluster,
        workers: int | None,
        recheck: Callable[[Plan], Plan],
        read_runs: Callable[[], list[RunRecord]],
        track: TrackingConfig,
        claims: TrialClaims | None = None,
        mirror: Any = None,
        source: Any = None,
    ) -> None:
        from fedcli.tracking.urls import mask_url

        super().__init__(
            plans,
            workers=workers or cluster.default_workers(),
            cores=cluster.cpus,
            recheck=recheck,
            claims=claims,
            source=source,
            threads=cluster.cpus,
            mirror=mirror,
        )
        self.cluster, self.read_runs, self.cwd = cluster, read_runs, str(Path.cwd())
        self.env = {"FEDCLI_STORE": mask_url(track.store_url)}  # the actors read the password from their env
        if track.use_mlflow:
            self.env["MLFLOW_TRACKING_URI"] = mask_url(track.mlflow_uri)
        self.processes: list[RayTrial] = []  # type: ignore[assignment]
        self.actors: list[Actor] = []
        self._actor_class = cluster.ray.remote(TrialActor)

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
        trial = RayTrial(plan, ref=ref, actor=actor, run_id=plan.run_id)
        actor.busy = trial
        self.processes.append(trial)
        return trial

    def _host_of(self, plan: Plan) -> str | None:
        """The host where a resumed trial's run trained last (None: any will do)."""
        if plan.action != RESUME or len(self.cluster.nodes) < 2:
            return None
        return next((r.host for r in self.read_runs() if r.id == plan.run_id), None)

    def _reap(self) -> bool:
        by_ref = {p.ref: p for p in self.processes if p.ended is None}
        if not by_ref:
            return False
        ray = self.cluster.ray
        ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)
        for ref in ready:
            trial, error = by_ref[ref], None
            try:
                result = ray.get(ref)
            except ray.exceptions.RayError as err:  # the actor or its node died, fedcli missing there
                result, error = {}, first_line(err)
            trial.run_id = result.get("run_id") or trial.run_id
            trial.actor.busy, trial.actor.host = None, result.get("host") or trial.actor.host
            # its worker is gone (or stopping with the sweep): a new actor replaces it
            if error is not None or result.get("event") == "died" or result.get("signal"):
                self._drop(trial.actor)
            # an error: the Ray call failed (the actor or its node died, or it was cancelled)
            status = "failed" if error is not None else str(result["status"])
            if trial.stopped and status == "failed":
                status = "interrupted"
            reason = result.get("reason") or error or f"exit code {result.get('code')}"
            self._end(
                trial,
                TrialOutcome(
                    status,
                    trial.run_id,
                    "" if status == "finished" else reason,
                    result.get("round"),
                    dict(result.get("metrics") or {}),
                ),
            )
        return bool(ready)

    def _drop(self, actor: Actor) -> None:
        if actor in self.actors:
            self.actors.remove(actor)
        with contextlib.suppress(Exception):
            self.cluster.ray.kill(actor.handle, no_restart=True)

    def _ask_stop(self, trial: TrialProcess) -> None:
        """SIGTERM to the actor's worker: its trial checkpoints and reads `interrupted`."""
        trial.actor.handle.stop.remote()  # type: ignore[attr-defined]

    def _kill(self, trial: TrialProcess) -> None:
        self._drop(trial.actor)  # type: ignore[attr-defined]

    def cleanup(self) -> None:
        """End the actors (their idle workers exit), then the Scheduler's cleanup."""
        for actor in list(self.actors):
            self._drop(actor)
        super().cleanup()
