"""`fedcli sweep --backend ray`: every trial a Ray task on a cluster (docs/scaling.md, "Sweeps on Ray").

The sweep plans as with the local backend (fedcli.sweeps: `plan_trials`, the MLflow parent
run, the live table read from the store); only where a trial's `fedcli train` process runs
changes. `RayScheduler` is the local `Scheduler` with Ray tasks for child processes: each
trial is one task (fedcli.sweep_ray_task.run_trial) holding `--cpus-per-trial` CPUs and
`--gpus-per-trial` GPUs, which runs the local backend's command line (`trial_args`, the
config sent as text) on its node, the trial's `train.workers` and `train.threads` set to its
CPUs. At most `--workers` tasks are in flight, by default as many as the cluster's nodes
hold. A resumed trial goes preferably to the node of its run (its checkpoints may be on that
node's disk only). Tasks are never retried by Ray: a trial whose node dies reads
`interrupted` in the store and the next rerun resumes it. Trials are claimed in the store by
the driver as with the local backend (`sweeps.TrialClaims`, through `Scheduler._step`), so a
Ray sweep and a local one, or two Ray sweeps, of one spec split the trials.

Results go to the store and MLflow URIs the driver resolved, passed to each trial, so every
node must reach them: on a cluster of more than one node a SQLite store or a file-based
MLflow URI is refused before anything is written (`check_cluster`). A stop (SIGINT, SIGTERM,
SIGHUP) cancels the tasks without force: the task forwards SIGTERM to its trial, which
checkpoints and reads `interrupted`; tasks still running `KILL_AFTER_S` later are killed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from fedcli import sweeps
from fedcli.errors import ConfigError
from fedcli.sweep_ray_task import CONFIG_TOKEN, run_trial

if TYPE_CHECKING:
    from fedcli.config import TrackingConfig
    from fedcli.tracking.store import RunRecord

INSTALL = "pip install 'fedcli[ray]'"
CONNECT_TIMEOUT_S = 5.0  # a TCP probe of HOST:PORT before ray.init (which retries for a long time)
KILL_AFTER_S = sweeps.KILL_AFTER_S + 30.0  # the task itself kills its trial at KILL_AFTER_S


@dataclass
class RayCluster:
    """A connected Ray cluster: the `ray` module, its alive nodes, and the resources of one trial."""

    ray: Any
    nodes: list[dict[str, Any]]
    cpus: int
    gpus: float

    def check(self, track: TrackingConfig) -> None:
        """Refuse stores the trials cannot share and trials no node can hold (check_cluster)."""
        check_cluster(self.nodes, track, self.cpus, self.gpus)

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

    def scheduler(self, plans: Sequence[sweeps.Plan], *, workers: int | None, parent_run: str | None,
                  recheck: Callable[[sweeps.Plan], sweeps.Plan], read_runs: Callable[[], list[RunRecord]],
                  track: TrackingConfig, claims: sweeps.TrialClaims | None = None) -> RayScheduler:
        env = {"FEDCLI_STORE": track.store_url}
        if track.use_mlflow:
            env["MLFLOW_TRACKING_URI"] = track.mlflow_uri
        return RayScheduler(plans, cluster=self, workers=workers or self.default_workers(), parent_run=parent_run,
                            recheck=recheck, read_runs=read_runs, env=env, cwd=str(Path.cwd()), claims=claims)


@contextmanager
def connect(address: str | None, cpus: int, gpus: float) -> Iterator[RayCluster]:
    """Connect to the Ray cluster at `address` for the duration of the block (None: Ray's default,
    RAY_ADDRESS, else the cluster `ray start` started on this machine, else a new local instance).

    Raises:
        ConfigError: Ray is not installed, or the cluster cannot be reached.
    """
    use_token_if_there()  # before Ray reads its config
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--backend ray needs Ray, which is not installed; install it with: {INSTALL}") from None
    if address not in (None, "auto", "local"):
        probe(address)
    extra: dict[str, Any] = {} if address else {"include_dashboard": False}  # only for an instance ray.init starts
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False, **extra)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as err:
        raise ConfigError(f"cannot connect to the Ray cluster at {address or 'RAY_ADDRESS'!r} ({first_line(err)}); "
                          "start one with `ray start --head` or pass --address of a running cluster.") from None
    try:
        yield RayCluster(ray, [n for n in ray.nodes() if n.get("Alive")], cpus, gpus)
    finally:
        ray.shutdown()


def use_token_if_there() -> None:
    """Send Ray's auth token when this machine has one and RAY_AUTH_MODE is unset.

    Since Ray 2.60 `ray start --head` turns token authentication on by default and saves the token
    in ~/.ray/auth_token, but a driver that connects to that head with `ray.init(address=...)` sends
    no token unless RAY_AUTH_MODE=token: it retried for 20 s printing "InvalidAuthToken" and failed.
    Setting the mode (never the token: Ray reads it from its own file or RAY_AUTH_TOKEN[_PATH]) makes
    the driver, and the trials it starts, authenticate; an explicit RAY_AUTH_MODE is respected.
    """
    if "RAY_AUTH_MODE" in os.environ:
        return
    sources = [os.environ.get("RAY_AUTH_TOKEN"), os.environ.get("RAY_AUTH_TOKEN_PATH"),
               (Path.home() / ".ray" / "auth_token").is_file() or None]
    if any(sources):
        os.environ["RAY_AUTH_MODE"] = "token"


def probe(address: str) -> None:
    """Fail fast, in one line, when nothing listens at HOST:PORT (or ray://HOST:PORT)."""
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"--address must be auto, HOST:PORT or ray://HOST:PORT; got {address!r}.")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise ConfigError(f"the Ray cluster at {address!r} cannot be reached ({err.strerror or err}); start it "
                          f"(`ray start --head --port {port}` on {host}) or pass --address of a running cluster.") from None


