"""The `fused` back end (engine/backends/fused.py): hand-derived cohort local SGD for dense classifiers.

Checks, in order: the closed form of one step on a softmax-regression client; the hand-derived
backward pass of every supported model against autograd; fused = loop (the reference) for every
algorithm that declares its local SGD (Algorithm.local), with uneven clients, momentum and
several epochs, in-process, chunked and inside worker processes; the cohort's requests taken in
one vmapped call; and the back-end choice and its error line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from fedcli.algorithms import ALGORITHMS
from fedcli.algorithms.base import LocalSGD, OptimConfig
from fedcli.algorithms.optim import train_local
from fedcli.config.build import build_config
from fedcli.datasets import models
from fedcli.datasets.federated import FederatedData
from fedcli.engine.backends.fused import DenseSpec, dense_local_sgd, dense_spec
from fedcli.engine.cohort import make_context
from fedcli.engine.setup import build
from fedcli.errors import ConfigError
from tests.engine.test_equivalence import required_hyperparameters, two_rounds

# every algorithm that declares its local SGD, except the LSA ones (their server_init refuses classifiers)
FUSED = sorted(
    name for name, alg in ALGORITHMS.items() if alg.local is not None and name not in ("fedlsa", "scafflsa")
)


def per_client(params: dict, clients: int) -> dict:
    """The same start for every client, as the fused back end receives it: [C, ...] expanded views."""
    return {k: v.expand(clients, *v.shape) for k, v in params.items()}


def cohort(sizes: list[int], features: int, classes: int, batch: int, epochs: int, seed: int = 0):  # noqa: ANN201
    """A FederatedData of len(sizes) clients of random examples and its plan for one round."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    x, y = (
        torch.randn(n, features, generator=gen, dtype=torch.float64),
        torch.randint(classes, (n,), generator=gen),
    )
    bounds = np.cumsum([0, *sizes])
    fed = FederatedData(
        x,
        y,
        [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)],
        torch.device("cpu"),
        dtype=torch.float64,
    )
    rngs = [np.random.default_rng(seed + c) for c in range(len(sizes))]
    return fed, fed.plan(np.arange(len(sizes)), num_epochs=epochs, batch_size=batch, rngs=rngs)


