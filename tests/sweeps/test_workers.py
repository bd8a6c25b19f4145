"""Long-lived sweep workers (fedcli/sweep/worker.py, worker_pool.py), checked with real processes:
`python -m fedcli sweep` on a fresh `--root`, its workers killed and signalled for real, the stores read back.

- one worker runs several trials, each a complete run of its own (id, config hash, status,
  checkpoints) with metrics bit-equal to the same trial run alone by `fedcli train`;
- each trial gets cores / --workers intra-op threads, recorded in its resolved config;
- a trial that raises costs that trial only (the worker goes on); a SIGKILLed worker costs the
  trial it ran (a new worker takes the next, the sweep goes on, a rerun resumes the killed one);
- SIGTERM to the sweep stops its trial in order (143, checkpointed, `interrupted`) and a rerun
  trains only what is missing;
- with MLflow on, the sweep runs one MLflow mirror process, not one per trial, and MLflow gets
  every trial as a nested child;
- with a trial source (the `search:` interface of docs/sweeps.md), the scheduler asks it for the
  trials and tells it each outcome (status, run id, reason, round, final metrics) once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedcli.engine.machine import available_cores
from tests.reliability.test_sweep_reliability import (
    ROUNDS_NEVER_REACHED,
    finish,
    gone,
    one_run_per_hash,
    run_at_round,
    runs,
    store,
    sweep,
    wait_for,
)

pytestmark = pytest.mark.timeout(600)
TIMING_KEYS = ("time/",)  # wall-clock metrics: the only ones that may differ between two runs of one config


def write_spec(folder: Path, name: str, base: str, grid: str, seeds: str = "[0]") -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(f"experiment: {name}\nbase: {{{base}}}\ngrid: {{{grid}}}\nseeds: {seeds}\n")
    return path


def values(root: Path, run_id: str) -> dict[tuple[int, str], float]:
    """Every round metric of the run but wall-clock times: (round, key) -> value."""
    frame = store(root).metrics_frame([run_id])
    return {
        (int(r), str(k)): float(v)
        for r, k, v in zip(frame["round_idx"], frame["key"], frame["value"], strict=True)
        if not str(k).startswith(TIMING_KEYS)
    }


def test_one_worker_runs_every_trial_as_its_own_run_bit_equal_to_fedcli_train(tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path, "w-one", "task: lsq, rounds: 4, clients_per_round: 4", "algo: [fedavg, fedprox]", "[0, 1]"
    )
    code, err = finish(sweep(tmp_path, spec, "--workers", "1", "--no-mlflow"))
    assert code == 0, err
    records = runs(tmp_path)
    by_hash = one_run_per_hash(records)
    assert len(by_hash) == 4 and {r.status for r in records} == {"finished"}
    assert len({r.id for r in records}) == 4
    assert len({r.pid for r in records}) == 1, "one long-lived worker trains every trial"
    assert all(store(tmp_path).checkpoints(r.id) for r in records), "each trial checkpoints as its own run"
    threads = available_cores()  # --workers 1: the whole share
    assert {r.config["train"]["threads"] for r in records} == {threads}
    # the last trial the worker ran (it inherited the process from three trials before it) equals a fresh
    # `fedcli train` of the same config with the same threads, value for value
    last = max(records, key=lambda r: r.created_at)
    alone = tmp_path / "alone"
    alone.mkdir()
    train = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            "--task",
            "lsq",
            "--rounds",
            "4",
            "--clients-per-round",
            "4",
            "--algo",
            last.algo,
            "--seed",
            str(last.seed),
            "--threads",
            str(threads),
            "--root",
            str(alone),
            "--no-mlflow",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert train.returncode == 0, train.stderr
    (single,) = runs(alone)
    assert single.config_hash == last.config_hash
    swept, solo = values(tmp_path, last.id), values(alone, single.id)
    assert len(swept) >= 4 * 2 and swept == solo


def test_workers_share_the_cores_and_a_trial_that_raises_costs_only_that_trial(tmp_path: Path) -> None:
    # client_lr 1e30 diverges in round 1: the engine raises, marks the run failed; the other trials finish
    spec = write_spec(
        tmp_path, "w-raise", "task: lsq, rounds: 3, clients_per_round: 4", "client_lr: [0.01, 1.0e+30, 0.02]"
    )
    code, err = finish(sweep(tmp_path, spec, "--workers", "2", "--no-mlflow"))
    assert code == 1, err
    records = runs(tmp_path)
    assert sorted(r.status for r in records) == ["failed", "finished", "finished"], err
    (bad,) = [r for r in records if r.status == "failed"]
    assert bad.diverged_at_round == 1 and "failed" in err
    assert {r.config["train"]["threads"] for r in records} == {max(1, available_cores() // 2)}
    assert len({r.pid for r in records}) <= 2, "at most --workers worker processes"
    assert "2 finished" in err and "1 failed" in err


def test_a_sigkilled_worker_costs_its_trial_only_and_a_rerun_resumes_it(tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path,
        "w-kill",
        "task: lsq, clients_per_round: 4, local_epochs: 2, batch_size: 5",
        f"rounds: [{ROUNDS_NEVER_REACHED}, 3]",
    )
    proc = sweep(tmp_path, spec, "--workers", "1", "--no-mlflow")
    try:
        long_run = wait_for("the long trial at round 2", run_at_round(tmp_path, 2))
        os.kill(long_run.pid, signal.SIGKILL)
        code, err = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 1, err
    assert "killed by SIGKILL" in err
    by_id = {r.id: r for r in runs(tmp_path)}
    assert by_id[long_run.id].status == "interrupted"  # its process died: a rerun resumes it
    (short,) = [r for r in by_id.values() if r.id != long_run.id]
    assert short.status == "finished" and short.pid != long_run.pid, "a new worker ran the next trial"
    rerun = sweep(tmp_path, spec, "--workers", "1", "--no-mlflow", "--dry-run")
    code, out = finish(rerun)
    assert code == 0 and "resume" in out and "finished (skip)" in out


def test_sigterm_stops_the_sweep_in_order_and_a_rerun_trains_only_what_is_missing(tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path,
        "w-term",
        "task: lsq, clients_per_round: 4, local_epochs: 2, batch_size: 5",
        f"rounds: [3, {ROUNDS_NEVER_REACHED}]",
    )
    proc = sweep(tmp_path, spec, "--workers", "1", "--no-mlflow")
    try:  # the 3-round trial runs first, in the same worker; the long one is stopped past its round 3
        long_run = wait_for("the long trial at round 4", run_at_round(tmp_path, 4))
        proc.send_signal(signal.SIGTERM)
        code, err = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 143, err
    by_id = {r.id: r for r in runs(tmp_path)}
    stopped = by_id[long_run.id]
    assert stopped.status == "interrupted" and "SIGTERM" in (stopped.failure_reason or "")
    assert store(tmp_path).checkpoints(stopped.id), "the stopped trial checkpointed its last round"
    assert wait_for("the worker to exit", lambda: gone(long_run.pid), timeout=30)
    (done,) = [r for r in by_id.values() if r.id != long_run.id]
    assert done.status == "finished"
    code, out = finish(sweep(tmp_path, spec, "--workers", "1", "--no-mlflow", "--dry-run"))
    assert code == 0 and f"resume {long_run.id[:8]}" in out and "finished (skip)" in out


def parent_of(pid: int) -> int:
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _module_of(pid: int) -> str | None:
    """The fedcli.tracking.mlflow.* module (a mirror process) `pid` runs, if any."""
    try:
        argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((a.decode() for a in argv if a.startswith(b"fedcli.tracking.mlflow.")), None)


def mirrors(ancestor: int) -> set[tuple[int, str]]:
    """The MLflow mirror processes now running below `ancestor` (the sweep): (pid, module)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            module = next((a.decode() for a in argv if a.startswith(b"fedcli.tracking.mlflow.")), None)
            pid, up = int(entry.name), int(entry.name)
            if module is not None and module == _module_of(parent_of(pid)):
                continue  # a child the mirror forked (before its exec it shows the mirror's argv), not a second mirror
            for _ in range(8):  # mirror -> (worker ->) sweep
                up = parent_of(up)
                if up in (0, 1, ancestor):
                    break
            if module is not None and up == ancestor:
                found.add((pid, module))
    return found


