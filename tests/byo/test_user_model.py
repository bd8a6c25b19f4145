"""Your own model (`--model module:factory` / `file.py:factory`), trained through the CLI as a user would.

The models are defined only here, written into each test's folder: a 1-D CNN with GroupNorm on
HAR-shaped signals (windows of 32 steps x 9 channels, 6 activities; HAR itself is not bundled, so
the signals are synthetic, saved as an .npz), a small ResNet-style net with GroupNorm on
CIFAR-shaped uint8 images [N, 3, 32, 32], a BatchNorm net, and broken factories. Every run is a
`python -m fedcli` subprocess on its own `--root`; stores are read back with the SQL store.
docs/bring-your-own.md is the page these tests hold to.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcli.tracking.store.sql_store import SqlStore

HAR_NET = '''
import torch
from torch import nn


class SignalCNN(nn.Module):
    """Conv1d(9->8, 5) -> GroupNorm(2) -> ReLU -> mean over time -> Linear(num_classes)."""

    def __init__(self, num_classes, input_shape):
        super().__init__()
        steps, channels = input_shape[-2:]
        self.conv = nn.Conv1d(channels, 8, 5, padding=2)
        self.norm = nn.GroupNorm(2, 8)
        self.out = nn.Linear(8, num_classes)

    def forward(self, x):
        h = x.flatten(1, -3) if x.dim() > 3 else x  # [B, 1, T, C] (an .npz of [N, T, C]) -> [B, T, C]
        h = torch.relu(self.norm(self.conv(h.reshape(len(x), *h.shape[-2:]).transpose(-1, -2))))
        return self.out(h.mean(-1))


def batchnorm_net(num_classes, input_shape):
    steps, channels = input_shape[-2:]
    return nn.Sequential(nn.Flatten(1, -2), Swap(), nn.Conv1d(channels, 8, 5, padding=2), nn.BatchNorm1d(8),
                         nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(8, num_classes))


class Swap(nn.Module):
    def forward(self, x):
        return x.transpose(-1, -2)


def wrong_shape(num_classes):
    return nn.Linear(9, num_classes + 1)


def broken(**facts):
    raise ValueError("width must be even")
'''

RESNET = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(2, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(2, cout)
        self.skip = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.GroupNorm(2, cout))

    def forward(self, x):
        h = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(h)) + self.skip(x))


def make_resnet(num_classes, input_shape):
    """A two-block ResNet-style net with GroupNorm for [B, 3, 32, 32] images."""
    channels = input_shape[0]
    return nn.Sequential(nn.Conv2d(channels, 8, 3, padding=1, bias=False), nn.GroupNorm(2, 8), nn.ReLU(),
                         Block(8, 8, 1), Block(8, 16, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, num_classes))
'''


def har_data(folder: Path, n: int = 240) -> Path:
    """HAR-shaped signals [N, 32, 9] float32, 6 classes, 10 natural clients (subjects)."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 6, n)
    x = (rng.normal(size=(n, 32, 9)) + 0.5 * y[:, None, None]).astype(np.float32)
    path = folder / "har.npz"
    np.savez(path, x=x, y=y, client=np.arange(n) % 10)
    return path


def cifar_data(folder: Path, n: int = 120) -> Path:
    """CIFAR-shaped uint8 images [N, 3, 32, 32], 10 classes."""
    rng = np.random.default_rng(1)
    y = rng.integers(0, 10, n)
    x = rng.integers(0, 256, size=(n, 3, 32, 32)).astype(np.uint8)
    path = folder / "cifar.npz"
    np.savez(path, x=x, y=y)
    return path


def write(folder: Path, name: str, source: str) -> Path:
    path = folder / name
    path.write_text(source)
    return path