def test_one_step_of_softmax_regression_is_the_closed_form_gradient_step() -> None:
    """One client, one full batch, W' = W - lr (softmax(X W^T + b) - Y)^T X / n, b' = b - lr sum(P - Y) / n.

    The gradient of the mean cross-entropy of softmax regression, written out; no autograd.
    """
    fed, plan = cohort([7], features=5, classes=3, batch=8, epochs=1)
    gen = torch.Generator().manual_seed(1)
    start = {
        "linear.weight": torch.randn(3, 5, generator=gen, dtype=torch.float64),
        "linear.bias": torch.randn(3, generator=gen, dtype=torch.float64),
    }
    lr = 0.3
    result = dense_local_sgd(
        DenseSpec((("linear.weight", "linear.bias"),), "identity"),
        fed.x,
        fed.y,
        lambda x: x,
        per_client(start, 1),
        plan,
        OptimConfig(client_lr=lr),
        average_epochs=False,
    )
    x, y = fed.x, F.one_hot(fed.y, 3).to(torch.float64)
    residual = torch.softmax(x @ start["linear.weight"].T + start["linear.bias"], dim=1) - y  # P - Y
    expected_w = start["linear.weight"] - lr * residual.T @ x / 7
    expected_b = start["linear.bias"] - lr * residual.sum(0) / 7
    torch.testing.assert_close(result.params["linear.weight"][0], expected_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(result.params["linear.bias"][0], expected_b, rtol=1e-12, atol=1e-12)
    expected_loss = F.cross_entropy(x @ start["linear.weight"].T + start["linear.bias"], fed.y)
    torch.testing.assert_close(result.mean_loss[0], expected_loss, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "model",
    [
        models.MLP(6, (5, 4), 3),
        models.SigmoidMLP(6, (5,), 3),
        models.Linear(6, 3),
        models.Linear(6, 3, bias=False),
    ],
    ids=["relu-mlp", "sigmoid-mlp", "logreg", "logreg-no-bias"],
)
@pytest.mark.slow
@pytest.mark.parametrize(
    "momentum,mu,linear",
    [
        (0.0, 0.0, False),
        (0.9, 0.0, False),
        (0.0, 0.7, False),
        (0.9, 0.7, False),
        (0.0, 0.0, True),
        (0.9, 0.0, True),
        (0.9, 0.7, True),
    ],
)
def test_hand_derived_training_equals_autograd_local_sgd_client_by_client(
    model: torch.nn.Module, momentum: float, mu: float, linear: bool
) -> None:
    """dense_local_sgd on a cohort of uneven clients (2 epochs, padded last batches, sorted and
    unsorted internally) = optim.train_local through autograd run on each client alone, in float64:
    last iterate, IASG epoch means and mean loss; with mu > 0 both follow FedProx's objective
    F_k + mu/2 ||w - w_start||^2, with `linear` SCAFFOLD's corrected gradient g + l_c with a
    per-client constant l_c (both declared in the same LocalSGD)."""
    model = model.double()
    spec = dense_spec(model)
    assert spec is not None
    fed, plan = cohort([9, 23, 4, 15], features=6, classes=3, batch=5, epochs=2)
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = OptimConfig(client_lr=0.2, client_momentum=momentum)
    gen = torch.Generator().manual_seed(7)
    terms = (
        {k: 0.3 * torch.randn((4, *v.shape), generator=gen, dtype=torch.float64) for k, v in start.items()}
        if linear
        else None
    )
    fused = dense_local_sgd(
        spec,
        fed.x,
        fed.y,
        lambda x: x,
        per_client(start, 4),
        plan,
        opt,
        average_epochs=True,
        prox_mu=mu,
        linear=terms,
    )

    def loss_fn(params, batch):  # noqa: ANN001, ANN202 - the back ends' task loss, on this model
        out = torch.func.functional_call(model, params, (batch.x,))
        return (
            F.cross_entropy(out, batch.y, reduction="none") * batch.weight
        ).sum() / batch.weight.sum().clamp_min(1)

    fns = type(
        "Fns",
        (),
        {
            "loss_fn": staticmethod(loss_fn),
            "apply_fn": None,
            "data": fed,
            "prepare": staticmethod(lambda x: x),
        },
    )()
    for c in range(4):
        own = plan.for_client(c)
        ctx = make_context(
            fns,
            own.index[0],
            own.weight[0],
            own.step_mask[0],
            torch.zeros(own.index.shape[1]),
            own.num_examples[0],
            {},
            plan.num_epochs,
            own.steps_per_epoch,
            1,
        )
        request = LocalSGD(
            start=start,
            prox_mu=mu,
            linear=None if terms is None else {k: v[c] for k, v in terms.items()},
            average_epochs=True,
        )
        ref = train_local(ctx, request, opt)
        for name in start:
            torch.testing.assert_close(fused.params[name][c], ref.params[name], rtol=1e-10, atol=1e-12)
            for epoch in range(2):
                torch.testing.assert_close(
                    fused.epoch_means[epoch][name][c], ref.epoch_means[epoch][name], rtol=1e-10, atol=1e-12
                )
        torch.testing.assert_close(fused.mean_loss[c], ref.mean_loss, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("algo", FUSED)
@pytest.mark.parametrize("task,model", [("femnist", "mlp"), ("synthetic-1-1", "logreg")])
def test_fused_agrees_with_the_loop(algo: str, task: str, model: str) -> None:
    """Two rounds (FedPA: one burn-in round, then posterior averaging on the fused epoch means),
    2 epochs, momentum, uneven clients: global parameters equal the reference loop's."""
    extra = {
        "data.model": model,
        "train.client_lr": 0.02,
        "train.client_momentum": 0.5,
        "partition.num_clients": 12 if task == "femnist" else None,
    }
    loop_params, _ = two_rounds(algo, "loop", task, extra)
    fused_params, _ = two_rounds(algo, "fused", task, extra)
    for key in loop_params:
        torch.testing.assert_close(fused_params[key], loop_params[key], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("algo", FUSED)
def test_fused_in_chunks_and_in_worker_processes_agrees_with_the_loop(algo: str) -> None:
    """`--cohort-chunk 3` regroups the cohort of 4 by length; `--executor process` runs `fused` in
    each worker on its share: both still give the loop's parameters."""
    from fedcli.engine.backends.process import WorkerPool

    extra = {"data.model": "logreg", "train.client_lr": 0.05}
    loop_params, _ = two_rounds(algo, "loop", "synthetic-1-1", extra)
    chunk_params, _ = two_rounds(algo, "fused", "synthetic-1-1", {**extra, "train.cohort_chunk": 3})
    cfg = build_config(
        overrides={
            "algorithm.name": algo,
            "data.task": "synthetic-1-1",
            "train.executor": "process",
            "train.workers": 2,
            "train.device": "cpu",
            **extra,
        },
        hp=required_hyperparameters(algo),
    )
    setup = build(cfg)
    assert setup.backend.inner == "fused"  # type: ignore[attr-defined]
    with WorkerPool(1) as pool:
        process_params, _ = two_rounds(algo, "process", "synthetic-1-1", extra, pool=pool)
    for key in loop_params:
        torch.testing.assert_close(chunk_params[key], loop_params[key], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(process_params[key], loop_params[key], rtol=1e-4, atol=1e-5)
    setup.backend.close()


def test_the_cohorts_requests_are_taken_in_one_vmapped_call() -> None:
    """cohort_request stacks what differs per client (SCAFFOLD's c - c_i, from each client's state) and
    takes the static fields once; a start shared by the cohort comes back as an expanded view."""
    from fedcli.engine.backends.fused import cohort_request
    from tests.engine.test_workers import job, lsq_round

    _, setup, bc, inputs = lsq_round("scaffold", cohort_size=4)
    request = cohort_request(job(setup, bc, inputs))
    assert request.prox_mu == 0.0 and not request.average_epochs and request.linear is not None
    for name, start in bc.params.items():
        assert request.start[name].shape == (4, *start.shape) and request.start[name].stride()[0] == 0
        for c in range(4):
            torch.testing.assert_close(
                request.linear[name][c], bc.control[name] - inputs.states.control[name][c], rtol=0, atol=0
            )


def test_auto_picks_fused_for_dense_classifiers_only() -> None:
    """auto: fused for softmax regression with FedAvg/FedPA/SCAFFOLD; vmap for an algorithm with its own
    objective (FedDyn's linear and quadratic terms), for a regression task and under bf16."""

    def chosen(**overrides: object) -> str:
        return build(
            build_config(overrides={"data.task": "synthetic-1-1", "train.device": "cpu", **overrides})
        ).executor

    assert chosen() == "fused"
    assert chosen(**{"algorithm.name": "fedpa"}) == "fused"
    assert chosen(**{"algorithm.name": "scaffold"}) == "fused"
    assert chosen(**{"algorithm.name": "feddyn"}) == "vmap"
    assert chosen(**{"data.task": "lsq"}) == "vmap"
    assert chosen(**{"train.precision": "bf16"}) == "vmap"


def test_executor_fused_on_a_model_it_cannot_train_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"--executor fused trains dense classifiers .*Use --executor auto"):
        build(build_config(overrides={"data.task": "lsq", "train.executor": "fused"}))
    with pytest.raises(ConfigError, match=r"feddyn trains its own local objective"):
        build(
            build_config(
                overrides={
                    "data.task": "synthetic-1-1",
                    "algorithm.name": "feddyn",
                    "train.executor": "fused",
                }
            )
        )


def test_big_cohorts_run_in_cache_sized_blocks_with_the_single_call_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cohort_local_sgd trains a cohort larger than a block (here 4 clients of this MLP) block by
    block, longest clients first, and writes each row back to its cohort slot: the same
    LocalResult as one dense_local_sgd call over the whole cohort."""
    from fedcli.engine.backends import fused
    from fedcli.engine.cohort import CohortInputs

    sizes = [3 + (7 * c) % 19 for c in range(11)]
    fed, plan = cohort(sizes, features=6, classes=3, batch=4, epochs=2)
    model = models.MLP(6, (5,), 3).double()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    per_client_bytes = 3 * sum(v.numel() * 8 for v in start.values())  # momentum and epoch sums: 3 copies
    monkeypatch.setattr(fused, "BLOCK_BYTES", 4 * per_client_bytes + 1)
    assert fused.block_size(start, momentum=True, average_epochs=True) == 4
    opt = OptimConfig(client_lr=0.1, client_momentum=0.5)
    fns = type("Fns", (), {"data": fed, "prepare": staticmethod(lambda x: x)})()
    inputs = CohortInputs(
        plan=plan, keys=torch.zeros(plan.index.shape[:2], dtype=torch.int64), noise={}, states=None
    )
    spec = dense_spec(model)
    blocked = fused.cohort_local_sgd(
        spec, fns, LocalSGD(per_client(start, 11), average_epochs=True), inputs, opt
    )
    single = dense_local_sgd(
        spec, fed.x, fed.y, lambda x: x, per_client(start, 11), plan, opt, average_epochs=True
    )
    pytree.tree_map(lambda a, b: torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12), blocked, single)
