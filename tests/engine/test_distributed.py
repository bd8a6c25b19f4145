"""`--executor distributed`: one run over torch.distributed ranks equals the single-process run.

Two Gloo ranks on loopback (torch.multiprocessing spawn, and once `torchrun` itself). Rank 0
plans every client's round from the run's seed and sends each rank its slice with the
clients' states (engine/distributed.py); the client code sees the same inputs as in one
process, so after two rounds (state crosses rounds, client sizes differ) the global
parameters, the client states and every round's metrics equal the single-process `loop`
reference to float tolerance, for every registered algorithm (rank 0's DistributedBackend and
the other ranks' `serve`, engine/backends/distributed.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils import _pytree as pytree
from typer.testing import CliRunner

from fedcli.algorithms import ALGORITHMS
from fedcli.cli.main import app
from fedcli.config.build import build_config
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.rounds import Timing, run_round
from fedcli.engine.setup import build
from fedcli.tracking.store.sql_store import SqlStore

REPO = Path(__file__).resolve().parents[2]
TOL = {"rtol": 1e-4, "atol": 1e-5}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(rank: int, port: int, world: int = 2) -> dict[str, str]:
    """What torchrun sets for each rank (single host)."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
    }


def cases() -> list[tuple[str, str, dict]]:
    """(algorithm, task, extra overrides): every algorithm on lsq (LSA-only ones on a Garnet task),
    and FedAvg on a small FEMNIST MLP, where each rank runs the `fused` executor."""
    from tests.engine.test_equivalence import pick_task

    out = [(algo, pick_task(algo), {}) for algo in ALGORITHMS]
    out.append(("fedavg", "femnist", {"partition.num_clients": 6, "train.client_momentum": 0.9}))
    return out


def two_rounds(
    algo: str, task: str, extra: dict, executor: str, peers: object = None
) -> tuple[dict, dict, list]:
    """Run two rounds; return (global params, client states, per-round metrics without timings)."""
    from tests.engine.test_equivalence import required_hyperparameters

    hp = {"burn_in_rounds": 1} if algo == "fedpa" else {}
    hp.update(required_hyperparameters(algo))
    cfg = build_config(
        overrides={
            "algorithm.name": algo,
            "data.task": task,
            "train.executor": executor,
            "train.device": "cpu",
            "train.clients_per_round": 4,
            "train.local_epochs": 2,
            "train.batch_size": 16,
            "train.client_lr": 0.01,
            **extra,
        },
        hp=hp,
    )
    setup = build(cfg, peers=peers)
    assert setup.executor == executor or executor != "distributed"
    state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    init = setup.alg.init_client_state
    store = ClientStateStore(None if init is None else (lambda: init(setup.init_params, setup.hp)))
    history = []
    for round_idx in (1, 2):
        state, metrics = run_round(setup, state, store, round_idx, Timing())
        history.append({k: v for k, v in metrics.items() if not k.startswith("time/")})
    return setup.alg.global_params(state), store.state_dict(), history


def _equivalence_rank(rank: int, port: int) -> None:
    """One rank of test_every_algorithm_equals_the_single_process_run (spawned)."""
    from fedcli.engine.distributed import process_group
    from fedcli.engine.train import serve

    os.environ.update(rank_env(rank, port))
    torch.set_num_threads(1)
    with process_group(timeout_s=120) as peers:
        if not peers.is_leader:
            serve(peers)
            return
        for algo, task, extra in cases():
            ref_params, ref_states, ref_metrics = two_rounds(algo, task, extra, "loop")
            params, states, metrics = two_rounds(algo, task, extra, "distributed", peers)
            for key in ref_params:
                torch.testing.assert_close(
                    params[key], ref_params[key], **TOL, msg=lambda m, a=algo: f"{a}: {m}"
                )
            assert states.keys() == ref_states.keys(), algo
            for client in ref_states:
                pytree.tree_map(
                    lambda a, b: torch.testing.assert_close(b, a, **TOL), ref_states[client], states[client]
                )
            for got, want in zip(metrics, ref_metrics, strict=True):
                assert got.keys() == want.keys(), algo
                for key in want:
                    assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (algo, key)


def test_every_algorithm_equals_the_single_process_run() -> None:
    """Two ranks (Gloo, loopback): for every algorithm, two rounds of 4 clients split over the
    ranks give the single-process loop's parameters, client states and metrics."""
    mp.spawn(_equivalence_rank, args=(free_port(),), nprocs=2, join=True)