def check_cluster(nodes: Sequence[Mapping[str, Any]], track: TrackingConfig, cpus: int, gpus: float) -> None:
    """Refuse, before anything is written, what the trials of this cluster could not do.

    On more than one node the trials write the store and MLflow from other machines: a SQLite
    store (the default one under --root included) or a file-based MLflow URI of this
    machine would be a different file on each node, so they are refused. A trial that no
    single node can hold would wait forever, so it is refused too.

    Args:
        nodes: the alive nodes, as `ray.nodes()` lists them (`Resources`: CPU, GPU, ...).

    Raises:
        ConfigError: naming the problem and the fix.
    """
    if len(nodes) > 1:
        if track.store_url.startswith("sqlite"):
            raise ConfigError(f"the store {track.store_url!r} is a SQLite file, but the trials run on the "
                              f"{len(nodes)} nodes of the Ray cluster, which cannot share it; pass --store "
                              "postgresql+psycopg://USER@HOST/DB (or set FEDCLI_STORE) with a database every node reaches.")
        if track.use_mlflow and urlsplit(track.mlflow_uri).scheme in ("", "file", "sqlite"):
            raise ConfigError(f"the MLflow tracking URI {track.mlflow_uri!r} is a local file, but the trials run on "
                              f"the {len(nodes)} nodes of the Ray cluster, which cannot share it; pass --tracking-uri "
                              "http://HOST:5000 (an `mlflow server` every node reaches) or --no-mlflow.")
    sizes = [(n.get("Resources", {}).get("CPU", 0.0), n.get("Resources", {}).get("GPU", 0.0)) for n in nodes]
    if not any(cpu >= cpus and gpu >= gpus for cpu, gpu in sizes):
        largest = max(sizes, default=(0.0, 0.0))
        raise ConfigError(f"--cpus-per-trial {cpus} --gpus-per-trial {gpus:g} fits no node of the Ray cluster "
                          f"(the largest has {largest[0]:g} CPUs and {largest[1]:g} GPUs); lower them or add a node.")


def absolute_root(trials: Sequence[sweeps.Trial]) -> list[sweeps.Trial]:
    """The trials with tracking.root made absolute (their checkpoints land there on any node)."""
    def pinned(cfg: Any) -> Any:
        return dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, root=str(Path(cfg.tracking.root).resolve())))
    return [sweeps.Trial(t.name, pinned(t.config)) for t in trials]


def first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


# --------------------------------------------------------------------------- the trial tasks