def test_one_mlflow_mirror_per_sweep_and_every_trial_a_nested_child(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    spec = write_spec(
        tmp_path,
        "w-mirror",
        "task: lsq, rounds: 3, clients_per_round: 4",
        "algo: [fedavg, fedprox]",
        "[0, 1]",
    )
    proc = sweep(tmp_path, spec, "--workers", "2")
    seen: set[tuple[int, str]] = set()
    while proc.poll() is None:
        seen |= mirrors(proc.pid)
        time.sleep(0.05)
    code, err = finish(proc)
    assert code == 0, err
    assert len(seen) == 1 and next(iter(seen))[1] == "fedcli.tracking.mlflow.sweep_mirror", seen
    records = runs(tmp_path)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("w-mirror")
    assert experiment is not None
    found = client.search_runs([experiment.experiment_id])
    parents = [r for r in found if r.data.tags.get("fedcli.kind") == "sweep"]
    trials = {r.data.tags.get("fedcli.run_id"): r for r in found if r not in parents}
    assert len(parents) == 1 and set(trials) == {r.id for r in records}
    for record in records:
        mlflow_run = trials[record.id]
        assert mlflow_run.info.status == "FINISHED"
        assert mlflow_run.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id
        assert mlflow_run.data.metrics, "the rounds were copied"


class ListSource:
    """A trial source of fixed plans (the shape of fedcli.sweep.search_source.SearchSource): ask, tell, hook."""

    def __init__(self, plans: list) -> None:
        self.left, self.told, self.asked = list(plans), [], 0

    @property
    def exhausted(self) -> bool:
        return not self.left

    def ask(self):  # noqa: ANN201
        self.asked += 1
        return self.left.pop(0) if self.left else None

    def tell(self, plan, outcome) -> None:  # noqa: ANN001
        self.told.append((plan.trial.name, outcome))

    def hook(self, plan) -> None:  # noqa: ANN001
        return None


def test_the_scheduler_asks_its_source_for_trials_and_tells_it_each_outcome(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedcli.sweep.plan import NEW, Plan
    from fedcli.sweep.scheduler import TrialClaims
    from fedcli.sweep.spec import expand
    from fedcli.sweep.worker_pool import WorkerScheduler
    from fedcli.tracking.store.sql_store import SqlStore

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    body = {
        "experiment": "w-source",
        "base": {"task": "lsq", "rounds": 2, "clients_per_round": 4},
        "grid": {"client_lr": [0.01, 1.0e30]},
        "seeds": [0],
    }
    trials = expand(body, {"tracking.root": str(tmp_path), "tracking.use_mlflow": False})
    source = ListSource([Plan(t, NEW) for t in trials])
    db = SqlStore(f"sqlite:///{tmp_path / 'fedcli.db'}")
    scheduler = WorkerScheduler(
        [], workers=1, cores=1, threads=1, source=source, claims=TrialClaims(db, "w-source")
    )
    try:
        assert scheduler.run(lambda processes: None, tick_s=0.5) is None
    finally:
        scheduler.cleanup()
    outcomes = dict(source.told)
    assert [name for name, _ in source.told] == [t.name for t in trials]  # once each, in order
    good, bad = outcomes[trials[0].name], outcomes[trials[1].name]
    assert good.status == "finished" and good.round == 2 and "eval/dist_to_opt" in good.metrics
    assert bad.status == "failed" and "diverged" in bad.reason and bad.run_id is not None
    assert {r.id: r.status for r in db.list_runs()} == {good.run_id: "finished", bad.run_id: "failed"}
    assert len(scheduler.plans) == 2  # the asked plans join the table's


def test_the_worker_started_early_runs_the_first_trial_with_the_urls_password_sent_over_its_pipe(
    tmp_path: Path, pg_database, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    """`spawn_early` (what `fedcli sweep` calls before it imports torch) starts a worker with the sweep's
    environment, which holds no FEDCLI_STORE; the scheduler adopts it for its first trial (the same
    process) and sends the store URL's password with each trial (`trial_secrets`), never on a command
    line: trials against a PostgreSQL store whose URL carries a password finish there (without it the
    worker would stop with "tracking.store must carry its password")."""
    from fedcli import children
    from fedcli.sweep.plan import NEW, Plan
    from fedcli.sweep.process import KIND, spawn_early
    from fedcli.sweep.scheduler import TrialClaims
    from fedcli.sweep.spec import expand
    from fedcli.sweep.worker_pool import WorkerScheduler
    from fedcli.tracking.store.sql_store import SqlStore
    from tests.reliability.test_files_and_secrets import PASSWORD, secret

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("FEDCLI_STORE", raising=False)
    store_url = secret(pg_database())
    spawn_early()
    early = children.early(KIND)
    assert early is not None
    assert PASSWORD.encode() not in Path(f"/proc/{early.pid}/environ").read_bytes()
    body = {
        "experiment": "w-early",
        "base": {"task": "lsq", "rounds": 2, "clients_per_round": 4},
        "seeds": [0, 1],
    }
    trials = expand(
        body, {"tracking.root": str(tmp_path), "tracking.use_mlflow": False, "tracking.store": store_url}
    )
    db = SqlStore(store_url)
    scheduler = WorkerScheduler(
        [Plan(t, NEW) for t in trials],
        workers=1,
        cores=1,
        threads=1,
        claims=TrialClaims(db, "w-early"),
    )
    try:
        assert scheduler.run(lambda processes: None, tick_s=0.5) is None
        assert [w.proc.pid for w in scheduler.pool] == [early.pid] and children.early(KIND) is None
        assert PASSWORD.encode() not in Path(f"/proc/{early.pid}/cmdline").read_bytes()
    finally:
        scheduler.cleanup()
    assert sorted(r.status for r in db.list_runs()) == ["finished", "finished"]
