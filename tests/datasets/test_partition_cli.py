"""`fedcli partition` through CliRunner: every scheme on the bundled data, files, plots, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedcli.cli.main import app
from fedcli.datasets.partition.files import load_partition

RUNNER = CliRunner()

MNIST_SCHEMES = [
    ["--scheme", "iid", "--clients", "20"],
    ["--scheme", "dirichlet", "--alpha", "0.1", "--clients", "10"],
    ["--scheme", "dirichlet", "--alpha", "0.5", "--clients", "20", "--balanced"],
    ["--scheme", "shards", "--clients", "100", "--shards-per-client", "2"],
    ["--scheme", "labels", "--clients", "20", "--labels-per-client", "2"],
    ["--scheme", "quantity", "--alpha", "1.0", "--clients", "10"],
    ["--scheme", "quantity", "--sigma", "1.0", "--clients", "20"],
    ["--scheme", "two-level", "--alpha", "0.5", "--clients", "10"],
]


@pytest.mark.parametrize("args", MNIST_SCHEMES, ids=lambda a: "-".join(a[1:4:2]))
def test_every_scheme_on_bundled_mnist(tmp_path: Path, args: list[str]) -> None:
    out = tmp_path / "p.json"
    # wide enough that neither the table nor the path wraps (a pytest-xdist worker's tmp_path is longer)
    result = RUNNER.invoke(
        app, ["partition", "--dataset", "mnist", *args, "--out", str(out)], env={"COLUMNS": "300"}
    )
    assert result.exit_code == 0, result.output
    clients = int(args[args.index("--clients") + 1])
    doc = json.loads(out.read_text())
    assert doc["num_clients"] == clients and doc["dataset"] == "mnist" and doc["version"] == 1
    assert "label entropy per client" in result.stdout and f"wrote {out}" in result.stderr


def test_femnist_natural_has_105_clients(tmp_path: Path) -> None:
    out, plot = tmp_path / "f.json", tmp_path / "f.png"
    result = RUNNER.invoke(
        app,
        ["partition", "--dataset", "femnist", "--scheme", "natural", "--out", str(out), "--plot", str(plot)],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["num_clients"] == 105
    assert "│ 105 " in result.stdout and plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "dataset, args",
    [
        ("shakespeare", ["--scheme", "natural"]),
        ("bibtex", ["--scheme", "dirichlet", "--alpha", "0.3", "--clients", "10"]),
        ("quadratic-2d", ["--scheme", "natural"]),
    ],
)
def test_other_bundled_sets(tmp_path: Path, dataset: str, args: list[str]) -> None:
    out = tmp_path / "p.json"
    result = RUNNER.invoke(app, ["partition", "--dataset", dataset, *args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.exists()


def test_same_seed_same_bytes_and_train_can_load_it(tmp_path: Path) -> None:
    args = [
        "partition",
        "--dataset",
        "mnist",
        "--scheme",
        "dirichlet",
        "--alpha",
        "0.3",
        "--clients",
        "5",
        "--seed",
        "4",
        "--out",
    ]
    assert RUNNER.invoke(app, [*args, str(tmp_path / "a.json")]).exit_code == 0
    assert RUNNER.invoke(app, [*args, str(tmp_path / "b.json")]).exit_code == 0
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    from fedcli.datasets.bundled.mnist import MNIST
    from fedcli.datasets.tasks import TaskOptions

    clients, spec = load_partition(
        tmp_path / "a.json", dataset="mnist", fingerprint=MNIST.load(TaskOptions()).fingerprint
    )
    assert spec.seed == 4 and spec.alpha == 0.3 and len(clients) == 5


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--dataset", "mnist", "--scheme", "dirichlet", "--alpha", "-0.5", "--clients", "5"],
            "alpha must be > 0",
        ),
        (["--dataset", "mnsit", "--scheme", "iid", "--clients", "5"], "did you mean 'mnist'"),
        (
            ["--dataset", "mnist", "--scheme", "iid", "--clients", "9000"],
            "exceeds the 8000 training examples",
        ),
        (
            ["--dataset", "mnist", "--scheme", "shards", "--clients", "7", "--shards-per-client", "2"],
            "must divide",
        ),
        (["--dataset", "mnist", "--scheme", "natural"], "needs data with owners"),
    ],
)
def test_mistakes_exit_2_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    result = RUNNER.invoke(app, ["partition", *args, "--out", str(tmp_path / "x.json")])
    assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "x.json").exists()
