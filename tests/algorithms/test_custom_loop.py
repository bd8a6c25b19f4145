"""An algorithm that writes its own local loop, as a plugin would (docs/adding-an-algorithm.md, "Your own
local loop"): it runs on every generic back end and the fused one refuses it with one line.

The algorithm (the doc shows this code; `test_the_doc_shows_this_code` keeps the two equal): FedAvg
whose local steps clip each minibatch gradient to norm G before the step (per-step gradient clipping,
Pascanu, Mikolov, Bengio, ICML 2013, Eq. 5), a loop `Algorithm.local`'s LocalSGD cannot declare.

Closed form, one client f(x) = 1/2 ||x - m||^2 (gradient x - m), rate eta, s full-batch steps from
x_0 with ||x_0 - m|| - s eta G > G: every step is clipped to length G along the unit vector
u = (x_0 - m) / ||x_0 - m||, so x_s = x_0 - s eta G u and the upload is Delta = x_0 - x_s = s eta G u.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree

from fedcli.algorithms import fedavg
from fedcli.algorithms.base import (
    Algorithm,
    Batch,
    ClientContext,
    ClientOut,
    OptimConfig,
    require,
    tree_norm,
    tree_scale,
    tree_sub,
)
from fedcli.algorithms.optim import MaskedSGD
from fedcli.config.build import build_config
from fedcli.engine.backends.loop import LoopBackend
from fedcli.engine.backends.vmap import VmapBackend
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.rounds import Timing, run_round
from fedcli.engine.select import choose
from fedcli.engine.setup import build
from fedcli.errors import ConfigError
from tests.engine.test_workers import workload


# --8<-- [start:custom-loop]
@dataclass(frozen=True, kw_only=True)
class StepClipConfig:
    max_norm: float = 1.0  # G, the gradient norm each local step is clipped to (Pascanu et al. 2013 Eq. 5)

    def __post_init__(self) -> None:
        require(self.max_norm > 0, "hp.max_norm", "> 0", self.max_norm)


def client_update(
    ctx: ClientContext, bc: fedavg.Broadcast, client_state: None, hp: StepClipConfig, opt: OptimConfig
) -> ClientOut:
    """E x K masked SGD steps from x_t, each on g * min(1, G / ||g||); upload x_t - x_K (old minus new)."""
    grad_and_loss = torch.func.grad_and_value(ctx.loss_fn)
    sgd = MaskedSGD(bc.params, opt.client_lr, opt.client_momentum)
    loss_sum = torch.zeros((), dtype=ctx.step_mask.dtype, device=ctx.step_mask.device)
    for step in range(ctx.num_steps):
        grads, loss = grad_and_loss(sgd.params, ctx.batch(step))
        clipped = tree_scale(
            grads, torch.clamp(hp.max_norm / tree_norm(grads), max=1.0)
        )  # no branch on a tensor
        sgd.step(clipped, ctx.step_mask[step])  # a masked step changes nothing
        loss_sum = loss_sum + ctx.step_mask[step] * loss.detach()
    delta = tree_sub(bc.params, sgd.params)
    return ClientOut(
        upload={"delta": delta},
        state=None,
        metrics={"train_loss": loss_sum / ctx.step_mask.sum().clamp_min(1.0)},
    )


ALGORITHM = Algorithm(
    name="fedavg-stepclip",
    paper="Pascanu, Mikolov, Bengio. ICML 2013. arXiv:1211.5063 (Eq. 5), in FedAvg's clients",
    config_cls=StepClipConfig,
    server_init=fedavg.server_init,
    broadcast=fedavg.broadcast,
    client_update=client_update,
    server_update=fedavg.server_update,
    global_params=fedavg.global_params,
    description="FedAvg whose local steps clip each minibatch gradient to norm hp.max_norm.",
)
# --8<-- [end:custom-loop]

DT = torch.float64


def test_clipped_steps_follow_the_closed_form() -> None:
    x0, m = torch.tensor([3.0, -4.0], dtype=DT), torch.tensor([0.0, 0.0], dtype=DT)  # ||x0 - m|| = 5
    eta, steps, g = 0.5, 4, 1.0  # 5 - 4 * 0.5 * 1 = 3 > G: every step is clipped
    batch = Batch(
        x=torch.zeros(1, dtype=DT),
        y=torch.zeros(1, dtype=DT),
        weight=torch.ones(1, dtype=DT),
        key=torch.zeros((), dtype=torch.int64),
    )
    ctx = ClientContext(
        loss_fn=lambda p, b: 0.5 * ((p["w"] - m) ** 2).sum(),
        apply_fn=lambda p, x: x,
        batch=lambda s: batch,
        step_mask=torch.ones(steps, dtype=DT),
        num_examples=torch.tensor(1.0),
        num_epochs=1,
        steps_per_epoch=steps,
        round_idx=1,
        noise={},
    )
    out = client_update(
        ctx, fedavg.Broadcast(params={"w": x0}), None, StepClipConfig(max_norm=g), OptimConfig(client_lr=eta)
    )
    unit = (x0 - m) / torch.linalg.vector_norm(x0 - m)
    torch.testing.assert_close(out.upload["delta"]["w"], steps * eta * g * unit, rtol=0, atol=1e-12)


def two_rounds(backend: object) -> tuple[dict, float]:
    """Two rounds of the plugin-style algorithm through the engine, on the given back end (lsq, 4 uneven
    clients per round, 2 epochs: vmap pads and masks steps); returns the global parameters and round 2's loss."""
    cfg = build_config(
        overrides={
            "data.task": "lsq",
            "train.device": "cpu",
            "train.clients_per_round": 4,
            "train.local_epochs": 2,
            "train.batch_size": 16,
            "train.client_lr": 0.05,
        }
    )
    setup = dataclasses.replace(build(cfg), alg=ALGORITHM, hp=StepClipConfig(max_norm=0.05), backend=backend)
    state = ALGORITHM.server_init(setup.init_params, setup.hp, setup.opt)
    metrics: dict[str, float] = {}
    for round_idx in (1, 2):
        state, metrics = run_round(setup, state, ClientStateStore(None), round_idx, Timing())
    return ALGORITHM.global_params(state), metrics["train/loss"]


