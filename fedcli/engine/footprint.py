"""How much memory one client's training step holds: what `auto` weighs before vmapping a whole cohort.

`vmap` trains the round's cohort as one batched computation, so every client's activations, gradients
and parameter copies are alive at once: 50 clients of the StackOverflow next-word LSTM (20 x 20 tokens
a batch, 10,004 logits a token) held gigabytes (docs/benchmarks.md, "Figures behind the engine's choices").
`client_step_bytes` measures one client's step on a real batch of the training data (one forward and
loss under `saved_tensors_hooks`: the distinct storages autograd keeps for the backward, parameters
left out) and adds the per-client copies vmap makes of the parameters; `engine/select.py` compares the
cohort's total with `VMAP_CPU_BUDGET` on a CPU and runs the loop (one client at a time) when it does not
fit (docs/scaling.md, "Paper scale").
"""

from __future__ import annotations

import numpy as np
import torch

from fedcli.algorithms.base import Batch
from fedcli.datasets.federated import FederatedData
from fedcli.engine.model import ModelFunctions

# bytes a vmapped cohort's training step may hold on a CPU before auto runs the loop
VMAP_CPU_BUDGET = 2 * 2**30
ACTIVATION_FACTOR = 2  # saved tensors, plus the gradients of as many bytes the backward makes while it runs
PARAM_COPIES = 4  # per client under vmap: its parameters, their gradient, the updated parameters, the upload


def client_step_bytes(fns: ModelFunctions, params: dict[str, torch.Tensor], batch_size: int) -> int:
    """Estimated bytes one client's local step holds under vmap, measured on the first `batch_size`
    training examples (stored order; fewer when the data has fewer)."""
    data = fns.data
    assert isinstance(data, FederatedData)  # the run's data (engine/setup.py); a CohortData is a round's
    n = max(1, min(batch_size, len(data.x)))
    x, y = data.take(np.arange(n))
    x = fns.prepare(x)
    weight = torch.ones(n, device=x.device)
    key = torch.zeros((), dtype=torch.int64, device=x.device)
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    own = {t.untyped_storage().data_ptr() for t in leaves.values()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.random.fork_rng(devices=[]), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fns.loss_fn(leaves, Batch(x=x, y=y, weight=weight, key=key))  # the run's RNG streams untouched
    del loss
    param_bytes = sum(t.numel() * t.element_size() for t in params.values())
    return ACTIVATION_FACTOR * sum(seen.values()) + PARAM_COPIES * param_bytes


def vmap_too_big(per_client: int, clients: int, device: torch.device) -> str | None:
    """Why vmapping `clients` clients of `per_client` bytes each would not fit (on a CPU), or None."""
    if device.type != "cpu" or per_client * clients <= VMAP_CPU_BUDGET:
        return None
    return (
        f"vmap would hold ~{per_client * clients / 2**30:.1f} GiB for {clients} clients at once (estimated "
        f"{per_client / 2**20:.0f} MiB a client's step, above the {VMAP_CPU_BUDGET / 2**30:.0f} GiB budget); "
        "the loop trains one client at a time"
    )
