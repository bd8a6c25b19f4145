"""Search sweeps (docs/sweeps.md, "Search"): a `search:` block runs Optuna trials as fedcli runs, the study in the
store's own database; a kill or a second sweep process never duplicates a trial; bad blocks exit 2 with one line;
grid sweeps keep their config hashes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedcli.cli.main import app
from fedcli.sweep.spec import expand
from fedcli.tracking.store.sql_store import SqlStore

optuna = pytest.importorskip("optuna")

BASE = "{task: lsq, rounds: %d, clients_per_round: 3, local_epochs: %d, batch_size: 5, eval_every: 1}"


def write_spec(
    folder: Path, experiment: str, trials: int, *, rounds: int = 4, local_epochs: int = 1, extra: str = ""
) -> Path:
    path = folder / f"{experiment}.yaml"
    path.write_text(
        f"experiment: {experiment}\nbase: {BASE % (rounds, local_epochs)}\n"
        f"search: {{sampler: random, trials: {trials}, metric: loss, direction: min, seed: 0,\n"
        f"         space: {{client_lr: {{log_uniform: [0.001, 0.05]}}, server_opt: [sgd, adam]}}}}\n" + extra
    )
    return path


def sweep(root: Path, spec: Path, *args: str, store: str | None = None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")}
    env.update(OMP_NUM_THREADS="1", COLUMNS="200")
    if store:
        env["FEDCLI_STORE"] = store  # the URL never on a command line
    return subprocess.Popen(
        [sys.executable, "-m", "fedcli", "sweep", str(spec), "--root", str(root), "--no-mlflow", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=root,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 400.0) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def study_of(url: str, experiment: str) -> list:
    study = optuna.load_study(study_name=f"fedcli:{experiment}", storage=url)
    return [t for t in study.get_trials() if "fedcli.void" not in t.user_attrs]


def check_trials_are_runs(db: SqlStore, url: str, experiment: str, budget: int) -> None:
    """Every counted Optuna trial ended, once, as its own fedcli run tagged with its number; no config twice."""
    trials = study_of(url, experiment)
    runs = db.list_runs(experiment=experiment)
    assert sorted(t.number for t in trials) == sorted({t.number for t in trials}) and len(trials) == budget
    assert {t.state.name for t in trials} <= {"COMPLETE", "PRUNED"}, [
        (t.number, t.state.name) for t in trials
    ]
    by_trial = {r.tags["fedcli.search_trial"]: r for r in runs}
    assert len(by_trial) == len(runs) == budget, "a trial was run twice"
    assert len({r.tags["fedcli.config_hash"] for r in runs}) == budget
    for t in trials:
        run = by_trial[str(t.number)]
        assert t.user_attrs["fedcli.run_id"] == run.id and run.status in ("finished", "pruned")
        assert run.tags["fedcli.search_study"] == f"fedcli:{experiment}"
        if t.state.name == "COMPLETE":  # the objective: the metric at the run's last round
            frame = db.metrics_frame([run.id], ["eval/loss"])
            assert t.value == pytest.approx(float(frame.sort_values("round_idx")["value"].iloc[-1]))


def test_grid_sweeps_keep_their_config_hashes() -> None:
    """Hashes computed on main before search existed (commit e2df5b6): a grid spec still makes the same trials."""
    pinned = {
        "fedavg s0": "857f85c16a3072f750d71592c7c84282d71c06a98494319300310e174d73857f",
        "fedavg s1": "49843d191ee7abc10fac478667e811e052548b7bbe6b112e86d70cd817302d78",
        "fedpa rho=0.01 s0": "5face2510453d318d92b082a3233982cf7c13314273f16767ba9c4d01f140990",
        "fedpa rho=0.1 s1": "ed1fab7d9bb92d056f8b4c57c57b7cdf2ddf793b5aa027258bc10ef2e42f1c39",
    }
    trials = {
        t.name: t.config.config_hash
        for t in expand(
            {
                "experiment": "e",
                "base": {"task": "lsq", "rounds": 2},
                "grid": {"algo": ["fedavg", "fedpa"], "hp.rho": [0.01, 0.1]},
                "seeds": [0, 1],
            }
        )
    }
    assert {name: trials[name] for name in pinned} == pinned
    femnist = {
        t.name: t.config.config_hash
        for t in expand(
            {
                "experiment": "femnist-fedpa",
                "base": {"task": "femnist", "rounds": 20, "clients_per_round": 10},
                "grid": {"algo": ["fedavg", "fedprox"], "hp.mu": [0.01]},
                "seeds": [0],
            }
        )
    }
    assert femnist == {
        "fedavg s0": "2a3e8d99591b4491372c66c16db1d41840fc344c89ea1a2a63d03f9d5003b44b",
        "fedprox mu=0.01 s0": "d1ccc84c1c7cbc6551d52a70e100521907cc1ca607ee7992919cd5a1f4f0313e",
    }


BAD = [  # (spec lines after experiment/base, what the error line names)
    (
        "search: {trials: 3, space: {client_lr: {log_uniform: [0, 1]}}}\n",
        "search.space.client_lr.log_uniform",
    ),
    ("search: {trials: 3, space: {client_lr: {normal: [0, 1]}}}\n", "search.space.client_lr must be"),
    ("search: {space: {client_lr: [0.1, 0.2]}}\n", "search.trials is required"),
    ("search: {trials: 0, space: {client_lr: [0.1]}}\n", "search.trials must be an integer >= 1"),
    ("search: {trials: 2, sampler: cmaes, space: {client_lr: [0.1]}}\n", "search.sampler must be one of"),
    ("search: {trials: 2, samplr: tpe, space: {client_lr: [0.1]}}\n", "unknown search key 'samplr'"),
    (
        "search: {trials: 2, direction: up, space: {client_lr: [0.1]}}\n",
        "search.direction must be max or min",
    ),
    (
        "search: {trials: 2, space: {client_lr: [0.1]}}\npruner: {type: mean}\n",
        "pruner must be a mapping with type",
    ),
    (
        "search: {trials: 2, space: {client_lr: [0.1]}}\npruner: {type: median, warmpu: 3}\n",
        "unknown pruner key 'warmpu'",
    ),
    ("pruner: {type: median}\n", "pruner needs a `search:` block"),
    ("search: {trials: 2, space: {client_lr: [0.1]}}\ngrid: {server_opt: [sgd]}\n", "takes no `grid:`"),
    ("search: {trials: 2, space: {client_lr: [0.1]}}\nseeds: [0, 1]\n", "search trials run one seed each"),
    ("search: {trials: 2, sampler: grid, space: {client_lr: {uniform: [0.1, 1]}}}\n", "with sampler: grid"),
    (
        "search: {trials: 2, space: {client_lr: [0.1, -1.0]}}\n",
        "client_lr",
    ),  # a corner fails the config check
    ("search: {trials: 2, space: {hp.nope: [1, 2]}}\n", "hp.nope"),
    (
        "search: {trials: 2, metric: accuracy, space: {client_lr: [0.1]}}\n",
        "search.metric 'accuracy' is not logged",
    ),
]


@pytest.mark.parametrize(("lines", "named"), BAD, ids=[b[1][:30] for b in BAD])
def test_bad_search_blocks_exit_2_with_one_line_and_write_nothing(
    tmp_path: Path, lines: str, named: str
) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text(f"experiment: bad\nbase: {BASE % (2, 1)}\n{lines}")
    result = CliRunner().invoke(app, ["sweep", str(spec), "--root", str(tmp_path / "root"), "--no-mlflow"])
    lines_out = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines_out) == 1 and named in lines_out[0] and "Traceback" not in result.output, result.stderr
    assert not (tmp_path / "root").exists()  # nothing written: no store, no study


def test_dry_run_shows_the_search_plan_and_writes_nothing(tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path, "dry", 7, extra="pruner: {type: successive_halving, warmup: 2, reduction_factor: 3}\n"
    )
    result = CliRunner().invoke(app, ["sweep", str(spec), "--root", str(tmp_path / "root"), "--dry-run"])
    assert result.exit_code == 0, result.output
    out = result.stderr
    assert "search fedcli:dry: sampler random (seed 0), 7 trials, minimise eval/loss" in out
    assert "client_lr: log_uniform in [0.001, 0.05]" in out and "server_opt: one of ['sgd', 'adam']" in out
    assert (
        "pruner: successive_halving (warmup 2, reduction_factor 3), at evaluation rounds (every 1 rounds)"
        in out
    )
    assert not (tmp_path / "root").exists()


def test_search_records_trials_as_runs_and_resumes_after_sigkill_without_duplicates(tmp_path: Path) -> None:
    """SIGKILL the sweep while a trial trains: the rerun resumes the in-flight trial (same run, same
    Optuna trial), keeps the completed ones and finishes the budget; no trial or config runs twice."""
    spec = write_spec(tmp_path, "kill", 4, rounds=12, local_epochs=3)
    url = f"sqlite:///{tmp_path / 'fedcli.db'}"
    proc = sweep(tmp_path, spec)
    deadline = time.monotonic() + 240
    live, reader = None, None
    while time.monotonic() < deadline and live is None:
        time.sleep(0.1)
        reader = reader or SqlStore.reader(url)  # one reader: a new store per poll is slow under load
        if reader is not None:
            runs = reader.list_runs()
            done = [r for r in runs if r.status in ("finished", "pruned")]
            live = next(
                (r for r in runs if r.is_alive and (reader.last_round(r.id) or 0) >= 3 and done), None
            )
    if reader is not None:
        reader.close()
    assert live is not None, "no trial reached round 3 after another ended"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    db = SqlStore(url)
    deadline = (
        time.monotonic() + 60
    )  # the worker got SIGTERM (it dies with the sweep): it checkpoints and stops
    while db.get_run(live.id).status == "running" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert db.get_run(live.id).status == "interrupted"
    running = [t.number for t in study_of(url, "kill") if t.state.name == "RUNNING"]
    assert running, "the killed trial stays RUNNING in the study for the rerun"
    code, err = finish(sweep(tmp_path, spec))
    assert code == 0, err
    assert db.get_run(live.id).status in ("finished", "pruned")  # resumed, not started again
    check_trials_are_runs(db, url, "kill", 4)


def test_two_sweep_processes_share_one_study(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "two", 5, rounds=3)
    url = f"sqlite:///{tmp_path / 'fedcli.db'}"
    first, second = sweep(tmp_path, spec), sweep(tmp_path, spec)
    (code1, err1), (code2, err2) = finish(first), finish(second)
    assert code1 == 0 and code2 == 0, err1 + err2
    check_trials_are_runs(SqlStore(url), url, "two", 5)


def test_search_study_on_postgresql(tmp_path: Path, pg_url: str) -> None:
    """The study lives in the PostgreSQL database of the runs (the URL given in the environment only)."""
    spec = write_spec(tmp_path, "pg", 2, rounds=2)
    code, err = finish(sweep(tmp_path, spec, store=pg_url))
    assert code == 0, err
    check_trials_are_runs(SqlStore(pg_url), pg_url, "pg", 2)
    assert not (tmp_path / "fedcli.db").exists()


def test_example_spec_runs_its_smoke_search(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "search-pruning.yaml"
    code, err = finish(sweep(tmp_path, example, "--smoke"))
    assert code == 0, err
    url = f"sqlite:///{tmp_path / 'fedcli.db'}"
    trials = study_of(url, "femnist-search-pruning-smoke")
    assert len(trials) == 3 and all(t.state.name in ("COMPLETE", "PRUNED") for t in trials)
    assert (tmp_path / "reports" / "femnist-search-pruning-smoke.md").read_text().count("## Search") == 1
