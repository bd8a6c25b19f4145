"""`fedcli train` / `fedcli list` end to end through Typer's CliRunner, with real stores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fedcli.cli.main import app
from fedcli.config.build import build_config
from fedcli.engine.train import train as run_training
from fedcli.tracking.sinks import Tracker
from fedcli.tracking.store.sql_store import SqlStore


def cli(*args: str) -> object:
    return CliRunner().invoke(app, list(args))


def store_args(tmp_path: Path) -> list[str]:
    return ["--root", str(tmp_path), "--store", f"sqlite:///{tmp_path / 's.db'}"]


def test_train_lsq_writes_store_and_prints_run_id(tmp_path: Path) -> None:
    result = cli(
        "-q",
        "train",
        "--task",
        "lsq",
        "--rounds",
        "3",
        "--no-mlflow",
        "--clients-per-round",
        "4",
        *store_args(tmp_path),
    )
    assert result.exit_code == 0, result.output
    run_id = result.stdout.strip().splitlines()[-1]
    listed = cli("list", "runs", "--json", "--store", f"sqlite:///{tmp_path / 's.db'}")
    rows = json.loads(listed.stdout)
    assert [r["id"] for r in rows] == [run_id]
    assert rows[0]["status"] == "finished" and rows[0]["algo"] == "fedavg" and rows[0]["rounds"] == 3
    frame = SqlStore(f"sqlite:///{tmp_path / 's.db'}").metrics_frame([run_id], keys=["eval/dist_to_opt"])
    assert sorted(frame["round_idx"]) == [0, 1, 2, 3]
    assert (tmp_path / "runs" / run_id / "model.pt").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--algo", "fedpx"], "unknown algorithm 'fedpx'"),
        (["train", "--hp", "rho"], "--hp must be KEY=VALUE"),
        (["train", "--algo", "fedpa", "--hp", "rho=-1"], "hp.rho must be >= 0"),
        (
            ["train", "--task", "lsq", "--clients-per-round", "50"],
            "train.clients_per_round=50 exceeds the 20 clients",
        ),
        (["train", "--store", "sqlite:////proc/forbidden/x.db"], "not writable"),
        (["train", "--resume", "nosuchrun"], "no results store at"),
        (["train", "--executor", "fused", "--task", "lsq"], "--executor fused trains dense classifiers"),
    ],
)
def test_user_errors_are_one_line_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    extra = [] if "--store" in args else ["--store", f"sqlite:///{tmp_path / 's.db'}"]
    result = CliRunner().invoke(app, [*args, *extra, "--root", str(tmp_path), "--no-mlflow"])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output
    assert result.stderr.count("\n") <= 3  # one message (rich may wrap it)


def test_list_algos_and_tasks_json() -> None:
    algos = {r["name"]: r for r in json.loads(cli("list", "algos", "--json").stdout)}
    assert algos["fedpa"]["hyperparameters"] == {"rho": 0.1, "burn_in_rounds": 100, "burn_in_epochs": 1}
    assert "arXiv:2010.05273" in algos["fedpa"]["paper"]
    assert "fused" in algos["fedpa"]["executors"] and "fused" not in algos["feddyn"]["executors"]
    tasks = {r["name"]: r for r in json.loads(cli("list", "tasks", "--json").stdout)}
    assert tasks["femnist"]["offline"] is True and tasks["femnist"]["params"] > 0


def test_help_documents_every_command() -> None:
    for command in ("train", "list", "sweep", "evaluate", "report", "ui", "partition"):
        result = cli(command, "--help")
        assert result.exit_code == 0 and "Usage" in result.output, command


class StopAt:
    """Progress callback that raises KeyboardInterrupt after round `at` is logged (a Ctrl-C)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def __call__(self, round_idx: int, metrics: dict) -> None:
        if round_idx == self.at:
            raise KeyboardInterrupt


