"""BayesADMM toys, shared parts: the full-batch client context, vmapped cohorts, the study's sizes, table and plot helpers.

Part of the `bayesadmm_toys` study (fedcli.studies.bayesadmm_toys: the paper, the deviations,
`run`); the figures' modules (bayesadmm_toys_fig3b, _fig4, _fig4_report, _fig3a) import from here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from fedcli.algorithms.base import Batch, ClientContext, ClientOut, OptimConfig

F64 = torch.float64
OPT = OptimConfig()  # server steps are closed form (sgd, lr 1); client rates are set per solver below


# ------------------------------------------------------------------------------------------ shared


def full_batch_context(
    x: Tensor,
    y: Tensor,
    loss_fn: Any,
    steps: int,
    round_idx: int,
    noise: dict[str, Tensor] | None = None,
    weight: Tensor | None = None,
    num_examples: Tensor | None = None,
) -> ClientContext:
    """A client context whose every step sees all N_k examples (the toys are full batch).

    weight [N] (default: every example real) and num_examples (default: N) describe a padded client.
    """
    weight = torch.ones(len(y), dtype=F64) if weight is None else weight  # default: every example real
    batch = Batch(x=x, y=y, weight=weight, key=torch.zeros((), dtype=torch.int64))
    return ClientContext(
        loss_fn=loss_fn,
        apply_fn=lambda p, z: z,
        batch=lambda step: batch,
        step_mask=torch.ones(steps, dtype=F64),
        num_examples=torch.tensor(float(len(y)), dtype=F64) if num_examples is None else num_examples,
        num_epochs=1,
        steps_per_epoch=steps,
        round_idx=round_idx,
        noise=noise or {},
    )


class Cohort(NamedTuple):
    """Full-participation clients padded to one size, so that client_update runs under vmap."""

    x: Tensor  # [C, N_max, ...] inputs (padding repeats a real row)
    y: Tensor  # [C, N_max, ...] targets
    weight: Tensor  # [C, N_max] 1.0 real example, 0.0 padding
    num_examples: Tensor  # [C] N_k


def pad_cohort(clients: list[tuple[Tensor, Tensor]]) -> Cohort:
    """Stack (x_k, y_k) with zero-weight padding; the losses are weighted means, so padding changes nothing."""
    n_max = max(len(y) for _, y in clients)
    pad = lambda t: torch.cat([t, t[:1].expand(n_max - len(t), *t.shape[1:])])  # noqa: E731
    return Cohort(
        x=torch.stack([pad(x) for x, _ in clients]),
        y=torch.stack([pad(y) for _, y in clients]),
        weight=torch.stack([(torch.arange(n_max) < len(y)).to(F64) for _, y in clients]),
        num_examples=torch.tensor([float(len(y)) for _, y in clients], dtype=F64),
    )


def stack_tree(trees: list[Any]) -> Any:
    """Stack pytrees (client states) on a leading client axis."""
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda *xs: torch.stack(xs), *trees)


def cohort_round(
    update: Any,
    cohort: Cohort,
    bc: Any,
    states: Any,
    hp: Any,
    opt: OptimConfig,
    loss_fn: Any,
    steps: int,
    round_idx: int,
) -> ClientOut:
    """Run update(ctx, bc, state, hp, opt) for every client at once with torch.func.vmap (as the engine does)."""

    def one(x: Tensor, y: Tensor, w: Tensor, n: Tensor, state: Any) -> tuple[Any, Any]:
        out = update(
            full_batch_context(x, y, loss_fn, steps, round_idx, weight=w, num_examples=n), bc, state, hp, opt
        )
        return out.upload, out.state

    upload, new_states = torch.func.vmap(one)(cohort.x, cohort.y, cohort.weight, cohort.num_examples, states)
    return ClientOut(upload=upload, state=new_states, metrics={})


def first_round(values: list[float], tol: float) -> int | None:
    """Return the first 1-based round whose value is <= tol (None if none)."""
    return next((r for r, v in enumerate(values, start=1) if v <= tol), None)


# ------------------------------------------------------------------------------------------ sizes, tables, axes


class Sizes(NamedTuple):
    """Every size of the study in one place (full mode; smoke mode shrinks them)."""

    ridge_count: int = 500  # Fig. 3b: N (main_onestep.py)
    ridge_side: int = 7  # 7 x 7 images, P = 49, D = 490
    ridge_admm_rounds: int = 20  # main_onestep.py runs 20
    ridge_admm_steps: int = 30  # heavy-ball steps per solve (error x 0.25 per step)
    ridge_bayes_rounds: int = 5
    fig4_admm_rounds: int = 8  # the toy runs 6 (plots 1, 3, 5)
    fig4_bayes_rounds: int = 5  # the toy runs 3 (plots 1, 2)
    fig4_mc_runs: int = 5
    fig4_von_steps: int = 10_001  # von_fullcov's num_iters + 1
    fig4_admm_max_steps: int = 25_000
    elbo_count: int = 5000  # Fig. 3a: N (main_elbo.py)
    elbo_side: int = 14  # 14 x 14 images, P = 196
    elbo_rounds: int = 6  # main_elbo.py: 25 (+1)
    elbo_steps: int = 150  # main_elbo.py: 1250 (+1)


SMOKE = Sizes(
    ridge_count=100,
    ridge_side=4,
    ridge_admm_rounds=2,
    ridge_admm_steps=10,
    ridge_bayes_rounds=2,
    fig4_admm_rounds=2,
    fig4_bayes_rounds=2,
    fig4_mc_runs=1,
    fig4_von_steps=100,
    fig4_admm_max_steps=500,
    elbo_count=300,
    elbo_side=7,
    elbo_rounds=2,
    elbo_steps=10,
)


def cell(values: list[float], r: int) -> float | str:
    """values[r] or "—" (the run has fewer rounds)."""
    return values[r] if r < len(values) else "—"


def semilogy(ax: Any, curves: dict[str, list[float]], floor: float, styles: dict[str, str]) -> None:
    """Plot max(|y|, floor) against the 1-based round on a log axis."""
    for name, ys in curves.items():
        ax.semilogy(
            range(1, len(ys) + 1), [max(abs(y), floor) for y in ys], styles.get(name, "o-"), label=name
        )
    ax.set_xlabel("server iteration (round)")
    integer_rounds(ax)
    ax.legend(fontsize=7)


def integer_rounds(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
