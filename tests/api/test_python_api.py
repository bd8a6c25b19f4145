"""`fedcli.train` / `load_run` / `report` as a user calls them: Python scripts in subprocesses.

Each test writes a short script, runs it with this venv's Python in a fresh process (as a notebook
kernel or `python script.py` would), and checks what it printed and what the stores hold: the
metrics frame against the store, the final model against `fedcli evaluate`, a SIGKILLed run
resumed bit-exact, a SIGTERM raising `RunInterrupted` (run `interrupted`, handlers back), the CLI's
one-line error as the exception's message with nothing written, the process left as it was after
two trainings (signal handlers, threads, torch settings, RNG states, no child process), and a model
file and a torch Dataset of the user's trained through the same call.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from fedcli.tracking.store.sql_store import SqlStore

TINY = dict(
    task="lsq", clients_per_round=4, no_mlflow=True
)  # 20 clients, 11 parameters: rounds take milliseconds
SMALL = dict(task="synthetic-iid", clients_per_round=5, no_mlflow=True)  # classification: accuracy is logged
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def python(script: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedcli", *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=ENV
    )


def test_train_gives_a_run_with_its_metrics_frame_and_the_model_fedcli_evaluate_scores(
    tmp_path: Path,
) -> None:
    out = python(
        f"""
        import json, torch, fedcli
        from fedcli.datasets.registry import resolve_task
        from fedcli.datasets.tasks import TaskOptions

        run = fedcli.train(algo="fedavg", rounds=3, root="runs", seed=1, **{SMALL!r})
        frame = run.metrics()
        net = run.model()
        data = resolve_task("synthetic-iid", None, None).load(TaskOptions(seed=1))
        with torch.no_grad():
            acc = (net(data.test_x).argmax(-1) == data.test_y).double().mean().item()
        again = fedcli.load_run(run.id[:8], root="runs")
        print(json.dumps({{"id": run.id, "status": run.status, "rounds": list(frame.index),
                          "acc": frame["eval/accuracy"].tolist(), "model_acc": acc,
                          "loaded": [again.id, again.status, again.config["train"]["rounds"]],
                          "training": net.training}}))
    """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["status"] == "finished" and got["rounds"] == [0, 1, 2, 3]
    assert got["loaded"] == [got["id"], "finished", 3] and got["training"] is False
    db = SqlStore(f"sqlite:///{tmp_path / 'runs' / 'fedcli.db'}")
    stored = db.metrics_frame([got["id"]], keys=["eval/accuracy"]).sort_values("round_idx")["value"].tolist()
    assert got["acc"] == stored  # the frame is the store's rows, pivoted

    evaluated = cli("evaluate", got["id"][:8], "--root", "runs", "--json", "--no-mlflow", cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr
    assert abs(json.loads(evaluated.stdout)["metrics"]["test/accuracy"] - got["model_acc"]) < 1e-6
    assert abs(got["model_acc"] - got["acc"][-1]) < 1e-6  # and both equal the run's last logged accuracy


def test_a_sigkilled_run_resumed_through_the_api_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    reference = python(
        f"""
        import fedcli
        print(fedcli.train(rounds=150, root="ref", **{TINY!r}).id)
    """,
        tmp_path,
    )
    assert reference.returncode == 0, reference.stderr
    ref_id = reference.stdout.split()[-1]

    victim = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import fedcli, time
        def slow(round_idx, metrics):  # rounds take milliseconds: slow them down so the kill lands mid-run
            print(round_idx, flush=True)
            time.sleep(0.05)
        fedcli.train(rounds=150, root="killed", progress=slow, **{TINY!r})
    """),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    assert victim.stdout is not None
    for line in victim.stdout:
        if int(line) >= 5:
            break
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    db = SqlStore(f"sqlite:///{tmp_path / 'killed' / 'fedcli.db'}")
    (killed,) = db.list_runs()
    assert killed.status == "interrupted" and 5 <= (db.last_round(killed.id) or 0) < 150

    resumed = python(
        f"""
        import fedcli
        run = fedcli.train(resume={killed.id[:8]!r}, root="killed", no_mlflow=True)
        print(run.id, run.status, run.result.rounds_completed)
    """,
        tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.split()[-3:] == [killed.id, "finished", "150"]
    ref = torch.load(tmp_path / "ref" / "runs" / ref_id / "model.pt", weights_only=True)["params"]
    got = torch.load(tmp_path / "killed" / "runs" / killed.id / "model.pt", weights_only=True)["params"]
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_bad_input_raises_the_clis_one_line_message_and_writes_nothing(tmp_path: Path) -> None:
    cases = {
        "hp": (["--algo", "fedprox", "--hp", "mu=-1"], 'algo="fedprox", hp={"mu": -1}'),
        "task": (["--task", "femnistt"], 'task="femnistt"'),
        "clients": (["--task", "lsq", "--clients-per-round", "500"], 'task="lsq", clients_per_round=500'),
        "config": (["--config", "nope.yaml"], 'config="nope.yaml"'),
    }
    for name, (flags, call) in cases.items():
        shown = cli("train", "--root", f"cli-{name}", "--no-mlflow", *flags, cwd=tmp_path)
        assert shown.returncode == 2, (name, shown.stderr)
        line = shown.stderr.strip()
        assert line.startswith("error: ") and "\n" not in line, (name, line)
        raised = python(
            f"""
            import fedcli
            try:
                fedcli.train(root="api-{name}", no_mlflow=True, {call})
            except fedcli.ConfigError as err:
                print(type(err).__name__, str(err))
        """,
            tmp_path,
        )
        assert raised.returncode == 0, (name, raised.stderr)
        assert " ".join(raised.stdout.split()) == "ConfigError " + " ".join(
            line.removeprefix("error: ").split()
        ), name
        assert not (tmp_path / f"api-{name}").exists() and not (tmp_path / f"cli-{name}").exists(), name
    unknown = python(
        """
        import fedcli
        try:
            fedcli.train(roundz=3)
        except fedcli.ConfigError as err:
            print(err)
    """,
        tmp_path,
    )
    assert "unknown setting 'roundz' (did you mean 'rounds'?)" in unknown.stdout, unknown.stderr


def test_two_trainings_in_one_process_leave_it_as_they_found_it(tmp_path: Path) -> None:
    """Signal handlers, threads, torch's thread count, TF32/deterministic flags and RNG states are put
    back, and no MLflow mirror process outlives a call (the second run logs to MLflow)."""
    out = python(
        f"""
        import json, os, random, signal, threading, numpy as np, torch, fedcli

        def mine(signum, frame):
            pass

        signal.signal(signal.SIGTERM, mine)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        torch.set_num_threads(2)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = False
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.manual_seed(7); np.random.seed(7); random.seed(7)

        def state():
            kids = open(f"/proc/{{os.getpid()}}/task/{{os.getpid()}}/children").read().split()
            return {{"term": signal.getsignal(signal.SIGTERM) is mine,
                    "hup": signal.getsignal(signal.SIGHUP) == signal.SIG_IGN,
                    "int": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                    "threads": sorted(t.name for t in threading.enumerate()), "torch": torch.get_num_threads(),
                    "tf32": [torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32],
                    "det": [torch.are_deterministic_algorithms_enabled(),
                            torch.is_deterministic_algorithms_warn_only_enabled()],
                    "rng": [torch.get_rng_state().sum().item(), int(np.random.get_state()[1].sum()),
                            random.getstate()[1][:3]],
                    "children": kids}}

        before = state()
        first = fedcli.train(rounds=2, root="runs", threads=1, precision="fp32", **{TINY!r})
        second = fedcli.train(rounds=2, root="runs", threads=1, task="lsq", clients_per_round=4)  # with MLflow
        after = state()
        print(json.dumps({{"before": before, "after": after, "status": [first.status, second.status],
                          "mlflow": second.config["tracking"]["use_mlflow"]}}))
    """,
        tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["status"] == ["finished", "finished"] and got["mlflow"] is True
    assert got["before"] == got["after"]
    assert got["after"]["term"] and got["after"]["hup"] and got["after"]["torch"] == 2
    assert got["after"]["children"] == []


def test_your_model_file_and_a_torch_dataset_train_through_the_api(tmp_path: Path) -> None:
    """A model factory in a file of the user's and a map-style torch Dataset with a client id per example
    (fedcli.datasets.yours.model / user_data do the work; the API passes them through)."""
    (tmp_path / "mynet.py").write_text(
        textwrap.dedent("""
        from torch import nn

        def Net(num_classes, input_shape):
            return nn.Sequential(nn.Linear(input_shape[0], 16), nn.ReLU(), nn.Linear(16, num_classes))
    """)
    )
    out = python(
        """
        import json, torch, fedcli
        from torch.utils.data import TensorDataset

        g = torch.Generator().manual_seed(0)
        x = torch.randn(400, 6, generator=g)
        ds = TensorDataset(x, (x[:, 0] > 0).long())
        run = fedcli.train(algo="fedavg", model="mynet.py:Net", data=ds, rounds=2, clients_per_round=4, root="runs",
                           data_options={"client": [i % 8 for i in range(400)], "name": "toy"}, no_mlflow=True)
        with torch.no_grad():
            logits = run.model()(x[:5])
        print(json.dumps({"status": run.status, "task": run.config["data"]["task"], "model": run.config["data"]["model"],
                          "rounds": list(run.metrics().index), "logits": list(logits.shape)}))
    """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["status"] == "finished" and got["task"] == "byo-toy" and got["rounds"] == [0, 1, 2]
    assert got["model"] == f"{tmp_path / 'mynet.py'}:Net" and got["logits"] == [5, 2]


def test_sigterm_during_training_raises_run_interrupted_and_the_handlers_come_back(tmp_path: Path) -> None:
    victim = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import signal, time, fedcli
        from fedcli.engine.lifecycle import RunInterrupted

        def slow(round_idx, metrics):
            print(round_idx, flush=True)
            time.sleep(0.05)
        try:
            fedcli.train(rounds=400, root="runs", progress=slow, **{TINY!r})
        except RunInterrupted as stop:
            print("stopped", stop.exit_code, signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
    """),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    assert victim.stdout is not None
    for line in victim.stdout:
        if int(line) >= 3:
            break
    victim.send_signal(signal.SIGTERM)
    rest, err = victim.communicate(timeout=60)
    assert victim.returncode == 0, err
    assert rest.splitlines()[-1] == "stopped 143 True"
    (run,) = SqlStore(f"sqlite:///{tmp_path / 'runs' / 'fedcli.db'}").list_runs()
    assert run.status == "interrupted"
