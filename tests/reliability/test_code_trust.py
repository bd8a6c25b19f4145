"""No code runs from a file or a row the user did not name (issue 35; docs/operations.md, "Security").

A planted module (`planted.py`: a model factory and a data function) appends a line to a marker
file when it is imported. User A trains with it (named on the command line: it runs). Then every
path that reads the reference back, run as another user would (another folder, the same store),
must not import it without an opt-in, exit 2 with one line naming the file, and must import it
with the opt-in: `fedcli evaluate` (final model and `--checkpoint`), `train --resume`, `fedcli sync`,
`Run.model()` (model.pt), the MLflow model's loader (served.pt), and a sweep adopting a hand-made
Optuna trial. Real processes, real SQLite stores, real MLflow; nothing is mocked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcli.tracking.store.sql_store import SqlStore

PLANTED = """
import math
from pathlib import Path

from torch import nn

with Path({marker!r}).open("a") as fh:  # the evidence: this module ran
    fh.write("imported\\n")


def Net(num_classes, input_shape):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


def load():
    import numpy as np
    import torch
    from torch.utils.data import TensorDataset

    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.normal(size=(60, 4)).astype("float32"))
    y = torch.from_numpy((rng.normal(size=60) > 0).astype("int64"))
    return {{"data": TensorDataset(x, y), "client": np.arange(60) % 6}}
"""

SMALL = ["--clients-per-round", "2", "--rounds", "1", "--checkpoint-every", "1"]


def env(**extra: str) -> dict[str, str]:
    out = {
        k: v
        for k, v in os.environ.items()
        if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI", "FEDCLI_TRUST_CODE")
    }
    return {**out, "OMP_NUM_THREADS": "1", "COLUMNS": "250", **extra}


def fedcli(*args: str, cwd: Path, extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedcli", "-q", *args],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=cwd,
        env=env(**(extra or {})),
    )


def python(script: str, cwd: Path, extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=cwd,
        env=env(**(extra or {})),
    )


def refused(done: subprocess.CompletedProcess[str], source: Path, marker: Path) -> None:
    """Exit 2, one line naming the planted file and the opt-in, no traceback, and the module never ran."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert str(source) in lines[0] and "fedcli would import and run" in lines[0], lines[0]
    assert not marker.exists(), "the planted module ran without the user's opt-in"


def ran(done: subprocess.CompletedProcess[str], marker: Path) -> None:
    assert done.returncode == 0, done.stderr
    assert marker.exists(), "the opt-in did not import the module"
    marker.unlink()