@dataclass
class RayTrial:
    """A submitted (or ended) trial task; read by the sweep's tables as a sweeps.TrialProcess."""

    plan: sweeps.Plan
    ref: Any  # the task's ObjectRef
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    run_id: str | None = None
    stopped: bool = False  # ended by the sweep's stop
    result: dict[str, Any] | None = None  # what run_trial returned
    error: str | None = None  # the Ray error that ended the task instead (cancelled, worker died)

    @property
    def elapsed_s(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    @property
    def status(self) -> str:
        if self.ended is None:
            return "running"
        code = None if self.result is None else self.result["code"]
        if code == 0:
            return "finished"
        stop_codes = {128 + s for s in sweeps.STOP_SIGNALS}
        return "interrupted" if self.stopped or code in stop_codes else "failed"

    def last_error(self) -> str:
        """The trial's last stderr line, else the Ray error, else its exit code."""
        lines = [] if self.result is None else self.result["stderr"]
        if lines:
            return str(lines[-1]).strip()
        return self.error or f"exit code {None if self.result is None else self.result['code']}"

    def locate(self, records: Sequence[RunRecord]) -> str | None:
        """The id of the run this trial trains: the one it printed, else the run of its config hash
        (planned new right before it was submitted, so none of that hash existed then)."""
        words = [] if self.result is None else " ".join(self.result["stdout"]).split()
        if words and len(words[-1]) == 32:
            return words[-1]
        key = self.plan.trial.config.config_hash
        found = [r.id for r in records if (r.tags.get("fedcli.config_hash") or r.config_hash) == key]
        return found[-1] if found else None


class RayScheduler(sweeps.Scheduler):
    """sweeps.Scheduler whose trials are Ray tasks, at most `workers` in flight."""

    def __init__(self, plans: Sequence[sweeps.Plan], *, cluster: RayCluster, workers: int, parent_run: str | None,
                 recheck: Callable[[sweeps.Plan], sweeps.Plan], read_runs: Callable[[], list[RunRecord]],
                 env: Mapping[str, str], cwd: str, claims: sweeps.TrialClaims | None = None) -> None:
        super().__init__(plans, workers=workers, cores=cluster.cpus, parent_run=parent_run, recheck=recheck,
                         claims=claims)
        self.cluster, self.read_runs, self.env, self.cwd = cluster, read_runs, dict(env), cwd
        self.processes: list[RayTrial] = []  # type: ignore[assignment]
        self._task = cluster.ray.remote(run_trial)
        self._killed = False

    def start(self, plan: sweeps.Plan) -> RayTrial:  # type: ignore[override]
        cores = self.cores
        options: dict[str, Any] = {"num_cpus": cores, "num_gpus": self.cluster.gpus, "max_retries": 0,
                                   "name": f"fedcli trial {plan.trial.name}"}
        node = self._node_of(plan)
        if node is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
        args = sweeps.trial_args(plan, CONFIG_TOKEN, cores, self.parent_run, threads=cores)
        ref = self._task.options(**options).remote(args, sweeps.trial_config_text(plan, cores, threads=cores),
                                                  self.cwd, self.env)
        trial = RayTrial(plan, ref, run_id=plan.run_id)
        self.processes.append(trial)
        return trial

    def _node_of(self, plan: sweeps.Plan) -> str | None:
        """The alive node where a resumed trial's run trained last (None: any node will do)."""
        if plan.action != sweeps.RESUME or len(self.cluster.nodes) < 2:
            return None
        host = next((r.host for r in self.read_runs() if r.id == plan.run_id), None)
        return next((n["NodeID"] for n in self.cluster.nodes if n.get("NodeManagerHostname") == host), None)

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
            try:
                trial.result = ray.get(ref)
            except ray.exceptions.RayError as err:  # cancelled, worker or node died, fedcli missing there
                trial.error = first_line(err)
            trial.ended = time.monotonic()
        return bool(ready)

    def _stop(self) -> None:
        """Cancel the running tasks once (they stop their trials in order); force it after KILL_AFTER_S."""
        now, ray = time.monotonic(), self.cluster.ray
        if self._forwarded_at is None:
            self._forwarded_at = now
            for trial in self.running:
                trial.stopped = True
                ray.cancel(trial.ref, force=False)
        elif now - self._forwarded_at > KILL_AFTER_S and not self._killed:
            self._killed = True
            for trial in self.running:
                ray.cancel(trial.ref, force=True)