LEAVE_GROUP = """
import os, sys, torch
assert "torch._dynamo" not in sys.modules  # else torch.func.grad below would not import it late
from fedcli.engine.distributed import process_group
with process_group(timeout_s=60):
    torch.func.grad(lambda w: (w * w).sum())(torch.ones(3))  # a local step: imports torch._dynamo
left = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
print(" ".join(left))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from Linux's /proc")
def test_leaving_the_group_stops_gloo_threads_even_after_a_local_step(tmp_path: Path) -> None:
    """`process_group` leaves no Gloo thread behind once a rank has taken a gradient step.

    torch.func.grad imports torch._dynamo, which imports torch.distributed.nn.functional, whose
    defaults bind `group.WORLD`: imported after the group exists, they kept it alive past
    destroy_process_group, and rank 0 aborted at exit in about one torchrun launch in four."""
    port = free_port()
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", LEAVE_GROUP],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **rank_env(rank, port)},
        )
        for rank in (0, 1)
    ]
    for rank, proc in enumerate(ranks):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (rank, err[-2000:])
        threads = out.split()
        assert threads and not [t for t in threads if "gloo" in t], (rank, threads)


def test_outside_torchrun_it_exits_2_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(
        app, ["train", "--task", "lsq", "--executor", "distributed", "--no-mlflow", "--root", str(tmp_path)]
    )
    assert result.exit_code == 2, result.output
    assert "torchrun --nproc-per-node K -m fedcli train" in result.stderr and "Traceback" not in result.output
    assert result.stderr.count("error:") == 1
    assert not (tmp_path / "fedcli.db").exists()


def fedcli(*args: str, env: dict | None = None, **kwargs: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fedcli", "-q", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        **kwargs,
    )


TRAIN = ["train", "--task", "lsq", "--algo", "scaffold", "--clients-per-round", "5", "--local-epochs", "2"]


def test_torchrun_launch_makes_one_run_equal_to_the_single_process_run(tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 -m fedcli train ... --executor distributed`: one run id on stdout,
    one run in the SQL store and in MLflow (only rank 0 tracks), one run folder, and the same
    per-round metrics as `fedcli train` in one process."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = [*TRAIN, "--rounds", "3", "--tracking-uri", uri]
    launch = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "fedcli",
            "-q",
            *common,
            "--root",
            str(tmp_path / "dist"),
            "--executor",
            "distributed",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert launch.returncode == 0, launch.stderr[-3000:]
    single = fedcli(*common, "--root", str(tmp_path / "one"))
    out, err = single.communicate(timeout=120)
    assert single.returncode == 0, err[-3000:]
    run_ids = launch.stdout.split()
    assert len(run_ids) == 1, launch.stdout
    store = SqlStore(f"sqlite:///{tmp_path / 'dist' / 'fedcli.db'}")
    runs = store.list_runs()
    assert [r.id for r in runs] == run_ids and runs[0].status == "finished"
    assert runs[0].tags.get("fedcli.executor") == "distributed" and runs[0].config["train"]["workers"] == 2
    assert [p.name for p in (tmp_path / "dist" / "runs").iterdir()] == run_ids
    experiments = MlflowClient(uri).search_experiments()
    mlflow_runs = MlflowClient(uri).search_runs([e.experiment_id for e in experiments])
    assert len(mlflow_runs) == 2  # this run and the single-process one: one each
    dist_frame = store.metrics_frame(run_ids)
    one = SqlStore(f"sqlite:///{tmp_path / 'one' / 'fedcli.db'}")
    one_frame = one.metrics_frame([one.list_runs()[0].id])
    keep = lambda f: f[~f["key"].str.startswith("time/")].sort_values(["key", "round_idx"])  # noqa: E731
    a, b = keep(dist_frame), keep(one_frame)
    assert a["key"].tolist() == b["key"].tolist() and a["round_idx"].tolist() == b["round_idx"].tolist()
    assert a["value"].to_numpy() == pytest.approx(b["value"].to_numpy(), rel=1e-4, abs=1e-6)


def test_a_lost_rank_fails_the_run_with_one_line_and_it_resumes(tmp_path: Path) -> None:
    """Rank 1 is killed (SIGKILL) mid-run: rank 0 ends with one `error:` line naming the lost
    rank and exit code 2, the run is marked failed, and `--resume` on two new ranks continues it
    from its newest checkpoint to the end."""
    port = free_port()
    args = [*TRAIN, "--rounds", "100000", "--no-mlflow", "--root", str(tmp_path), "--executor", "distributed"]
    ranks = [fedcli(*args, env=rank_env(rank, port)) for rank in (0, 1)]
    deadline = time.monotonic() + 90
    while not list((tmp_path / "runs").glob("*/checkpoints/round-*.pt")) and time.monotonic() < deadline:
        assert ranks[0].poll() is None, ranks[0].communicate()
        time.sleep(0.05)
    ranks[1].send_signal(signal.SIGKILL)
    out, err = ranks[0].communicate(timeout=60)
    ranks[1].communicate(timeout=10)
    assert ranks[0].returncode == 2, err[-3000:]
    assert "Traceback" not in err and err.count("error:") == 1, err[-3000:]
    assert "lost contact with another of the 2 ranks" in " ".join(err.split())
    store = SqlStore(f"sqlite:///{tmp_path / 'fedcli.db'}")
    (run,) = store.list_runs()
    assert run.status == "failed"
    last = max(r for r, _ in store.checkpoints(run.id))
    port = free_port()
    resumed = [
        fedcli(
            "train",
            "--resume",
            run.id,
            "--root",
            str(tmp_path),
            "--executor",
            "distributed",
            "--no-mlflow",
            "--rounds",
            str(last + 2),
            env=rank_env(rank, port),
        )
        for rank in (0, 1)
    ]
    outs = [rank.communicate(timeout=120) for rank in resumed]
    assert [rank.returncode for rank in resumed] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    assert outs[0][0].split() == [run.id] and outs[1] == ("", "")  # rank 1 prints nothing
    assert store.get_run(run.id).status == "finished"
    assert sorted(store.metrics_frame([run.id], keys=["train/loss"])["round_idx"]) == list(range(1, last + 3))


def test_a_user_error_on_rank_0_stops_every_rank(tmp_path: Path) -> None:
    """A data-dependent mistake found by rank 0 (more clients per round than clients): rank 0 prints
    the usual one line and exits 2; rank 1, waiting for the run's config, is told to stop and exits
    0 without output; nothing is written."""
    port = free_port()
    args = [
        "train",
        "--task",
        "lsq",
        "--clients-per-round",
        "50",
        "--no-mlflow",
        "--root",
        str(tmp_path),
        "--executor",
        "distributed",
    ]
    ranks = [fedcli(*args, env=rank_env(rank, port)) for rank in (0, 1)]
    (out0, err0), (out1, err1) = (rank.communicate(timeout=60) for rank in ranks)
    assert [rank.returncode for rank in ranks] == [2, 0], err0 + err1
    assert "train.clients_per_round=50 exceeds the 20 clients" in err0 and "Traceback" not in err0 + err1
    assert (out0, out1, err1) == ("", "", "")
    assert not (tmp_path / "fedcli.db").exists()


def test_ctrl_c_under_torchrun_checkpoints_the_run_and_it_resumes(tmp_path: Path) -> None:
    """Ctrl-C in the terminal (SIGINT to torchrun and both ranks, one process group): rank 0 ends
    the run as in one process (last completed round checkpointed, `interrupted`, the resume
    command printed, no traceback from fedcli), rank 1 leaves when told, and `--resume ...
    --executor auto` continues the run under its id in one process."""
    args = [*TRAIN, "--rounds", "100000", "--no-mlflow", "--root", str(tmp_path), "--executor", "distributed"]
    launch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "fedcli",
            "-q",
            *args,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not list((tmp_path / "runs").glob("*/checkpoints/round-*.pt")) and time.monotonic() < deadline:
        assert launch.poll() is None, launch.communicate()
        time.sleep(0.05)
    os.killpg(launch.pid, signal.SIGINT)
    out, err = launch.communicate(timeout=120)
    # torchrun itself prints its SignalException's traceback on SIGINT; none may come from fedcli
    assert not [line for line in err.splitlines() if 'File "' in line and "fedcli" in line], err[-3000:]
    store = SqlStore(f"sqlite:///{tmp_path / 'fedcli.db'}")
    (run,) = store.list_runs()
    assert run.status == "interrupted" and "SIGINT" in (run.failure_reason or ""), (
        run.status,
        run.failure_reason,
    )
    hint = " ".join(err.split())
    assert f"torchrun --nproc-per-node 2 -m fedcli train --resume {run.id[:8]}" in hint, err[-3000:]
    assert f"train --resume {run.id[:8]}" in hint and "--executor auto" in hint, err[-3000:]
    last = max(r for r, _ in store.checkpoints(run.id))
    one = fedcli(
        "train",
        "--resume",
        run.id,
        "--root",
        str(tmp_path),
        "--executor",
        "auto",
        "--no-mlflow",
        "--rounds",
        str(last + 2),
    )  # the hint's second form: the checkpoint is a single process's
    out, err = one.communicate(timeout=120)
    assert one.returncode == 0 and out.split() == [run.id], err[-3000:]
    assert store.get_run(run.id).status == "finished"
    assert sorted(store.metrics_frame([run.id], keys=["train/loss"])["round_idx"]) == list(range(1, last + 3))