@pytest.fixture()
def planted(tmp_path: Path) -> dict[str, Path]:
    """User A's folder: planted.py, a data file, and A's store (root); B works in another folder."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    marker = tmp_path / "marker"
    source = a / "planted.py"
    source.write_text(PLANTED.format(marker=str(marker)))
    rng = np.random.default_rng(1)
    np.savez(
        a / "data.npz",
        x=rng.normal(size=(80, 5)).astype(np.float32),
        y=rng.integers(0, 3, 80),
        client=np.arange(80) % 8,
    )
    return {"a": a, "b": b, "marker": marker, "source": source, "root": a / "root"}


def run_id(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_a_stored_run_imports_its_model_only_when_named_again_or_trusted(planted: dict[str, Path]) -> None:
    """A store row names A's model file: B's `evaluate`, `evaluate --checkpoint`, `--resume` and `sync` on the
    shared store refuse (exit 2, one line, the module never imported); `--model` again or `--trust-code` runs it."""
    a, b, marker, source, root = (planted[k] for k in ("a", "b", "marker", "source", "root"))
    store = ["--root", str(root)]
    rid = run_id(
        fedcli(
            "train", *store, "--data", "data.npz", "--model", "./planted.py:Net", *SMALL, "--no-mlflow", cwd=a
        )
    )
    assert marker.exists()  # A named it: it ran
    marker.unlink()
    ref = f"{source}:Net"
    assert SqlStore(f"sqlite:///{root / 'fedcli.db'}").get_run(rid).config["data"]["model"] == ref

    refused(fedcli("evaluate", rid[:8], *store, "--no-mlflow", cwd=b), source, marker)
    refused(fedcli("evaluate", rid[:8], *store, "--checkpoint", "1", "--no-mlflow", cwd=b), source, marker)
    refused(
        fedcli("train", *store, "--resume", rid[:8], "--rounds", "2", "--no-mlflow", cwd=b), source, marker
    )
    refused(fedcli("sync", *store, cwd=b), source, marker)
    other = fedcli("evaluate", rid[:8], *store, "--model", "./data.npz:Net", "--no-mlflow", cwd=a)
    assert other.returncode == 2 and "does not name run" in other.stderr and not marker.exists(), other.stderr

    ran(fedcli("evaluate", rid[:8], *store, "--trust-code", "--no-mlflow", cwd=b), marker)
    ran(
        fedcli("evaluate", rid[:8], *store, "--checkpoint", "1", "--model", ref, "--no-mlflow", cwd=b), marker
    )
    ran(
        fedcli("train", *store, "--resume", rid[:8], "--rounds", "2", "--model", ref, "--no-mlflow", cwd=b),
        marker,
    )
    ran(
        fedcli("train", *store, "--resume", rid[:8], "--rounds", "3", "--trust-code", "--no-mlflow", cwd=b),
        marker,
    )
    assert SqlStore(f"sqlite:///{root / 'fedcli.db'}").last_round(rid) == 3
    synced = fedcli("sync", *store, "--trust-code", cwd=b)
    ran(synced, marker)  # the MLflow model was logged: its module rebuilt

    # the MLflow model's loader (served.pt names the file): refused without the loader's opt-in, run with it
    probe = f'''
import json, sys, mlflow, numpy as np
mlflow.set_tracking_uri("sqlite:///{root / "mlflow.db"}")
ids = [e.experiment_id for e in mlflow.MlflowClient().search_experiments()]
(logged,) = mlflow.search_logged_models(experiment_ids=ids, output_format="list")
rows = np.load("{a / "data.npz"}")["x"][:2]
config = {{"trust_code": True}} if sys.argv[1:] == ["trust"] else None
try:
    model = mlflow.pyfunc.load_model(logged.model_uri, model_config=config)
except Exception as err:
    print(json.dumps({{"error": type(err).__name__, "message": str(err)}}))
else:
    print(json.dumps({{"logits": model.predict(rows).tolist()}}))
'''
    out = python(probe, cwd=b)
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer.get("error") == "ConfigError" and str(source) in answer["message"], out.stdout + out.stderr
    assert "model_config={'trust_code': True}" in answer["message"] and not marker.exists()
    for how, extra in ((["trust"], None), ([], {"FEDCLI_TRUST_CODE": "1"})):
        out = subprocess.run(
            [sys.executable, "-c", probe, *how],
            capture_output=True,
            text=True,
            timeout=400,
            cwd=b,
            env=env(**(extra or {})),
        )
        answer = json.loads(out.stdout.strip().splitlines()[-1])
        assert np.asarray(answer.get("logits")).shape == (2, 3), out.stdout + out.stderr
        ran(out, marker)


def test_model_pt_and_served_pt_import_code_only_with_trust_code(planted: dict[str, Path]) -> None:
    """`fedcli.load_run(...).model()` and `load_served` in a fresh process of user B: the model file a run's
    model.pt (or served.pt) names, and a data function, are not imported without `trust_code=True` /
    FEDCLI_TRUST_CODE=1; a model.pt planted to name the file under a run of a built-in model neither."""
    a, b, marker, source, root = (planted[k] for k in ("a", "b", "marker", "source", "root"))
    store = ["--root", str(root), "--no-mlflow"]
    own = run_id(fedcli("train", *store, "--data", "data.npz", "--model", "./planted.py:Net", *SMALL, cwd=a))
    data_fn = run_id(fedcli("train", *store, "--data", "./planted.py:load", "--model", "mlp", *SMALL, cwd=a))
    builtin = run_id(fedcli("train", *store, "--data", "data.npz", "--model", "mlp", *SMALL, cwd=a))
    marker.unlink()
    # a model.pt holding only tensors and strings that names the planted file (the run's row says mlp)
    path = root / "runs" / builtin / "model.pt"
    saved = torch.load(path, weights_only=True)
    saved["model"] = f"{source}:Net"
    saved["config"]["data"]["model"] = f"{source}:Net"
    torch.save(saved, path)

    script = f"""
import json, sys, fedcli
from fedcli.errors import ConfigError
out = {{}}
for name, rid in (("own", {own!r}), ("data_fn", {data_fn!r}), ("planted", {builtin!r})):
    try:
        fedcli.load_run(rid, root={str(root)!r}, trust_code=sys.argv[1:] == ["trust"]).model()
        out[name] = "built"
    except ConfigError as err:
        out[name] = str(err)
