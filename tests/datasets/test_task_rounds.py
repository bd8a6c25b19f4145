"""Every task added in issue 3 trains one FedAvg round through the engine (vmap), so none rots.

Each task loads its data the real way (bundled files, or tiny files in the publisher's
format for data fedcli does not bundle), keeps 2 clients x 4 examples, runs
`fedcli.engine.rounds.run_round` with the default model and evaluates with the engine's
`evaluate` (loss for every kind; accuracy for classification; dist_to_opt where known).
Multi-label and next-token tasks also get their metrics from datasets/metrics.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcli.algorithms import ALGORITHMS
from fedcli.config.build import build_config
from fedcli.config.checks import make_hyperparameters
from fedcli.datasets import metrics
from fedcli.datasets.bundled.stackoverflow import BOS, EOS, OOV, PAD
from fedcli.datasets.federated import FederatedData
from fedcli.datasets.registry import TASKS
from fedcli.datasets.tasks import TaskOptions
from fedcli.engine.backends.vmap import VmapBackend
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.evaluation import evaluate
from fedcli.engine.model import model_functions
from fedcli.engine.rounds import Timing, run_round
from fedcli.engine.setup import Setup
from tests.datasets._format_writers import write_task_fixture

BUNDLED = (
    "mnist",
    "shakespeare",
    "bibtex",
    "quadratic-2d",
    "synthetic-0-0",
    "synthetic-0.5-0.5",
    "synthetic-1-1",
    "synthetic-iid",
)
FIXTURES = (
    "fashion-mnist",
    "cifar10",
    "cifar100",
    "emnist",
    "stackoverflow-nwp",
    "stackoverflow-lr",
    "sent140",
    "har",
    "vehicle",
)


# Cut sequences / images where the model does not fix the input size, to keep each round
# under a second on a shared CPU: the LSTMs are length-agnostic, ResNet-18 pools globally.
SHRINK = {
    "shakespeare": lambda x, y: (x[:, -8:], y),
    "sent140": lambda x, y: (x[:, :8], y),
    "stackoverflow-nwp": lambda x, y: (x[:, :6], y[:, :6]),
    "cifar100": lambda x, y: (x[..., :8, :8], y),
}


def _shrink(name: str, data):  # noqa: ANN001, ANN202
    if name not in SHRINK:
        return data
    x, y = SHRINK[name](data.x, data.y)
    test_x, test_y = SHRINK[name](data.test_x, data.test_y)
    return dataclasses.replace(
        data, x=x.contiguous(), y=y.contiguous(), test_x=test_x.contiguous(), test_y=test_y.contiguous()
    )


def _tiny_clients(data, per_client: int = 4) -> list[np.ndarray]:  # noqa: ANN001
    if data.client_indices and len(data.client_indices) >= 2:
        return [np.asarray(c[:per_client]) for c in data.client_indices[:2]]
    return [np.arange(per_client), np.arange(per_client, 2 * per_client - 1)]  # unequal sizes 4 and 3


@pytest.mark.slow
@pytest.mark.parametrize("name", BUNDLED + FIXTURES)
def test_one_round(name: str, tmp_path: Path) -> None:
    task = TASKS[name]
    data_dir = write_task_fixture(name, tmp_path) if name in FIXTURES else None
    data = _shrink(name, task.load(TaskOptions(seed=0, data_dir=data_dir)))
    clients = _tiny_clients(data)
    cfg = build_config(
        overrides={
            "algorithm.name": "fedavg",
            "data.task": name,
            "train.clients_per_round": 2,
            "train.batch_size": 4,
            "train.executor": "vmap",
            "train.client_lr": 0.05,
        }
    )
    torch.manual_seed(0)
    model = task.models[task.default_model]()
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    fed = FederatedData(data.x, data.y, clients, torch.device("cpu"))
    alg = ALGORITHMS["fedavg"]
    hp = make_hyperparameters("fedavg", {})
    setup = Setup(
        cfg,
        task,
        data,
        fed,
        model_functions(task, model, fed),
        alg,
        hp,
        torch.device("cpu"),
        VmapBackend(),
        init,
        opt=cfg.train.optim(task.client_lr),
    )
    state = alg.server_init(init, hp, setup.opt)
    state, round_metrics = run_round(setup, state, ClientStateStore(None), 1, Timing())
    params = alg.global_params(state)
    assert np.isfinite(round_metrics["train/loss"])
    assert any(not torch.equal(params[k], init[k]) for k in init)
    test_x, test_y = data.test_x[:4], data.test_y[:4]
    scores = evaluate(task, setup.fns, params, test_x, test_y, data.optimum)
    assert all(np.isfinite(v) for v in scores.values())
    assert ("eval/accuracy" in scores) == (task.kind in ("classification", "next_token"))
    assert ("eval/dist_to_opt" in scores) == (data.optimum is not None)
    output = setup.fns.apply_fn(params, task.prepare(test_x))
    if task.kind == "multilabel":
        assert set(metrics.multilabel_metrics(output, test_y)) == {
            "precision",
            "recall_at_5",
            "micro_f1",
            "macro_f1",
        }
    if task.kind == "next_token":
        values = metrics.token_metrics(output, test_y, pad_id=PAD, special_ids=(OOV, BOS, EOS))
        assert values["perplexity"] > 1.0
