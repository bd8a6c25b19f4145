"""Bring-your-own files, FedProx synthetic(alpha, beta) and the FedPA 2-D quadratic toy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from fedcli.datasets.bundled.fedprox_synthetic import generate_synthetic
from fedcli.datasets.bundled.quadratic import QUADRATIC_2D, quadratic_clients
from fedcli.datasets.registry import TASKS
from fedcli.datasets.tasks import TaskOptions
from fedcli.datasets.yours.files import byo_task
from fedcli.errors import ConfigError, DataError


def test_byo_npz_with_clients_and_images(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "mine.npz",
        x=rng.integers(0, 256, (10, 8, 8), dtype=np.uint8),
        y=np.arange(10) % 3,
        client=np.array(list("bbaab" * 2)),
        x_test=np.zeros((2, 8, 8), np.uint8),
        y_test=np.array([0, 1]),
    )
    task = byo_task(tmp_path / "mine.npz", "cnn")
    data = task.load(TaskOptions())
    assert task.name == "byo-mine" and task.kind == "classification" and data.num_classes == 3
    assert data.client_names == ["a", "b"] and [len(c) for c in data.client_indices] == [4, 6]
    out = task.models["cnn"]()(task.prepare(data.x[:2]))
    assert out.shape == (2, 3)


def test_byo_csv_regression_holds_out_a_test_split(tmp_path: Path) -> None:
    frame = pd.DataFrame({"f1": np.arange(10.0), "f2": np.ones(10), "y": np.linspace(0, 1, 10)})
    frame.to_csv(tmp_path / "reg.csv", index=False)
    task = byo_task(tmp_path / "reg.csv", "mlp")
    data = task.load(TaskOptions())
    assert (
        task.kind == "regression" and len(data.y) == 8 and len(data.test_y) == 2 and data.client_indices == []
    )
    assert task.models["mlp"]()(data.x[:3]).shape == (3,)


def test_byo_parquet_with_split_column(tmp_path: Path) -> None:
    frame = pd.DataFrame(
        {"a": [0.0, 1.0, 2.0], "y": [0, 1, 1], "client": [7, 7, 9], "split": ["train", "train", "test"]}
    )
    frame.to_parquet(tmp_path / "t.parquet")
    data = byo_task(tmp_path / "t.parquet", "logreg").load(TaskOptions())
    assert data.x.shape == (2, 1) and data.test_y.tolist() == [1] and data.client_names == ["7"]


@pytest.mark.parametrize(
    "setup, model, error, message",
    [
        (
            lambda d: (d / "a.txt").write_text("x"),
            "mlp",
            ConfigError,
            r"--data must be a \.npz, \.csv, \.parquet file",
        ),
        (
            lambda d: pd.DataFrame({"a": [1.0]}).to_csv(d / "a.csv", index=False),
            "mlp",
            DataError,
            r"has no column 'y'",
        ),
        (
            lambda d: pd.DataFrame({"a": ["s"], "y": [1]}).to_csv(d / "a.csv", index=False),
            "mlp",
            DataError,
            r"feature columns must be numeric",
        ),
        (lambda d: np.savez(d / "a.npz", x=np.zeros((5, 3))), "mlp", DataError, r"lacks array\(s\) y"),
        (
            lambda d: np.savez(d / "a.npz", x=np.zeros((5, 3)), y=np.zeros(5)),
            "logreg",
            ConfigError,
            r"--model logreg needs integer class labels",
        ),
        (
            lambda d: np.savez(d / "a.npz", x=np.zeros((5, 3)), y=np.arange(5)),
            "cnn",
            ConfigError,
            r"--model cnn needs images",
        ),
        (
            lambda d: np.savez(d / "a.npz", x=np.zeros((5, 3)), y=np.arange(5)),
            "resnet",
            ConfigError,
            r"--model must be one of linear, logreg, mlp, cnn",
        ),
    ],
)
def test_byo_errors(tmp_path: Path, setup, model: str, error: type, message: str) -> None:  # noqa: ANN001
    setup(tmp_path)
    path = next(tmp_path.iterdir())
    with pytest.raises(error, match=message):
        byo_task(path, model)


def test_fedprox_synthetic_follows_the_generator() -> None:
    """30 users, n_k = int(LogNormal(4, 2)) + 50 >= 50, 60 features; IID: one W, b for all users
    and v_k = 0, so pooled features have mean ~0 and the label rule is shared."""
    xs, ys = generate_synthetic(alpha=1.0, beta=1.0, iid=False, rng=np.random.default_rng(0))
    assert len(xs) == 30 and min(len(y) for y in ys) >= 50 and xs[0].shape[1] == 60
    assert all(y.min() >= 0 and y.max() <= 9 for y in ys)
    xs_iid, _ = generate_synthetic(alpha=0.0, beta=0.0, iid=True, rng=np.random.default_rng(0))
    assert abs(np.concatenate(xs_iid).mean()) < 0.05
    again, _ = generate_synthetic(alpha=1.0, beta=1.0, iid=False, rng=np.random.default_rng(0))
    assert all(np.array_equal(a, b) for a, b in zip(xs, again, strict=True))
    data = TASKS["synthetic-1-1"].load(TaskOptions(seed=3))
    assert data.fingerprint != TASKS["synthetic-1-1"].load(TaskOptions(seed=4)).fingerprint
    assert len(data.client_indices) == 30


def test_quadratic_toy_optimum_is_exact() -> None:
    """Each client's rows give X^T X / n = A_i and X^T y / n = A_i mu_i, so the example-weighted
    objective's gradient sum_i n_i (A_i theta - A_i mu_i) vanishes at the logged optimum, and
    its least-squares solution over the pooled rows is that optimum."""
    xs, ys, optimum, precisions, optima = quadratic_clients(
        copies=(1, 3), dim=2, rng=np.random.default_rng(0)
    )
    for x, y, a, mu in zip(xs, ys, precisions, optima, strict=True):
        np.testing.assert_allclose(x.T @ x / len(x), a, rtol=1e-12)
        np.testing.assert_allclose(x.T @ y / len(x), a @ mu, rtol=1e-10)
        assert np.all(np.linalg.eigvalsh(a) >= 1.0 - 1e-9) and np.all(np.linalg.eigvalsh(a) <= 10.0 + 1e-9)
    gradient = sum(len(x) * a @ (optimum - mu) for x, a, mu in zip(xs, precisions, optima, strict=True))
    np.testing.assert_allclose(gradient, 0.0, atol=1e-9)
    pooled = np.linalg.lstsq(np.concatenate(xs), np.concatenate(ys), rcond=None)[0]
    np.testing.assert_allclose(pooled, optimum, rtol=1e-9)
    data = QUADRATIC_2D.load(TaskOptions(seed=0))
    assert [len(c) for c in data.client_indices] == [2, 6]
    torch.testing.assert_close(data.optimum, torch.as_tensor(optimum, dtype=torch.float32))
