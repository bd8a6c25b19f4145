"""A user's data (docs/your-data.md): files, `file.py:fn` functions, torch / Hugging Face datasets and
flwr-datasets partitions, each recorded under its own name and content fingerprint; bad input is
one line, exit 2, nothing written.

Nothing is downloaded: Hugging Face datasets are built from arrays (`Dataset.from_dict`) and the
flwr-datasets partitioners are given them directly (no FederatedDataset, which needs the Hub).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from fedcli.config.build import build_config
from fedcli.datasets.tasks import TaskOptions
from fedcli.datasets.yours.data import data_ref
from fedcli.datasets.yours.files import byo_task
from fedcli.engine.setup import build
from fedcli.engine.train import train as run_training
from fedcli.errors import ConfigError, DataError
from fedcli.tracking.sinks import Tracker
from fedcli.tracking.store.sql_store import SqlStore

REPO = Path(__file__).resolve().parents[2]


def hf_datasets() -> Any:
    """The Hugging Face `datasets` package: the repository's own top-level folder `datasets/` (installed as
    fedcli.datasets) shadows it on sys.path when pytest runs from the repository root."""
    cached = sys.modules.get("datasets")
    if cached is not None and hasattr(cached, "Dataset"):
        return cached
    sys.modules.pop("datasets", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO]
    try:
        return importlib.import_module("datasets")
    except ImportError:
        pytest.skip("needs the Hugging Face `datasets` package (pip install 'fedcli[hf]'; in [dev])")
    finally:
        sys.path[:] = saved


def fedcli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "fedcli", "-q", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def features(n: int = 90, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] > 0).astype(np.int64)


def train_ref(tmp_path: Path, ref: str, **overrides: Any) -> tuple[Any, SqlStore]:
    url = f"sqlite:///{tmp_path / 's.db'}"
    cfg = build_config(
        overrides={
            "data.file": ref,
            "data.model": "mlp",
            "algorithm.name": "fedavg",
            "train.rounds": 2,
            "train.clients_per_round": 2,
            "train.device": "cpu",
            "tracking.root": str(tmp_path),
            "tracking.store": url,
            "tracking.use_mlflow": False,
            **overrides,
        }
    )
    result = run_training(cfg, tracker=Tracker(SqlStore(url)))
    return SqlStore(url).get_run(result.run_id), SqlStore(url)


def assert_own_name(record: Any, name: str, fingerprint: str) -> None:
    assert record.status == "finished"
    assert record.task == name and record.tags["fedcli.dataset"] == name
    assert record.config["data"]["task"] == name and record.config["data"]["fingerprint"] == fingerprint
    assert "femnist" not in json.dumps(record.config["data"]) + json.dumps(record.tags)


def test_data_file_run_is_stored_under_its_own_name_in_both_stores_and_reports(tmp_path: Path) -> None:
    """The bug of issue 26: `--data mydata.npz --model mlp --algo fola` was stored as femnist."""
    from mlflow.tracking import MlflowClient

    x, y = features()
    np.savez(tmp_path / "mydata.npz", x=x, y=y, client=np.arange(len(y)) % 5)
    expected = byo_task(tmp_path / "mydata.npz", "mlp").load(TaskOptions()).fingerprint
    uri, url = f"sqlite:///{tmp_path / 'mlflow.db'}", f"sqlite:///{tmp_path / 's.db'}"
    done = fedcli(
        tmp_path,
        "train",
        "--data",
        "mydata.npz",
        "--model",
        "mlp",
        "--algo",
        "fola",
        "--rounds",
        "2",
        "--clients-per-round",
        "2",
        "--root",
        str(tmp_path),
        "--store",
        url,
        "--tracking-uri",
        uri,
    )
    assert done.returncode == 0, done.stderr
    record = SqlStore(url).get_run(done.stdout.strip().splitlines()[-1])
    assert_own_name(record, "byo-mydata", expected)
    mlrun = MlflowClient(uri).get_run(record.mlflow_run_id)
    assert (
        mlrun.data.tags["fedcli.dataset"] == "byo-mydata" and mlrun.data.tags["fedcli.task"] == "byo-mydata"
    )
    assert (
        mlrun.data.params["data.task"] == "byo-mydata" and mlrun.data.params["data.fingerprint"] == expected
    )
    report = fedcli(tmp_path, "report", "--runs", record.id, "--store", url, "--format", "json")
    assert report.returncode == 0, report.stderr
    assert "byo-mydata" in report.stdout and "femnist" not in report.stdout


def test_torch_dataset_with_client_ids_trains_under_its_name(tmp_path: Path) -> None:
    class Points(Dataset):  # a map-style dataset as users write them: one (x, y) per index
        def __init__(self) -> None:
            self.x, self.y = features()

        def __len__(self) -> int:
            return len(self.y)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            return torch.from_numpy(self.x[i]), int(self.y[i])

    ref = data_ref(Points(), client=[f"user{i % 6}" for i in range(90)])
    assert ref.startswith("python:points@")
    setup = build(
        build_config(
            overrides={
                "data.file": ref,
                "data.model": "mlp",
                "train.clients_per_round": 2,
                "train.device": "cpu",
            }
        )
    )
    assert setup.task.name == "byo-points" and len(setup.partition or []) == 6
    assert (
        data_ref(
            TensorDataset(*map(torch.from_numpy, features())),
            name="points",
            client=[f"user{i % 6}" for i in range(90)],
        )
        == ref
    )  # same tensors, same reference
    record, _ = train_ref(tmp_path, ref)
    assert_own_name(record, "byo-points", setup.data.fingerprint)


def test_hugging_face_dataset_with_a_client_column(tmp_path: Path) -> None:
    hf = hf_datasets()
    x, y = features()
    ds = hf.Dataset.from_dict({"pixels": x, "target": y, "writer": np.arange(90) % 4})
    ref = data_ref(ds, name="hf-points", x="pixels", y="target", client="writer")
    setup = build(
        build_config(
            overrides={
                "data.file": ref,
                "data.model": "logreg",
                "train.clients_per_round": 2,
                "train.device": "cpu",
            }
        )
    )
    assert setup.task.kind == "classification" and len(setup.partition or []) == 4
    whole = torch.cat([setup.data.x, setup.data.test_x])
    assert sorted(map(tuple, whole.tolist())) == sorted(
        map(tuple, torch.from_numpy(x).tolist())
    )  # no row lost
    record, _ = train_ref(tmp_path, ref, **{"data.model": "logreg"})
    assert_own_name(record, "byo-hf-points", setup.data.fingerprint)


def test_flwr_datasets_partition_becomes_the_clients(tmp_path: Path) -> None:
    hf = hf_datasets()
    DirichletPartitioner = pytest.importorskip("flwr_datasets.partitioner").DirichletPartitioner  # noqa: N806

    x, y = features(120)
    tx, ty = features(30, seed=1)
    ds = hf.Dataset.from_dict({"x": x, "label": y})
    test = hf.Dataset.from_dict({"x": tx, "label": ty})
    partitioner = DirichletPartitioner(
        num_partitions=5, partition_by="label", alpha=0.5, seed=3, min_partition_size=4
    )
    ref = data_ref(ds, name="flwr-dirichlet", partition=partitioner, test=test)
    setup = build(
        build_config(
            overrides={
                "data.file": ref,
                "data.model": "mlp",
                "train.clients_per_round": 2,
                "train.device": "cpu",
            }
        )
    )
    assert len(setup.partition or []) == 5 and len(setup.data.test_y) == 30
    partitioner.dataset = ds  # the user's partitioner was left untouched: it takes the dataset as usual
    for k, ix in enumerate(setup.partition or []):  # client k holds exactly the rows of flwr's partition k
        theirs = np.asarray(partitioner.load_partition(k).with_format("numpy")[:]["x"])
        assert sorted(map(tuple, setup.data.x[ix].tolist())) == sorted(map(tuple, theirs.tolist())), k
    assert data_ref(partitioner, name="flwr-dirichlet", test=test) == ref  # its dataset assigned already
    record, _ = train_ref(tmp_path, ref)
    assert_own_name(record, "byo-flwr-dirichlet", setup.data.fingerprint)


def test_function_reference_from_the_cli_records_its_source_hash(tmp_path: Path) -> None:
    x, y = features()
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    source = tmp_path / "mydata.py"
    source.write_text(
        "import numpy as np, torch\nfrom torch.utils.data import TensorDataset\n\n\n"
        "def load():\n    x, y = np.load('x.npy'), np.load('y.npy')\n"
        "    return {'data': TensorDataset(torch.from_numpy(x), torch.from_numpy(y)),\n"
        "            'client': np.arange(len(y)) % 5}\n"
    )
    url = f"sqlite:///{tmp_path / 's.db'}"
    done = fedcli(
        tmp_path,
        "train",
        "--data",
        "./mydata.py:load",
        "--model",
        "mlp",
        "--rounds",
        "2",
        "--clients-per-round",
        "2",
        "--root",
        str(tmp_path),
        "--store",
        url,
        "--no-mlflow",
    )
    assert done.returncode == 0, done.stderr
    record = SqlStore(url).get_run(done.stdout.strip().splitlines()[-1])
    data = record.config["data"]
    assert data["file"] == f"{source.resolve()}:load" and data["task"] == "byo-mydata-load"
    assert data["source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert record.tags["fedcli.dataset"] == "byo-mydata-load" and len(data["fingerprint"]) == 64


BAD_SOURCES = {
    "no labels": ("TensorDataset(torch.zeros(20, 3))", "no labels", ""),
    "client of the wrong length": (
        "{'data': TensorDataset(torch.zeros(20, 3), torch.zeros(20).long()), 'client': [0, 1, 2]}",
        "one id per example (length 20)",
        "",
    ),
    "augment on features": (
        "{'data': TensorDataset(torch.zeros(20, 3), torch.zeros(20).long()), 'client': np.arange(20) % 4}",
        "needs images",
        "data:\n  augment: [flip]\n",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SOURCES))
def test_bad_data_exits_2_with_one_line_and_writes_nothing(tmp_path: Path, case: str) -> None:
    made, message, config = BAD_SOURCES[case]
    (tmp_path / "bad.py").write_text(
        f"import numpy as np, torch\nfrom torch.utils.data import TensorDataset\n\n\n"
        f"def load():\n    return {made}\n"
    )
    extra = ["--config", "run.yaml"] if config else []
    if config:
        (tmp_path / "run.yaml").write_text(config)
    root = tmp_path / "root"
    done = fedcli(
        tmp_path,
        "train",
        "--data",
        "bad.py:load",
        "--model",
        "mlp",
        "--rounds",
        "1",
        "--root",
        str(root),
        "--no-mlflow",
        *extra,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert not root.exists()  # no store, no run folder


def test_bad_objects_raise_one_line_before_anything_is_registered() -> None:
    with pytest.raises(DataError, match="no labels"):
        data_ref(TensorDataset(torch.zeros(5, 2)))
    with pytest.raises(DataError, match="one id per example"):
        data_ref(TensorDataset(torch.zeros(5, 2), torch.zeros(5).long()), client=[0, 1])
    with pytest.raises(DataError, match="repeats an example"):
        data_ref(TensorDataset(torch.zeros(5, 2), torch.zeros(5).long()), partition=[[0, 1], [1, 2]])
    with pytest.raises(ConfigError, match="a torch Dataset, a Hugging Face Dataset"):
        data_ref(42)
    with pytest.raises(ConfigError, match="another process"):
        build(
            build_config(
                overrides={
                    "data.file": "python:gone@0123456789abcdef",
                    "data.model": "mlp",
                    "train.device": "cpu",
                    "partition.scheme": "iid",
                    "partition.num_clients": 2,
                    "train.clients_per_round": 2,
                }
            )
        )


def test_resume_refuses_data_whose_content_changed(tmp_path: Path) -> None:
    """A data file rewritten between a run and its resume: the fingerprint differs, one line, exit 2."""
    x, y = features()
    np.savez(tmp_path / "mydata.npz", x=x, y=y, client=np.arange(len(y)) % 5)
    root = tmp_path / "root"
    done = fedcli(
        tmp_path,
        "train",
        "--data",
        "mydata.npz",
        "--model",
        "mlp",
        "--rounds",
        "2",
        "--clients-per-round",
        "2",
        "--root",
        str(root),
        "--no-mlflow",
    )
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.strip().splitlines()[-1]
    np.savez(tmp_path / "mydata.npz", x=x + 1, y=y, client=np.arange(len(y)) % 5)
    resumed = fedcli(tmp_path, "train", "--root", str(root), "--resume", run_id[:8], "--rounds", "3")
    assert resumed.returncode == 2, resumed.stderr
    assert "fingerprint" in resumed.stderr and len(resumed.stderr.strip().splitlines()) == 1, resumed.stderr
    assert SqlStore(f"sqlite:///{root / 'fedcli.db'}").get_run(run_id).status == "finished"


def test_a_runs_partition_file_is_reused_with_the_same_data_file(tmp_path: Path) -> None:
    """The partition a run keeps (partition.json, made for byo-mydata) is accepted by --partition with the
    same file: the check compares it with the data's own name, not the default task's."""
    x, y = features()
    np.savez(tmp_path / "mydata.npz", x=x, y=y)
    url = f"sqlite:///{tmp_path / 's.db'}"
    base = {
        "data.file": str(tmp_path / "mydata.npz"),
        "data.model": "mlp",
        "train.clients_per_round": 2,
        "train.device": "cpu",
        "train.rounds": 1,
        "tracking.root": str(tmp_path),
        "tracking.store": url,
        "tracking.use_mlflow": False,
    }
    first = run_training(
        build_config(overrides={**base, "partition.scheme": "iid", "partition.num_clients": 4}),
        tracker=Tracker(SqlStore(url)),
    )
    kept = tmp_path / "runs" / first.run_id / "partition.json"
    assert json.loads(kept.read_text())["dataset"] == "byo-mydata"
    again = build(build_config(overrides={**base, "partition.file": str(kept)}))
    made = build(build_config(overrides={**base, "partition.scheme": "iid", "partition.num_clients": 4}))
    assert [ix.tolist() for ix in again.partition or []] == [ix.tolist() for ix in made.partition or []]


def test_pil_images_and_hf_image_columns_are_read_channels_first() -> None:
    """A torchvision-style dataset without a transform gives PIL images [H, W, C]; an HF Image column reads
    as [N, H, W, C]: both become uint8 [N, C, H, W] (scaled by 1/255 like an .npz's uint8 images)."""
    from PIL import Image

    from fedcli.datasets.yours.data import materialise

    hf = hf_datasets()
    pixels = np.random.default_rng(0).integers(0, 256, (4, 6, 5, 3), dtype=np.uint8)
    pictures = [Image.fromarray(p) for p in pixels]

    class Pictures(Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> tuple[Any, int]:
            return pictures[i], i % 2

    want = torch.from_numpy(pixels.transpose(0, 3, 1, 2).copy())
    got = materialise(Pictures())
    assert got.x.dtype == torch.uint8 and torch.equal(got.x, want)
    features = hf.Features({"img": hf.Image(), "label": hf.Value("int64")})
    column = materialise(
        hf.Dataset.from_dict({"img": pictures, "label": [0, 1, 0, 1]}, features=features), x="img"
    )
    assert column.x.dtype == torch.uint8 and torch.equal(column.x, want)