print(json.dumps(out))
"""
    done = python(script, cwd=b)
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("own", "data_fn", "planted"):
        assert str(source) in answers[name] and "trust_code=True" in answers[name], (name, answers[name])
        assert "\n" not in answers[name]
    assert not marker.exists(), "Run.model() imported the planted module without trust_code"
    done = subprocess.run(
        [sys.executable, "-c", script, "trust"], capture_output=True, text=True, timeout=400, cwd=b, env=env()
    )
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    assert answers["own"] == "built" and answers["data_fn"] == "built", answers
    # imported (trusted); model.pt records no factory args
    assert "building the model failed" in answers["planted"]
    ran(done, marker)

    served = f"""
import json
from fedcli.tracking.served import load_served, read_model_file, write_served
from fedcli.errors import ConfigError
write_served(read_model_file(__import__("pathlib").Path({str(root / "runs" / own / "model.pt")!r})), "served.pt")
try:
    load_served("served.pt")
    print(json.dumps("built"))
except ConfigError as err:
    print(json.dumps(str(err)))
"""
    done = python(served, cwd=b)
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert str(source) in answer and "FEDCLI_TRUST_CODE=1" in answer and not marker.exists(), answer
    done = python(served, cwd=b, extra={"FEDCLI_TRUST_CODE": "1"})
    assert json.loads(done.stdout.strip().splitlines()[-1]) == "built", done.stdout + done.stderr
    ran(done, marker)


def test_the_api_resumes_and_rebuilds_the_code_it_names(planted: dict[str, Path]) -> None:
    """The same user in one Python process: `fedcli.train(model=...)` then `run.model()` needs no opt-in (the
    code ran there already); `fedcli.train(resume=...)` in a new process resumes with `model=` named again,
    and refuses without it."""
    a, marker, source, root = (planted[k] for k in ("a", "marker", "source", "root"))
    script = f"""
import sys, fedcli
from fedcli.errors import ConfigError
kw = dict(data="data.npz", root={str(root)!r}, no_mlflow=True, clients_per_round=2)
if sys.argv[1] == "new":
    run = fedcli.train(model="planted.py:Net", rounds=1, **kw)
    print(type(run.model()).__name__, run.id)
elif sys.argv[1] == "bare":
    try:
        fedcli.train(resume=sys.argv[2], rounds=2, root={str(root)!r}, no_mlflow=True)
    except ConfigError as err:
        print("refused:", err)
else:
    run = fedcli.train(resume=sys.argv[2], model="planted.py:Net", rounds=2, root={str(root)!r}, no_mlflow=True)
    print(run.status, run.id)
