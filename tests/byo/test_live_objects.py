"""`fedcli.train(model=MyNet, data=my_dataset)` with live objects, as a notebook or a script passes them (issue 37
item 4; docs/python-api.md, "Your model and data from a notebook").

Real runs on a tiny MNIST sample (SQLite store, no MLflow); the notebook's and the script's `__main__` are real
`python` subprocesses; a notebook cell is code compiled under IPython's cell file name, which exists on no disk.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import fedcli
from fedcli.datasets.bundled.mnist import read_idx_pair
from fedcli.errors import ConfigError
from fedcli.runs.objects import live_model
from fedcli.tracking.store.sql_store import SqlStore

REPO = Path(__file__).resolve().parents[2]

NET = """
from torch import nn


class Net(nn.Module):
    def __init__(self, num_classes, input_shape, hidden=16):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, hidden), nn.ReLU(), nn.Dropout(0.1),
                                  nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.body(x)


class NeedsWidth(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.out = nn.Linear(28 * 28, width)

    def forward(self, x):
        return self.out(x.flatten(1))
"""

DATASET = '''
import numpy as np
import torch


class Digits(torch.utils.data.Dataset):
    """(x, y) pairs of the tiny MNIST sample, as a user's Dataset class returns them."""

    def __init__(self, path):
        arrays = np.load(path)
        self.x = torch.from_numpy(arrays["x"]).float() / 255
        self.y = torch.from_numpy(arrays["y"])

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]
'''

SETTINGS = {
    "scheme": "iid",
    "clients": 3,
    "clients_per_round": 3,
    "rounds": 1,
    "batch_size": 8,
    "no_mlflow": True,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = REPO / "datasets" / "data" / "mnist"
    x, y = read_idx_pair(folder / "t10k-images-idx3-ubyte.gz", folder / "t10k-labels-idx1-ubyte.gz")
    path = tmp_path_factory.mktemp("data") / "tiny.npz"
    np.savez(path, x=x[:60][:, None], y=y[:60].astype(np.int64))
    return path


@pytest.fixture
def user_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """mynet.py and mydata.py in a folder the 'notebook' put on sys.path (not the working folder)."""
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "mynet.py").write_text(NET)
    (folder / "mydata.py").write_text(DATASET)
    monkeypatch.syspath_prepend(str(folder))
    for name in ("mynet", "mydata"):
        sys.modules.pop(name, None)
    yield folder
    for name in (
        "mynet",
        "mydata",
    ):  # imported from this test's folder: a later test's `mynet` is another file
        sys.modules.pop(name, None)


def runs_in(root: Path) -> list[object]:
    db = root / "fedcli.db"
    return SqlStore(f"sqlite:///{db}").list_runs() if db.exists() else []


def test_live_class_and_dataset_record_their_source(tmp_path: Path, tiny: Path, user_code: Path) -> None:
    """A class imported in the notebook from a folder on its sys.path is recorded by its file (importable from
    any folder and process) with the file's sha256; a Dataset object records its class's file and sha256."""
    import hashlib

    from mydata import Digits  # type: ignore[import-not-found]
    from mynet import Net  # type: ignore[import-not-found]

    run = fedcli.train("fedavg", model=Net, data=Digits(str(tiny)), root=tmp_path / "runs", **SETTINGS)
    data = run.config["data"]
    assert data["model"] == f"{user_code / 'mynet.py'}:Net"
    assert data["model_sha256"] == hashlib.sha256((user_code / "mynet.py").read_bytes()).hexdigest()
    assert data["file"].startswith("python:digits@")
    assert data["object_source"] == f"{user_code / 'mydata.py'}:Digits"
    assert data["object_source_sha256"] == hashlib.sha256((user_code / "mydata.py").read_bytes()).hexdigest()
    assert np.isfinite(run.metrics()["eval/accuracy"].dropna().iloc[-1])
    net = run.model()  # rebuilt in this process from the recorded file
    assert type(net.net).__name__ == "Net"  # the served wrapper around the user's class


def test_instance_is_built_again_from_its_class(
    tmp_path: Path, tiny: Path, user_code: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An nn.Module instance: its class is recorded (every process builds it again under the run's seed), a
    warning says its weights are not used, and the run equals the run of the class."""
    from mynet import Net

    by_class = fedcli.train("fedavg", model=Net, data=str(tiny), root=tmp_path / "a", **SETTINGS)
    instance = Net(10, (1, 28, 28))
    by_instance = fedcli.train("fedavg", model=instance, data=str(tiny), root=tmp_path / "b", **SETTINGS)
    assert any("its current weights are not used" in r.getMessage() for r in caplog.records)
    assert by_instance.config["data"]["model"] == by_class.config["data"]["model"]
    a = torch.load(tmp_path / "a" / "runs" / by_class.id / "model.pt", weights_only=True)["params"]
    b = torch.load(tmp_path / "b" / "runs" / by_instance.id / "model.pt", weights_only=True)["params"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_instance_that_cannot_be_built_again_asks_for_a_factory(
    tmp_path: Path, tiny: Path, user_code: Path
) -> None:
    from mynet import NeedsWidth

    with pytest.raises(ConfigError, match=r"NeedsWidth\(\) needs width.*pass a factory") as raised:
        fedcli.train("fedavg", model=NeedsWidth(10), data=str(tiny), root=tmp_path, **SETTINGS)
    assert "\n" not in str(raised.value)
    assert runs_in(tmp_path) == []


def test_notebook_cell_class_is_one_line(tmp_path: Path, tiny: Path) -> None:
    """A class defined in a notebook cell (IPython compiles cells under a file name that exists on no disk)."""
    cell = compile(NET, "/tmp/ipykernel_4242/1234567.py", "exec")
    scope: dict[str, object] = {"__name__": "__main__"}
    exec(cell, scope)  # noqa: S102 - what IPython does with a cell
    with pytest.raises(
        ConfigError,
        match=r"model Net is defined in a notebook cell.*%%writefile mynet\.py.*"
        r"model='mynet\.py:Net'",
    ) as raised:
        fedcli.train("fedavg", model=scope["Net"], data=str(tiny), root=tmp_path, **SETTINGS)
    assert "\n" not in str(raised.value)
    assert runs_in(tmp_path) == []


def test_script_main_class_names_its_file(tmp_path: Path, tiny: Path) -> None:
    """A class defined in the script being run (`__main__`): the line names `script.py:Net` and the guard."""
    script = tmp_path / "train_script.py"
    script.write_text(
        NET
        + textwrap.dedent(f"""
        import fedcli
        from fedcli.errors import ConfigError
        try:
            fedcli.train("fedavg", model=Net, data={str(tiny)!r}, root={str(tmp_path / "runs")!r}, scheme="iid",
                         clients=3, clients_per_round=3, rounds=1, no_mlflow=True)
        except ConfigError as exc:
            print("ERROR", exc)
    """)
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    line = next(row for row in out.stdout.splitlines() if row.startswith("ERROR"))
    assert f"model='{script}:Net'" in line and '__name__ == "__main__"' in line, out.stdout + out.stderr
    assert runs_in(tmp_path / "runs") == []


def test_resume_in_another_process_names_what_it_needs(tmp_path: Path, tiny: Path, user_code: Path) -> None:
    """A run of a Dataset object, resumed from the command line (another process): one line, exit 2, naming the
    object and both fixes; the run is not touched."""
    from mydata import Digits
    from mynet import Net

    root = tmp_path / "runs"
    run = fedcli.train("fedavg", model=Net, data=Digits(str(tiny)), root=root, **SETTINGS)
    before = SqlStore(f"sqlite:///{root / 'fedcli.db'}").get_run(run.id).status
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            "--root",
            str(root),
            "--resume",
            run.id,
            "--rounds",
            "2",
            "--model",
            run.config["data"]["model"],
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 2, out.stderr
    lines = [row for row in out.stderr.splitlines() if row.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "python:digits@" in lines[0] and "pass the same object to fedcli.train again" in lines[0]
    assert SqlStore(f"sqlite:///{root / 'fedcli.db'}").get_run(run.id).status == before
    # in this process, the same data named again (docs/your-data.md, "Names and fingerprints") resumes it
    from fedcli.datasets.yours.data import data_ref

    assert data_ref(Digits(str(tiny))) == run.config["data"]["file"]
    resumed = fedcli.train(root=root, resume=run.id, rounds=2, no_mlflow=True)
    assert resumed.id == run.id and resumed.metrics()["eval/accuracy"].dropna().index.max() == 2


def test_live_model_passes_names_and_references_through() -> None:
    assert live_model("cnn") == "cnn"
    assert live_model("pkg.mod:factory") == "pkg.mod:factory"
    assert live_model(torch.nn.Linear) is torch.nn.Linear  # a package's class: its module names it
