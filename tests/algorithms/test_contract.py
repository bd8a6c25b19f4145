"""The algorithm contract, checked for every registered algorithm (docs/architecture.md §3).

- `round_key`: two rounds whose keys are equal give bit-identical client outputs for identical
  inputs; an algorithm without a round_key must give them at any two rounds (its client code
  does not depend on the round). `--compile` and `--graph` reuse one program across rounds of
  equal keys, so an undeclared dependence on ctx.round_idx (FOLA's 1/r) fails here, not later
  as a silently stale program. Checked client by client (loop) at rounds 2 and 7, or at the
  first two rounds up to 12 whose declared keys are equal.
- `local`: an algorithm that declares its local training (`Algorithm.local`) computes the same
  ClientOut through its `client_update` as through the engine's composition (request ->
  optim.train_local -> finish), bit for bit, so every back end trains what `client_update` says.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils import _pytree as pytree

from fedcli.algorithms import ALGORITHMS
from fedcli.config.build import build_config
from fedcli.engine.backends.loop import LoopBackend
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.cohort import CohortInputs, CohortJob
from fedcli.engine.rounds import draw_noise, plan_round
from fedcli.engine.setup import Setup, build
from tests.engine.test_equivalence import pick_task, required_hyperparameters


def round_setup(algo: str) -> tuple[Setup, object, CohortInputs]:
    """A setup of `algo` on its task, round 1's inputs and the round-1 broadcast; the client states
    are made unequal (as after a round) so that a state-dependent update cannot pass by accident."""
    hp = {"burn_in_rounds": 1} if algo == "fedpa" else {}
    cfg = build_config(
        overrides={
            "algorithm.name": algo,
            "data.task": pick_task(algo),
            "train.executor": "loop",
            "train.device": "cpu",
            "train.clients_per_round": 4,
            "train.local_epochs": 2,
            "train.batch_size": 16,
            "train.client_lr": 0.01,
        },
        hp={**hp, **required_hyperparameters(algo)},
    )
    setup = build(cfg)
    alg = setup.alg
    state = alg.server_init(setup.init_params, setup.hp, setup.opt)
    init = alg.init_client_state
    store = ClientStateStore(None if init is None else (lambda: init(setup.init_params, setup.hp)))
    planned = plan_round(setup, 1)
    states = store.gather(planned.cohort, setup.device)
    if states is not None:
        states = pytree.tree_map(
            lambda t: (
                t + 0.01 * torch.arange(1, 5, dtype=t.dtype).reshape(-1, *[1] * (t.dim() - 1))
                if t.is_floating_point()
                else t
            ),
            states,
        )
    plan = planned.plan
    noise = draw_noise(
        setup, alg.global_params(state), planned.cohort, 1, plan.num_epochs * plan.steps_per_epoch
    )
    return (
        setup,
        alg.broadcast(state, setup.hp),
        CohortInputs(plan=plan, keys=planned.keys, noise=noise, states=states),
    )


def same_key_rounds(setup: Setup) -> tuple[int, int] | None:
    """Two rounds the client code must treat alike: 2 and 7 without a round_key, else the first two of
    1..12 with equal declared keys (None: the key changes every round, as FOLA's does)."""
    key = setup.alg.round_key
    if key is None:
        return 2, 7
    return next(
        ((a, b) for a, b in itertools.combinations(range(1, 13), 2) if key(setup.hp, a) == key(setup.hp, b)),
        None,
    )


def assert_identical(a: object, b: object, what: str) -> None:
    for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b), strict=True):
        assert (x is None and y is None) if x is None or y is None else torch.equal(x, y), what


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_rounds_with_equal_round_keys_give_identical_client_outputs(algo: str) -> None:
    setup, bc, inputs = round_setup(algo)
    rounds = same_key_rounds(setup)
    if rounds is None:
        pytest.skip(
            f"{algo}'s round_key differs in every round 1..12 (a program per round: --graph runs it eagerly)"
        )
    outs = [
        LoopBackend().run(CohortJob(setup.alg, setup.fns, bc, inputs, setup.hp, setup.opt, r)) for r in rounds
    ]
    declared = "its round_key" if setup.alg.round_key is not None else "it declares no round_key"
    assert_identical(
        outs[0],
        outs[1],
        f"{algo}: client outputs differ between rounds {rounds}, but {declared} "
        "says they may not (declare Algorithm.round_key: what the client code's use of ctx.round_idx "
        "depends on)",
    )


def test_an_undeclared_dependence_on_the_round_fails_the_check() -> None:
    """The check can fail: FOLA without its round_key (its P_n = F_n / r + ... depends on the round)."""
    setup, bc, inputs = round_setup("fola")
    undeclared = setup.alg._replace(round_key=None)
    outs = [
        LoopBackend().run(CohortJob(undeclared, setup.fns, bc, inputs, setup.hp, setup.opt, r))
        for r in (2, 7)
    ]
    with pytest.raises(AssertionError, match="declares no round_key"):
        assert_identical(outs[0], outs[1], "fola: it declares no round_key")


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(name for name, alg in ALGORITHMS.items() if alg.local is not None))
def test_declared_local_training_is_what_client_update_computes(algo: str) -> None:
    setup, bc, inputs = round_setup(algo)
    round_idx = 2  # FedPA past its one burn-in round: the IASG means are part of the request
    composed = LoopBackend().run(CohortJob(setup.alg, setup.fns, bc, inputs, setup.hp, setup.opt, round_idx))
    own = setup.alg._replace(local=None)  # the engine then calls client_update itself
    direct = LoopBackend().run(CohortJob(own, setup.fns, bc, inputs, setup.hp, setup.opt, round_idx))
    assert_identical(composed, direct, f"{algo}: client_update is not request -> optim.train_local -> finish")