def fedcli(
    root: Path,
    *args: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    command: str = "train",
    popen: bool = False,
) -> subprocess.CompletedProcess[str] | subprocess.Popen[str]:
    full = {
        **{k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")},
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    argv = [sys.executable, "-m", "fedcli", "-q", command, *(["--root", str(root)] if root else []), *args]
    if popen:
        return subprocess.Popen(
            argv, cwd=cwd, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    return subprocess.run(argv, cwd=cwd, env=full, capture_output=True, text=True, timeout=300)


def store(root: Path) -> SqlStore:
    return SqlStore(f"sqlite:///{root / 'fedcli.db'}")


def final_params(root: Path, run_id: str) -> dict[str, torch.Tensor]:
    return torch.load(root / "runs" / run_id / "model.pt", weights_only=True)["params"]


def reference_and_killed(tmp_path: Path, args: list[str], rounds: int) -> tuple[str, Path, str]:
    """Train `args` uninterrupted under tmp_path/ref, then again under tmp_path/killed, SIGKILLed once round 3
    is logged (before round `rounds`): (the reference run's id, the killed run's root, its id)."""
    reference = fedcli(tmp_path / "ref", *args, cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr
    ref_id = store(tmp_path / "ref").list_runs()[0].id
    root = tmp_path / "killed"
    victim = fedcli(root, *args, cwd=tmp_path, popen=True)
    # one reader, opened once the store exists: a new SqlStore per poll (schema checks, two a poll) was slow
    # enough under load that a short run finished between round 3 and the kill
    deadline, run_id, reader = time.monotonic() + 300, None, None
    while run_id is None and time.monotonic() < deadline and victim.poll() is None:
        reader = reader or SqlStore.reader(f"sqlite:///{root / 'fedcli.db'}")
        if reader is not None:
            run_id = next((r.id for r in reader.list_runs() if (reader.last_round(r.id) or 0) >= 3), None)
        time.sleep(0.05)
    assert run_id is not None, (
        victim.communicate(timeout=30)[1][-2000:]
        if victim.poll() is not None
        else "no run reached round 3 in 300 s"
    )
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    if reader is not None:
        reader.close()
    assert (store(root).last_round(run_id) or 0) < rounds
    return ref_id, root, run_id


SMALL = ["--rounds", "2", "--clients-per-round", "3", "--no-mlflow"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("algo", "executors"),
    [("scaffold", ("loop", "vmap", "process")), ("fedpa", ("loop", "vmap")), ("fola", ("loop", "vmap"))],
)
def test_signal_cnn_trains_alike_on_every_executor(
    tmp_path: Path, algo: str, executors: tuple[str, ...]
) -> None:
    """The test's 1-D CNN, named as `file:factory` from its folder, trains under fedpa / fola /
    scaffold to the same model on loop, vmap and process; the run records the reference, the
    source's sha256 and the factory's arguments."""
    data = har_data(tmp_path)
    write(tmp_path, "signalnet.py", HAR_NET)
    params = {}
    for executor in executors:
        root = tmp_path / executor
        done = fedcli(
            root,
            "--data",
            str(data),
            "--model",
            "signalnet:SignalCNN",
            "--algo",
            algo,
            "--executor",
            executor,
            "--workers",
            "2",
            *SMALL,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr
        (run,) = store(root).list_runs()
        params[executor] = final_params(root, run.id)
        recorded = run.config["data"]
        assert recorded["model"] == f"{tmp_path / 'signalnet.py'}:SignalCNN"  # made absolute
        assert recorded["model_sha256"] == __import__("hashlib").sha256(HAR_NET.encode()).hexdigest()
        assert recorded["model_args"] == '{"input_shape": [1, 32, 9], "num_classes": 6}'
        assert run.config["train"]["executor"] == executor
    for executor in executors[1:]:
        for name, tensor in params["loop"].items():
            assert torch.allclose(params[executor][name], tensor, atol=1e-5, rtol=1e-4), (executor, name)


@pytest.mark.timeout(600)
def test_resnet_module_reference_evaluate_and_mlflow_model_rebuild_it(tmp_path: Path) -> None:
    """A ResNet-style GroupNorm net in an importable package (`cifarnets.resnet:make_resnet`, on
    PYTHONPATH) on CIFAR-shaped images, trained by fedpa with MLflow on: the MLflow params record
    the reference and its sha256; `fedcli evaluate` (from another folder) gives the run's own test
    loss; the logged MLflow model, loaded in a fresh process, gives the logits of the module built
    from model.pt's parameters."""
    package = tmp_path / "src" / "cifarnets"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    write(package, "resnet.py", RESNET)
    data = cifar_data(tmp_path)
    env = {"PYTHONPATH": str(tmp_path / "src")}
    root = tmp_path / "root"
    done = fedcli(
        root,
        "--data",
        str(data),
        "--model",
        "cifarnets.resnet:make_resnet",
        "--algo",
        "fedpa",
        "--scheme",
        "iid",
        "--clients",
        "6",
        "--rounds",
        "1",
        "--clients-per-round",
        "2",
        env=env,
    )
    assert done.returncode == 0, done.stderr
    (run,) = store(root).list_runs()
    assert run.config["data"]["model"] == "cifarnets.resnet:make_resnet"

    evaluated = fedcli(root, run.id[:8], "--json", command="evaluate", cwd=tmp_path, env=env)
    assert (
        evaluated.returncode == 2 and "--trust-code" in evaluated.stderr
    )  # the row names code: not run unasked
    evaluated = fedcli(
        root,
        run.id[:8],
        "--json",
        "--model",
        "cifarnets.resnet:make_resnet",
        command="evaluate",
        cwd=tmp_path,
        env=env,
    )
    assert evaluated.returncode == 0, evaluated.stderr
    import json

    final = store(root).metrics_frame([run.id], keys=["eval/loss"])
    assert abs(json.loads(evaluated.stdout)["metrics"]["test/loss"] - float(final["value"].iloc[-1])) < 1e-5

    probe = f'''
import json, sys, mlflow, numpy as np, torch
from mlflow import MlflowClient
mlflow.set_tracking_uri("sqlite:///{root / "mlflow.db"}")
run = MlflowClient().search_runs([e.experiment_id for e in MlflowClient().search_experiments()])[0]
(logged,) = mlflow.search_logged_models(experiment_ids=[run.info.experiment_id], output_format="list")
rows = np.load("{data}")["x"][:3]
print(json.dumps({{"params": {{k: v for k, v in run.data.params.items() if k.startswith("data.model")}},
                  "logits": mlflow.pyfunc.load_model(logged.model_uri, model_config={{"trust_code": True}}
                                                     ).predict(rows).tolist()}}))
'''
    loaded = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
        env={**os.environ, **env},
    )
    assert loaded.returncode == 0, loaded.stderr
    out = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert out["params"]["data.model"] == "cifarnets.resnet:make_resnet"
    assert out["params"]["data.model_sha256"] == run.config["data"]["model_sha256"]
    sys.path.insert(0, str(tmp_path / "src"))
    try:
        from cifarnets.resnet import make_resnet  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path / "src"))
    net = make_resnet(num_classes=10, input_shape=(3, 32, 32)).eval()
    rows = torch.from_numpy(np.load(data)["x"][:3]).float() / 255.0
    expected = torch.func.functional_call(net, final_params(root, run.id), (rows,))
    assert torch.allclose(torch.tensor(out["logits"]), expected, atol=1e-5)


@pytest.mark.timeout(600)
def test_sigkill_mid_run_then_resume_is_bit_exact(tmp_path: Path) -> None:
    """SIGKILL with round 3 logged, then --resume (from another folder): the same model, bit for
    bit, as the uninterrupted run."""
    data = har_data(tmp_path)
    write(tmp_path, "signalnet.py", HAR_NET)
    args = [
        "--data",
        str(data),
        "--model",
        "./signalnet.py:SignalCNN",
        "--algo",
        "scaffold",
        "--rounds",
        "20",
        "--clients-per-round",
        "3",
        "--checkpoint-every",
        "1",
        "--no-mlflow",
    ]
    ref_id, root, run_id = reference_and_killed(tmp_path, args, rounds=20)

    resumed = fedcli(
        root, "--resume", run_id[:8], "--model", f"{tmp_path / 'signalnet.py'}:SignalCNN", cwd="/"
    )
    assert resumed.returncode == 0, resumed.stderr
    for name, tensor in final_params(tmp_path / "ref", ref_id).items():
        assert torch.equal(final_params(root, run_id)[name], tensor), name


def test_changed_source_resume_refuses_evaluate_warns(tmp_path: Path) -> None:
    """After the model's file changed: --resume (naming the model again) refuses (exit 2, one line, the run
    untouched) unless FEDCLI_ALLOW_MODEL_CHANGE=1; `fedcli evaluate --model` warns and evaluates, while
    `--trust-code` (which trusts the recorded source only) refuses. On a registry task (bundled femnist)
    with the model as a module on PYTHONPATH."""
    source = write(
        tmp_path,
        "femnet.py",
        "from torch import nn\n\n\ndef tiny(num_classes, input_shape):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(int(__import__('math').prod(input_shape)), "
        "num_classes))\n",
    )
    env = {"PYTHONPATH": str(tmp_path)}
    root = tmp_path / "root"
    done = fedcli(
        root,
        "--task",
        "femnist",
        "--clients",
        "8",
        "--model",
        "femnet:tiny",
        "--rounds",
        "1",
        "--clients-per-round",
        "2",
        "--no-mlflow",
        env=env,
    )
    assert done.returncode == 0, done.stderr
    (run,) = store(root).list_runs()
    assert run.config["data"]["model_args"] == '{"input_shape": [1, 28, 28], "num_classes": 62}'
    source.write_text(source.read_text() + "# edited\n")

    refused = fedcli(root, "--resume", run.id[:8], "--rounds", "2", "--model", "femnet:tiny", env=env)
    assert refused.returncode == 2 and "changed since the run" in refused.stderr
    assert "FEDCLI_ALLOW_MODEL_CHANGE=1" in refused.stderr and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert store(root).last_round(run.id) == 1

    evaluated = fedcli(root, run.id[:8], "--model", "femnet:tiny", command="evaluate", env=env)
    assert evaluated.returncode == 0 and "changed since the run" in evaluated.stderr, evaluated.stderr
    trusted = fedcli(
        root, run.id[:8], "--trust-code", command="evaluate", env=env
    )  # trusts the recorded code only
    assert trusted.returncode == 2 and "source changed since the run recorded it" in trusted.stderr, (
        trusted.stderr
    )

    allowed = fedcli(
        root,
        "--resume",
        run.id[:8],
        "--rounds",
        "2",
        "--model",
        "femnet:tiny",
        env={**env, "FEDCLI_ALLOW_MODEL_CHANGE": "1"},
    )
    assert allowed.returncode == 0, allowed.stderr
    assert store(root).last_round(run.id) == 2


def test_batchnorm_model_runs_on_the_loop_process_and_vmap_alike(tmp_path: Path) -> None:
    """A BatchNorm model (Conv1d): auto picks the loop (convolutions on a CPU; in `process` workers
    where 2+ cores serve the cohort) and records why; its
    final model.pt carries the running statistics evaluation estimated; --executor process and
    --executor vmap (batch statistics per client, issue 37) train the same model."""
    data = har_data(tmp_path)
    write(tmp_path, "signalnet.py", HAR_NET)
    root = tmp_path / "root"
    done = fedcli(root, "--data", str(data), "--model", "signalnet.py:batchnorm_net", *SMALL, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (run,) = store(root).list_runs()
    assert run.config["train"]["executor"] in ("loop", "process")
    assert "convolutions" in run.tags["fedcli.executor_reason"]
    saved = torch.load(root / "runs" / run.id / "model.pt", weights_only=True)
    assert set(saved["buffers"]) == {"3.running_mean", "3.running_var", "3.num_batches_tracked"}
    assert not torch.equal(saved["buffers"]["3.running_var"], torch.ones(8))  # estimated, not the initial 1s
    for executor in ("process", "vmap"):  # workers and vmap train with batch statistics too
        other_root = tmp_path / executor
        spread = fedcli(
            other_root,
            "--data",
            str(data),
            "--model",
            "signalnet.py:batchnorm_net",
            "--executor",
            executor,
            "--workers",
            "2",
            *SMALL,
            cwd=tmp_path,
        )
        assert spread.returncode == 0, spread.stderr
        (other,) = store(other_root).list_runs()
        assert other.config["train"]["executor"] == executor
        for name, tensor in final_params(root, run.id).items():
            assert torch.allclose(final_params(other_root, other.id)[name], tensor, atol=1e-5), (
                executor,
                name,
            )


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("signalnet.py:missing", "has no attribute 'missing'"),
        ("brokenimport:Net", "importing"),
        ("signalnet.py:broken", "building the model failed (ValueError: width must be even)"),
        ("signalnet.py:wrong_shape", "expected [8, 6] for this classification task"),
    ],
)
def test_bad_factories_exit_2_with_one_line_and_write_nothing(
    tmp_path: Path, model: str, expected: str
) -> None:
    data = har_data(tmp_path)
    write(tmp_path, "signalnet.py", HAR_NET)
    write(tmp_path, "brokenimport.py", "import torch\nraise ImportError('needs torchvision')\n")
    root = tmp_path / "root"
    done = fedcli(root, "--data", str(data), "--model", model, *SMALL, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip()
    assert len(line.splitlines()) == 1 and expected in line and "Traceback" not in line, line
    assert not root.exists()


def test_wrong_output_shape_names_expected_shape(tmp_path: Path) -> None:
    """A classifier with one output too many: the line names the shape found and the one expected."""
    write(
        tmp_path,
        "bad.py",
        "from torch import nn\n\n\ndef net(num_classes, input_shape):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(32 * 9, num_classes + 1))\n",
    )
    done = fedcli(
        tmp_path / "root", "--data", str(har_data(tmp_path)), "--model", "bad.py:net", *SMALL, cwd=tmp_path
    )
    assert done.returncode == 2
    assert "output shape [8, 7] on a batch of 8, expected [8, 6]" in done.stderr, done.stderr
    assert not (tmp_path / "root").exists()


# ----------------------------------------------------------------------------- references, in process


def test_model_reference_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built-in names pass; a file path becomes absolute; a module of the working directory is
    recorded by its file; an importable function by module:qualname; `__main__`, local objects
    and built modules are refused with the fix."""
    from fedcli.datasets.yours.model import model_reference
    from fedcli.errors import ConfigError

    write(tmp_path, "mynet.py", HAR_NET)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(
        sys.modules, "mynet", raising=False
    )  # another test's mynet: a module already imported wins
    assert model_reference("mlp") == "mlp"
    assert model_reference("./mynet.py:SignalCNN") == f"{tmp_path / 'mynet.py'}:SignalCNN"
    assert model_reference("mynet:SignalCNN") == f"{tmp_path / 'mynet.py'}:SignalCNN"
    assert model_reference(torch.nn.Linear) == "torch.nn.modules.linear:Linear"

    def local() -> torch.nn.Module:
        return torch.nn.Linear(1, 1)

    main = type("Net", (torch.nn.Module,), {"__module__": "__main__"})
    for bad, words in [
        (local, "defined in a function"),
        (main, "__main__"),
        (torch.nn.Linear(1, 1), "not a built"),
        ("nosuchfile.py:Net", "does not exist"),
        ("mynet.py:", "must read"),
    ]:
        with pytest.raises(ConfigError, match=words):
            model_reference(bad)


def test_built_in_model_configs_keep_their_hash() -> None:
    """The new data keys stay out of the hash while unset, so stored runs and sweeps keep theirs; a
    user model's source hash is part of it."""
    import dataclasses

    from fedcli.config.build import build_config
    from fedcli.config.sections import config_hash_of

    cfg = build_config(overrides={"data.task": "femnist", "data.model": "mlp"})
    doc = cfg.to_dict()
    assert doc["data"]["model_sha256"] is None and doc["data"]["model_args"] is None
    old = {**doc, "data": {k: v for k, v in doc["data"].items() if k not in ("model_sha256", "model_args")}}
    assert cfg.config_hash == config_hash_of(old)
    edited = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, model="m:f", model_sha256="ab"))
    assert (
        edited.config_hash
        != dataclasses.replace(edited, data=dataclasses.replace(edited.data, model_sha256="cd")).config_hash
    )
    assert (
        edited.config_hash
        == dataclasses.replace(
            edited, data=dataclasses.replace(edited.data, model_args='{"num_classes": 3}')
        ).config_hash
    )


