"""Sweep expansion: grid x seeds, hp.* only where the algorithm has it, finished trials skipped."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedcli.cli.main import app
from fedcli.engine.machine import available_cores
from fedcli.errors import ConfigError
from fedcli.sweep.spec import expand, load_spec
from fedcli.tracking.store.sql_store import SqlStore


def test_grid_expands_per_algorithm_hyperparameters_and_seeds() -> None:
    spec = {
        "experiment": "e",
        "base": {"task": "lsq", "rounds": 2},
        "grid": {"algo": ["fedavg", "fedpa"], "hp.rho": [0.01, 0.1]},
        "seeds": [0, 1],
    }
    trials = expand(spec)
    names = [t.name for t in trials]
    # fedavg has no rho: 1 x 2 seeds; fedpa: 2 rho x 2 seeds
    assert names == [
        "fedavg s0",
        "fedavg s1",
        "fedpa rho=0.01 s0",
        "fedpa rho=0.01 s1",
        "fedpa rho=0.1 s0",
        "fedpa rho=0.1 s1",
    ]
    assert {t.config.train.rounds for t in trials} == {2} and {
        t.config.tracking.experiment for t in trials
    } == {"e"}
    assert len({t.config.config_hash for t in trials}) == 6


def test_unknown_keys_are_named() -> None:
    with pytest.raises(ConfigError, match=r"unknown sweep key 'roundz' \(did you mean 'rounds'\?\)"):
        expand({"experiment": "e", "base": {"roundz": 3}})
    with pytest.raises(ConfigError, match=r"unknown recipe 'nope'"):
        load_spec(None, "nope")


@pytest.mark.slow
def test_sweep_runs_then_skips_finished_trials(tmp_path: Path) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text(
        "experiment: tiny\nbase: {task: lsq, rounds: 2, clients_per_round: 3}\n"
        "grid: {server_opt: [sgd, adam]}\nseeds: [0]\nreport: {metric: dist_to_opt}\n"
    )
    args = [
        "sweep",
        str(spec),
        "--no-mlflow",
        "--root",
        str(tmp_path),
        "--store",
        f"sqlite:///{tmp_path / 's.db'}",
    ]
    first = CliRunner().invoke(app, [*args, "--workers", "2"])
    assert first.exit_code == 0, first.output
    assert "sweep done: 2 finished." in first.stderr
    report = tmp_path / "reports" / "tiny.md"  # the spec's report block, default path, printed on stdout
    assert first.stdout.strip() == str(report) and "eval/dist_to_opt" in report.read_text()
    # two trials at once: each child got half the cores as train.workers
    runs = SqlStore(f"sqlite:///{tmp_path / 's.db'}").list_runs()
    assert {r.config["train"]["workers"] for r in runs} == {max(1, available_cores() // 2)}
    again = CliRunner().invoke(app, args)  # one at a time now: train.workers is not part of the hash
    assert again.exit_code == 0 and "sweep done: 2 finished (skip)." in again.stderr


def test_plan_matches_trials_to_runs_of_their_config_hash(tmp_path: Path) -> None:
    """finished -> skip; alive in a process (this one) -> running elsewhere, never started again;
    interrupted (newest of several) -> resume that run; diverged -> not retried; no run -> new."""
    from fedcli.sweep.plan import DIVERGED, ELSEWHERE, NEW, RESUME, SKIP, plan_trials

    trials = expand(
        {
            "experiment": "p",
            "base": {"task": "lsq", "rounds": 2},
            "grid": {"server_opt": ["sgd", "momentum", "adam", "adagrad", "yogi"]},
        }
    )
    db = SqlStore(f"sqlite:///{tmp_path / 'p.db'}")

    def start(trial_idx: int) -> str:
        cfg = trials[trial_idx].config
        return db.start_run(
            experiment="p",
            run_name=trials[trial_idx].name,
            config=cfg.to_dict(),
            algo="fedavg",
            task="lsq",
            seed=0,
            tags={"fedcli.config_hash": cfg.config_hash},
            fedcli_version="t",
            torch_version="t",
            git_commit=None,
        )

    db.end_run(start(0), "finished")
    start(1)  # alive: running in this process
    db.end_run(start(2), "failed", reason="older attempt")
    newest = start(2)
    db.end_run(newest, "interrupted", reason="stopped by SIGTERM during round 4")
    db.end_run(start(3), "failed", reason="non-finite", diverged_at_round=3)

    plans = plan_trials(trials, db.list_runs(experiment="p"))

    assert [p.action for p in plans] == [SKIP, ELSEWHERE, RESUME, DIVERGED, NEW]
    assert plans[2].run_id == newest and "SIGTERM" in plans[2].note


@pytest.mark.slow
def test_failed_trial_exits_1_with_its_last_stderr_line_and_is_not_retried(tmp_path: Path) -> None:
    """client_lr = 1e5 on least squares diverges: the sweep exits 1 naming the trial and quoting the
    trial's error line; a rerun does not train it again (same config and seed diverge again)."""
    spec = tmp_path / "s.yaml"
    spec.write_text(
        "experiment: div\nbase: {task: lsq, rounds: 3, clients_per_round: 3}\n"
        "grid: {client_lr: [100000.0]}\nseeds: [0]\n"
    )
    args = ["sweep", str(spec), "--no-mlflow", "--root", str(tmp_path)]

    first = CliRunner().invoke(app, args)
    again = CliRunner().invoke(app, args)

    said = " ".join(first.stderr.split())  # rich wraps long lines at 80 columns here
    assert (
        first.exit_code == 1 and "failed: fedavg client_lr=100000.0 s0: error: run diverged at round" in said
    )
    assert again.exit_code == 1 and "diverged (skip)" in again.stderr
    assert len(SqlStore(f"sqlite:///{tmp_path / 'fedcli.db'}").list_runs()) == 1


def test_scheduler_plans_a_trial_again_right_before_starting_it() -> None:
    """A trial another process took after the sweep planned it (rerun while this sweep runs) is not started."""
    from fedcli.sweep.plan import ELSEWHERE, NEW, Plan
    from fedcli.sweep.scheduler import Scheduler

    trial = expand({"experiment": "r", "base": {"task": "lsq", "rounds": 2}})[0]
    taken = Plan(trial, ELSEWHERE, "f" * 32, "pid 1 on another host")
    scheduler = Scheduler([Plan(trial, NEW)], workers=1, cores=1, recheck=lambda plan: taken)

    stopped_by = scheduler.run(lambda processes: None)
    scheduler.cleanup()

    assert stopped_by is None and scheduler.processes == [] and scheduler.plans == [taken]