def test_interrupt_then_resume_equals_uninterrupted_run(tmp_path: Path) -> None:
    """A run stopped in round 3 (checkpoint at round 2) and resumed ends bit-identical to an
    uninterrupted run: cohorts, batches and noise derive from (seed, round, client) only."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    overrides = {
        "algorithm.name": "fedavg",
        "data.task": "lsq",
        "train.rounds": 4,
        "train.checkpoint_every": 2,
        "train.client_momentum": 0.9,
        "train.server_opt": "adam",
        "tracking.store": url,
        "tracking.root": str(tmp_path),
        "tracking.use_mlflow": False,
    }
    cfg = build_config(overrides=overrides)
    full = run_training(cfg, tracker=Tracker(SqlStore(url)))
    with pytest.raises(KeyboardInterrupt):
        run_training(cfg, tracker=Tracker(SqlStore(url)), progress=StopAt(3))
    store = SqlStore(url)
    stopped = [r for r in store.list_runs() if r.id != full.run_id][0]
    assert stopped.status == "interrupted"
    resumed = run_training(cfg, tracker=Tracker(SqlStore(url)), resume_run_id=stopped.id)
    assert store.get_run(stopped.id).status == "finished"
    a = torch.load(full.model_path, weights_only=True)["params"]
    b = torch.load(resumed.model_path, weights_only=True)["params"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    fa, fb = store.metrics_frame([full.run_id]), store.metrics_frame([stopped.id])
    keep = ~fa["key"].str.startswith("time/")
    assert fa[keep]["value"].tolist() == fb[~fb["key"].str.startswith("time/")]["value"].tolist()


@pytest.mark.slow
def test_run_metrics_identical_in_sql_store_and_mlflow(tmp_path: Path) -> None:
    """Every round's metrics reach both stores: MLflow's history of each key has one point per
    logged round (step = round) with the same value as the SQL store; params and tags are set."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = cli(
        "-q",
        "train",
        "--task",
        "lsq",
        "--rounds",
        "3",
        "--eval-every",
        "2",
        "--tracking-uri",
        uri,
        "--experiment",
        "parity",
        *store_args(tmp_path),
    )
    assert result.exit_code == 0, result.output
    run_id = result.stdout.strip().splitlines()[-1]
    record = SqlStore(f"sqlite:///{tmp_path / 's.db'}").get_run(run_id)
    frame = SqlStore(f"sqlite:///{tmp_path / 's.db'}").metrics_frame([run_id])
    client = MlflowClient(uri)
    mlrun = client.get_run(record.mlflow_run_id)
    assert mlrun.info.status == "FINISHED"
    assert mlrun.data.params["algorithm.name"] == "fedavg" and mlrun.data.tags["fedcli.algorithm"] == "fedavg"
    for key, group in frame.groupby("key"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(record.mlflow_run_id, key))
        assert history == sorted(zip(group["round_idx"], group["value"], strict=False)), key
    assert [m.step for m in client.get_metric_history(record.mlflow_run_id, "eval/loss")] == [0, 2, 3]


def test_unusable_mlflow_store_fails_the_run_with_one_line(tmp_path: Path) -> None:
    """An MLflow store that cannot be created ends the command before anything is written: exit 2,
    one line naming the store and the fix, no SQL store, no run."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = cli(
        "-q",
        "train",
        "--task",
        "lsq",
        "--rounds",
        "2",
        "--tracking-uri",
        f"sqlite:///{blocker}/mlflow.db",
        *store_args(tmp_path),
    )
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    message = " ".join(result.stderr.split())
    assert "is a file, not a folder" in message and "--no-mlflow" in message, message
    assert not (tmp_path / "s.db").exists() and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_client_lr_defaults_to_the_tasks_and_the_run_records_it(tmp_path: Path) -> None:
    """No --client-lr: each task's tuned default runs (0.1 on femnist and mnist, where 0.01 learnt
    nothing in 50 rounds; 0.01 on lsq, where 0.1 diverges) and the resolved config records it,
    while the request keeps None; an explicit --client-lr wins."""
    tasks = {r["name"]: r for r in json.loads(cli("list", "tasks", "--json").stdout)}
    assert (tasks["femnist"]["client_lr"], tasks["mnist"]["client_lr"], tasks["lsq"]["client_lr"]) == (
        0.1,
        0.1,
        0.01,
    )
    for task, extra, want in (
        ("lsq", [], 0.01),
        ("femnist", ["--clients", "4"], 0.1),
        ("lsq", ["--client-lr", "0.03"], 0.03),
    ):
        result = cli(
            "-q",
            "train",
            "--task",
            task,
            "--rounds",
            "1",
            "--clients-per-round",
            "2",
            "--no-mlflow",
            *extra,
            *store_args(tmp_path),
        )
        assert result.exit_code == 0, result.output
        run = SqlStore(f"sqlite:///{tmp_path / 's.db'}").get_run(result.stdout.split()[-1])
        assert run.config["train"]["client_lr"] == want, (task, extra)
        assert run.requested["train"]["client_lr"] == (0.03 if extra[:1] == ["--client-lr"] else None)


@pytest.mark.slow
def test_train_takes_every_partition_option(tmp_path: Path) -> None:
    """--size-alpha (two-level), --sigma (quantity) and --balanced (dirichlet) reach the partition
    and the stored config, as with `fedcli partition`."""
    for extra, key, want in (
        (["--scheme", "two-level", "--alpha", "0.5", "--size-alpha", "2"], "size_alpha", 2.0),
        (["--scheme", "quantity", "--sigma", "0.5"], "sigma", 0.5),
        (["--scheme", "dirichlet", "--alpha", "0.5", "--balanced"], "balanced", True),
    ):
        result = cli(
            "-q",
            "train",
            "--task",
            "mnist",
            "--clients",
            "10",
            "--rounds",
            "1",
            "--clients-per-round",
            "2",
            "--no-mlflow",
            *extra,
            *store_args(tmp_path),
        )
        assert result.exit_code == 0, result.output
        run = SqlStore(f"sqlite:///{tmp_path / 's.db'}").get_run(result.stdout.split()[-1])
        assert run.config["partition"][key] == want, (extra, run.config["partition"])