@pytest.mark.timeout(400)
def test_torchrun_ranks_rebuild_the_model_and_match_one_process(tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 ... --executor distributed` with the test's model file: each rank
    imports it; the final model equals the single-process run's."""
    data = har_data(tmp_path)
    write(tmp_path, "signalnet.py", HAR_NET)
    args = [
        "train",
        "--data",
        str(data),
        "--model",
        "signalnet.py:SignalCNN",
        "--algo",
        "scaffold",
        "--rounds",
        "2",
        "--clients-per-round",
        "4",
        "--no-mlflow",
    ]
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")},
        "OMP_NUM_THREADS": "1",
    }
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
            *args,
            "--root",
            str(tmp_path / "dist"),
            "--executor",
            "distributed",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launch.returncode == 0, launch.stderr[-3000:]
    one = fedcli(tmp_path / "one", *args[1:], cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    (dist_run,), (one_run,) = store(tmp_path / "dist").list_runs(), store(tmp_path / "one").list_runs()
    assert dist_run.tags["fedcli.executor"] == "distributed"
    for name, tensor in final_params(tmp_path / "one", one_run.id).items():
        assert torch.allclose(final_params(tmp_path / "dist", dist_run.id)[name], tensor, atol=1e-6), name


@pytest.mark.timeout(600)
def test_sweep_grid_over_models_reruns_only_an_edited_model(tmp_path: Path) -> None:
    """A sweep grid `model: [mlp, ./signalnet.py:SignalCNN]`: both trials train; a rerun skips both;
    after the model's file is edited, a rerun trains that trial again (its source hash is part of
    the config hash) and skips the built-in one."""
    data = har_data(tmp_path)
    source = write(tmp_path, "signalnet.py", HAR_NET)
    spec = write(
        tmp_path,
        "sweep.yaml",
        f"experiment: models\nbase: {{data.file: {data}, rounds: 1, "
        "clients_per_round: 2, tracking.use_mlflow: false}\n"
        "grid: {model: [mlp, ./signalnet.py:SignalCNN]}\nseeds: [0]\n",
    )
    for attempt, expected in enumerate((2, 2, 3)):
        if attempt == 2:
            source.write_text(HAR_NET + "\n# edited\n")
        done = fedcli(tmp_path / "root", str(spec), command="sweep", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        runs = store(tmp_path / "root").list_runs()
        assert len(runs) == expected and {r.status for r in runs} == {"finished"}
    models = sorted(r.config["data"]["model"].rsplit("/", 1)[-1] for r in runs)
    assert models == ["mlp", "signalnet.py:SignalCNN", "signalnet.py:SignalCNN"]


def test_an_edited_model_is_imported_again_in_a_long_lived_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep worker runs many trials in one process: after the model's source changes, the next
    build imports the new code (file and module forms), so the code that runs is the code hashed."""
    from fedcli.datasets.yours.model import load_factory

    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path, "editednet.py", "def width():\n    return 1\n")
    for ref in (f"{path}:width", "editednet:width"):
        path.write_text("def width():\n    return 1\n")
        assert load_factory(ref)() == 1
        path.write_text("def width():\n    return 2  # edited\n")
        assert load_factory(ref)() == 2, ref
    sys.modules.pop("editednet", None)


def test_a_model_no_longer_importable_is_one_line(tmp_path: Path) -> None:
    """The MLflow model's loader (tracking/served.py) and `build_config` (for --resume and evaluate)
    name a module that no longer imports, or a file that is gone, in one line."""
    from fedcli.config.build import build_config
    from fedcli.errors import ConfigError
    from fedcli.tracking.served import served_model

    with pytest.raises(ConfigError, match="module 'gone_net_xyz' is not importable here; install it"):
        served_model({}, "femnist", "gone_net_xyz:Net", None, '{"num_classes": 62}', "ab" * 32, trust=True)
    with pytest.raises(ConfigError, match="gone.py does not exist"):
        build_config(overrides={"data.model": f"{tmp_path / 'gone.py'}:Net", "data.model_sha256": "ab" * 32})