def test_a_custom_loop_runs_client_by_client_and_vmapped_with_the_same_result() -> None:
    """The loop and the vmap back end train it to the same parameters (float tolerance), clipping bites
    (the result differs from FedAvg's on the same seed), and `fused` refuses it in one line."""
    loop_params, loop_loss = two_rounds(LoopBackend())
    vmap_params, vmap_loss = two_rounds(VmapBackend())
    pytree.tree_map(
        lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6), loop_params, vmap_params
    )
    assert vmap_loss == pytest.approx(loop_loss, rel=1e-5)
    fedavg_run = build(
        build_config(
            overrides={
                "data.task": "lsq",
                "train.device": "cpu",
                "train.clients_per_round": 4,
                "train.local_epochs": 2,
                "train.batch_size": 16,
                "train.client_lr": 0.05,
            }
        )
    )
    state = fedavg.ALGORITHM.server_init(fedavg_run.init_params, fedavg_run.hp, fedavg_run.opt)
    for round_idx in (1, 2):
        state, _ = run_round(fedavg_run, state, ClientStateStore(None), round_idx, Timing())
    assert any(
        not torch.allclose(loop_params[k], state.params[k]) for k in loop_params
    )  # the clip changed it
    with pytest.raises(ConfigError, match="fedavg-stepclip trains its own local objective"):
        choose(dataclasses.replace(workload("mlp"), alg=ALGORITHM), "fused")


def test_the_doc_shows_this_code() -> None:
    """docs/adding-an-algorithm.md's custom-loop example is the code above, line for line."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "adding-an-algorithm.md").read_text()
    source = Path(__file__).read_text()
    here = re.search(r"# --8<-- \[start:custom-loop\]\n(.*?)# --8<-- \[end:custom-loop\]", source, re.S)
    shown = re.search(
        r"<!-- custom-loop: tests/algorithms/test_custom_loop.py -->\n```python\n(.*?)```", doc, re.S
    )
    assert here is not None and shown is not None
    assert shown.group(1) == here.group(1)
