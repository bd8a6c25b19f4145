"""`loop`: the cohort client by client, each on its own unpadded plan; the reference.

Runs any algorithm on any model (a model whose training step does not run under vmap too: the
model check, datasets/yours/model.py, sends it here). With --compile each client's gradient step is
compiled once (local.CompiledStep) for algorithms that declare their local training; without it
their gradients come from torch.autograd (local.eager_train_local: bit-equal to torch.func.grad and
cheaper outside vmap).
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from fedcli.algorithms.base import ClientOut
from fedcli.engine.backends import BackendInfo, InProcess, Workload
from fedcli.engine.cohort import CohortJob, client_fn, trim_steps
from fedcli.engine.local import CompiledStep, Trainer, eager_train_local


class LoopBackend(InProcess):
    """Clients one by one; a stop signal is acted on between them (job.at_safe_point)."""

    def __init__(self, compile: bool = False) -> None:
        self.trainer: Trainer = CompiledStep() if compile else eager_train_local
        self.name = "loop + compile" if compile else "loop"

    def run(self, job: CohortJob) -> ClientOut:
        plan, inputs = job.inputs.plan, job.inputs
        results = []
        for c in range(len(plan.num_examples)):
            job.at_safe_point()
            own = plan.for_client(c)
            k = own.steps_per_epoch
            one = client_fn(
                job.alg,
                job.fns,
                job.broadcast,
                job.hp,
                job.opt,
                plan.num_epochs,
                k,
                job.round_idx,
                self.trainer,
            )
            noise = {
                name: trim_steps(v[c], plan.num_epochs, plan.steps_per_epoch, k)
                for name, v in inputs.noise.items()
            }
            keys = trim_steps(inputs.keys[c], plan.num_epochs, plan.steps_per_epoch, k)
            state = None if inputs.states is None else pytree.tree_map(lambda t, c=c: t[c], inputs.states)
            buffers = None if inputs.buffers is None else {name: v[c] for name, v in inputs.buffers.items()}
            results.append(
                one(
                    own.index[0],
                    own.weight[0],
                    own.step_mask[0],
                    keys,
                    own.num_examples[0],
                    noise,
                    state,
                    buffers,
                )
            )
        upload, state, metrics = pytree.tree_map(lambda *xs: torch.stack(xs), *results)
        return ClientOut(upload=upload, state=None if inputs.states is None else state, metrics=metrics)


def refuses(w: Workload) -> str | None:
    """The loop runs every workload."""
    return None


def prefers(w: Workload) -> str | None:
    """auto: algorithms without vmap, convolutional and recurrent models on a CPU."""
    if not w.alg.supports_vmap:
        return f"{w.alg.name} has no vmap"
    if w.has_rnn and w.device.type == "cpu":  # the loop at least matched vmap on a GRU (docs/benchmarks.md)
        return (
            "RNNs run PyTorch's fused kernel client by client on a CPU, and under vmap a step-by-step "
            "recurrence (datasets/stock_layers.py)"
        )
    if w.has_conv and w.device.type == "cpu":  # the loop beat vmap on Reddi's CNN (docs/benchmarks.md)
        return "convolutions run faster client by client than as vmap's grouped convolutions on a CPU"
    return None


INFO = BackendInfo(
    name="loop",
    summary="client by client, each on its own unpadded plan: the reference; any model",
    refuses=refuses,
    prefers=prefers,
    build=lambda setup: LoopBackend(compile=setup.cfg.train.compile),
)