"""
    first = subprocess.run(
        [sys.executable, "-c", script, "new"], capture_output=True, text=True, timeout=400, cwd=a, env=env()
    )
    assert first.returncode == 0 and first.stdout.startswith("ServedModel "), first.stdout + first.stderr
    rid = first.stdout.split()[-1]
    marker.unlink()
    bare = subprocess.run(
        [sys.executable, "-c", script, "bare", rid],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=a,
        env=env(),
    )
    assert bare.stdout.startswith("refused:") and str(source) in bare.stdout, bare.stdout + bare.stderr
    assert not marker.exists()
    named = subprocess.run(
        [sys.executable, "-c", script, "named", rid],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=a,
        env=env(),
    )
    assert named.stdout.split() == ["finished", rid], named.stdout + named.stderr
    ran(named, marker)


def test_a_sweep_adopts_only_trials_whose_code_its_spec_names(planted: dict[str, Path]) -> None:
    """A hand-made RUNNING Optuna trial in the store's study (its owner dead) whose parameters name the planted
    model: the next `fedcli sweep` does not adopt it (the module never runs) and runs its own trial; a spec whose
    search space names that model adopts and runs it."""
    optuna = pytest.importorskip("optuna")
    from fedcli.tracking.store.common import HOSTNAME

    a, marker, source, root = (planted[k] for k in ("a", "marker", "source", "root"))
    root.mkdir()
    url = f"sqlite:///{root / 'fedcli.db'}"
    SqlStore(url).close()  # the store's tables first, as a sweep makes them
    dead = subprocess.Popen(["true"])
    dead.wait()
    ref = f"{source}:Net"

    def plant(experiment: str) -> None:
        study = optuna.create_study(study_name=f"fedcli:{experiment}", storage=url, direction="maximize")
        trial = study.ask(
            {
                "model": optuna.distributions.CategoricalDistribution([ref]),
                "client_lr": optuna.distributions.CategoricalDistribution([0.05]),
            }
        )
        trial.set_user_attr("fedcli.owner", f"{HOSTNAME}:{dead.pid}")
        trial.set_user_attr("fedcli.config_hash", "planted")

    def sweep(experiment: str, space: str) -> subprocess.CompletedProcess[str]:
        spec = a / f"{experiment}.yaml"
        spec.write_text(
            f"experiment: {experiment}\nbase: {{data.file: {a / 'data.npz'}, rounds: 1, "
            "clients_per_round: 2}\n"
            f"search: {{sampler: random, trials: 1, metric: accuracy, space: {space}}}\n"
        )
        return fedcli("sweep", str(spec), "--root", str(root), "--no-mlflow", cwd=a)

    plant("unnamed")
    done = sweep("unnamed", "{client_lr: [0.05]}")
    assert done.returncode == 0, done.stderr
    assert not marker.exists(), "the sweep adopted a trial naming code its spec does not name"
    (run,) = SqlStore(url).list_runs(experiment="unnamed")
    assert run.config["data"]["model"] is None or run.config["data"]["model"] == "mlp", run.config["data"]
    trials = optuna.load_study(study_name="fedcli:unnamed", storage=url).get_trials()
    assert "names code the sweep's spec does not name" in trials[0].user_attrs["fedcli.void"]

    plant("named")
    done = sweep("named", f"{{model: ['{ref}'], client_lr: [0.05]}}")
    assert done.returncode == 0, done.stderr
    (run,) = SqlStore(url).list_runs(experiment="named")
    assert run.config["data"]["model"] == ref and run.status == "finished"
    ran(done, marker)


def test_a_sweep_resumes_its_trial_only_with_the_code_its_spec_names(planted: dict[str, Path]) -> None:
    """A sweep stopped mid-trial resumes it on the rerun (the spec names the model again for the worker); a row
    then edited to name another file (same config hash tag) is not resumed with it: the trial fails, that file
    never runs."""
    import sqlite3
    import time

    a, marker, root = planted["a"], planted["marker"], planted["root"]
    spec = a / "s.yaml"
    spec.write_text(
        f"experiment: s\nbase: {{data.file: {a / 'data.npz'}, rounds: 100000, clients_per_round: 2, "
        "checkpoint_every: 1}\ngrid: {model: [./planted.py:Net]}\nseeds: [0]\n"
    )
    other_marker = planted["a"].parent / "other-marker"
    other = a / "other.py"
    other.write_text(PLANTED.format(marker=str(other_marker)))

    def stopped_sweep(min_round: int) -> str:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedcli", "-q", "sweep", str(spec), "--root", str(root), "--no-mlflow"],
            cwd=a,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline, rid = time.monotonic() + 240, None
        while time.monotonic() < deadline and proc.poll() is None:
            if (root / "fedcli.db").exists():
                db = SqlStore(f"sqlite:///{root / 'fedcli.db'}")
                runs = db.list_runs()
                if runs and (db.last_round(runs[0].id) or 0) >= min_round:
                    rid = runs[0].id
                    break
            time.sleep(0.5)
        proc.terminate()
        _, err = proc.communicate(timeout=120)
        assert rid is not None, err[-2000:]
        return rid

    rid = stopped_sweep(2)
    assert marker.exists()
    marker.unlink()
    before = SqlStore(f"sqlite:///{root / 'fedcli.db'}").last_round(rid) or 0
    again = stopped_sweep(before + 2)  # resumed by the rerun's worker, the spec's model named again
    assert again == rid and len(SqlStore(f"sqlite:///{root / 'fedcli.db'}").list_runs()) == 1
    assert marker.exists()
    marker.unlink()

    # the row now names another file, as anyone who can write the store could make it
    with sqlite3.connect(root / "fedcli.db") as conn:
        (text,) = conn.execute("SELECT requested_json FROM runs WHERE id = ?", (rid,)).fetchone()
        conn.execute(
            "UPDATE runs SET requested_json = ? WHERE id = ?",
            (text.replace(str(planted["source"]), str(other)), rid),
        )
    done = fedcli("sweep", str(spec), "--root", str(root), "--no-mlflow", cwd=a)
    assert done.returncode == 1 and str(other) in done.stderr, done.stderr[-3000:]
    assert not other_marker.exists(), "a sweep resumed a run with code its spec does not name"
