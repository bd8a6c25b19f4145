"""--eval-sample (a fixed, seeded sample of the test split) and streaming evaluation (issue 32 item 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fedcli
from fedcli.datasets.registry import TASKS
from fedcli.datasets.tasks import TaskOptions
from fedcli.engine.evaluation import (
    PAPER_EVAL_SAMPLE,
    eval_sample_index,
    evaluate_clients,
    evaluate_predictions,
    resolve_eval_sample,
)

ROOT = Path(__file__).resolve().parents[2]


def test_sample_index_is_fixed_sorted_and_distinct() -> None:
    a = eval_sample_index(100_003, 1000)
    eval_sample_index.cache_clear()
    b = eval_sample_index(100_003, 1000)
    assert a is not None and b is not None and np.array_equal(a, b)
    assert len(np.unique(a)) == 1000 and np.all(np.diff(a) > 0) and a.max() < 100_003
    c = eval_sample_index(100_004, 1000)
    assert c is not None and not np.array_equal(a, c)  # drawn for this split's size
    assert eval_sample_index(500, 0) is None and eval_sample_index(500, 500) is None


def test_paper_defaults() -> None:
    assert resolve_eval_sample(None, "stackoverflow-nwp") == 10_000 == PAPER_EVAL_SAMPLE["stackoverflow-lr"]
    assert resolve_eval_sample(None, "emnist") == 0 and resolve_eval_sample(None, "femnist") == 0
    assert resolve_eval_sample(0, "stackoverflow-nwp") == 0 and resolve_eval_sample(7, "femnist") == 7


def _linear(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 62))


def test_indexed_and_streamed_evaluation_match_the_materialised_split() -> None:
    task = TASKS["femnist"]
    data = task.load(TaskOptions())
    model = _linear()
    cpu = torch.device("cpu")
    index = eval_sample_index(len(data.test_y), 777)
    assert index is not None
    got = evaluate_predictions(
        task, model, task.prepare, data.test_x, data.test_y, device=cpu, chunk=100, index=index
    )
    ix = torch.as_tensor(np.array(index))
    ref = evaluate_predictions(
        task, model, task.prepare, data.test_x[ix], data.test_y[ix], device=cpu, chunk=100
    )
    assert got == ref
    whole = evaluate_predictions(task, model, task.prepare, data.test_x, data.test_y, device=cpu, chunk=100)
    assert whole["eval/loss"] != got["eval/loss"]
    # per-client view: clients share chunks (one of 16 examples spans several), equal to one client at a time
    clients = data.test_client_indices
    assert clients is not None and max(len(c) for c in clients) > 16
    streamed = evaluate_clients(
        task, model, task.prepare, data.test_x, data.test_y, clients, device=cpu, chunk=16
    )
    one_by_one = [
        evaluate_predictions(
            task,
            model,
            task.prepare,
            data.test_x[torch.as_tensor(c)],
            data.test_y[torch.as_tensor(c)],
            device=cpu,
            chunk=16,
        )
        for c in clients
        if len(c)
    ]
    assert len(streamed) == len(one_by_one) == sum(1 for c in clients if len(c))
    for s, o in zip(streamed, one_by_one, strict=True):
        assert s["eval/accuracy"] == o["eval/accuracy"]
        assert s["eval/loss"] == pytest.approx(o["eval/loss"], rel=1e-5)


def _run(tmp_path: Path, name: str, **settings: object) -> fedcli.api.Run:
    return fedcli.train(
        "fedavg",
        task="femnist",
        clients_per_round=3,
        batch_size=20,
        root=str(tmp_path / name),
        no_mlflow=True,
        seed=4,
        **settings,
    )


def test_a_run_evaluates_the_same_sample_every_round_and_after_resume(tmp_path: Path) -> None:
    full = _run(tmp_path, "full", rounds=2, eval_sample=0)
    sampled = _run(tmp_path, "sampled", rounds=2, eval_sample=300)
    assert sampled.config["train"]["eval_sample"] == 300 and full.config["train"]["eval_sample"] == 0
    part = _run(tmp_path, "resumed", rounds=1, eval_sample=300)
    resumed = fedcli.train(resume=part.id, rounds=2, root=str(tmp_path / "resumed"), no_mlflow=True)
    a, b = sampled.metrics(), resumed.metrics()
    assert a.loc[2, "eval/loss"] == b.loc[2, "eval/loss"] and a.loc[1, "eval/loss"] == b.loc[1, "eval/loss"]
    assert a.loc[2, "eval/loss"] != full.metrics().loc[2, "eval/loss"]  # same model, another set of examples
    # the final round's number is the model's loss on exactly the sampled examples
    task, data = TASKS["femnist"], TASKS["femnist"].load(TaskOptions())
    index = eval_sample_index(len(data.test_y), 300)
    assert index is not None
    module = sampled.model()
    ref = evaluate_predictions(
        task, module, lambda x: x, data.test_x, data.test_y, device=torch.device("cpu"), index=index
    )
    assert ref["eval/loss"] == pytest.approx(a.loc[2, "eval/loss"], rel=1e-6)
    assert ref["eval/accuracy"] == pytest.approx(a.loc[2, "eval/accuracy"], abs=1e-12)
    # `fedcli evaluate` scores the run's recorded sample unless told otherwise
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "evaluate",
            sampled.id[:8],
            "--root",
            str(tmp_path / "sampled"),
            "--no-mlflow",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["eval_sample"] == 300 and doc["metrics"]["test/loss"] == pytest.approx(
        ref["eval/loss"], rel=1e-6
    )


def test_bad_eval_sample_is_one_line_exit_2(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "train",
            "--rounds",
            "1",
            "--eval-sample",
            "-3",
            "--root",
            str(tmp_path),
            "--no-mlflow",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 2 and "--eval-sample" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "fedcli.db").exists()
    with pytest.raises(fedcli.errors.ConfigError, match="eval_sample"):
        fedcli.train("fedavg", rounds=1, root=str(tmp_path), no_mlflow=True, train={"eval_sample": -1})


def test_chunks_shrink_to_what_their_forward_makes_and_keep_the_metrics() -> None:
    """A forward that makes ~1 MiB per example runs in chunks of at most ACTIVATION_BUDGET / 1 MiB
    examples after the first (the probe); a light one keeps `chunk`; the metrics are the same."""
    from fedcli.engine.evaluation import ACTIVATION_BUDGET, PROBE_CHUNK

    task = TASKS["femnist"]
    data = task.load(TaskOptions())
    model = _linear()
    sizes: dict[str, list[int]] = {"heavy": [], "light": []}

    def heavy(xb: torch.Tensor) -> torch.Tensor:
        sizes["heavy"].append(len(xb))
        wide = xb.reshape(len(xb), -1).repeat(
            1, 2**18 // xb[0].numel() + 1
        )  # >= 1 MiB of float32 per example
        return model(xb) + 0 * wide[:, :1]

    def light(xb: torch.Tensor) -> torch.Tensor:
        sizes["light"].append(len(xb))
        return model(xb)

    cpu = torch.device("cpu")
    x, y = data.test_x, data.test_y
    assert len(y) > 2 * 512
    got = {
        k: evaluate_predictions(task, f, task.prepare, x, y, device=cpu, chunk=512)
        for k, f in (("heavy", heavy), ("light", light))
    }
    assert sizes["heavy"][0] == sizes["light"][0] == PROBE_CHUNK
    assert max(sizes["heavy"][1:]) <= ACTIVATION_BUDGET // 2**20 < 512
    assert max(sizes["light"][1:]) == 512
    assert got["heavy"]["eval/accuracy"] == got["light"]["eval/accuracy"]
    assert abs(got["heavy"]["eval/loss"] - got["light"]["eval/loss"]) < 1e-6 * abs(got["light"]["eval/loss"])
