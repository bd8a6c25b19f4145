"""Every registered algorithm gives the same result client-by-client (`loop`), vmapped (`vmap`) and
split over worker processes (`process`, one spawned worker + the main process on a shared pool):
the back ends of engine/backends/ are interchangeable.

The vmap executor pads clients to the cohort's longest step count and masks the padding;
a masked step must leave all state unchanged, so after two rounds (state crosses rounds,
client sizes differ) the global parameters and per-client states agree to float tolerance.
LSA-only algorithms (which refuse other tasks in server_init) run on a Garnet task.
Where CUDA is present the suite also runs on the GPU (loop, vmap, vmap with --graph) against
the CPU loop; it skips with its reason elsewhere.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils import _pytree as pytree

from fedcli.algorithms import ALGORITHMS
from fedcli.algorithms.base import HyperparameterError
from fedcli.config.build import build_config
from fedcli.engine.backends import BackendSetup
from fedcli.engine.backends.process import ProcessBackend, WorkerPool
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.rounds import Timing, run_round
from fedcli.engine.setup import build

LSA_TASK = "garnet-het-n10"


def required_hyperparameters(algo: str) -> dict:
    """Values for hyperparameters the paper leaves to the user (no default): 0.1 / 1."""
    import dataclasses

    fields = dataclasses.fields(ALGORITHMS[algo].config_cls)
    return {
        f.name: (1 if "int" in str(f.type) else 0.1)
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }


@pytest.fixture(scope="module")
def pool():  # noqa: ANN201 - one worker process shared by this module's `process` runs
    with WorkerPool(1) as workers:
        yield workers


def two_rounds(
    algo: str, executor: str, task: str, extra: dict, rounds: int = 2, pool: WorkerPool | None = None
) -> tuple[dict, dict]:
    hp = {"burn_in_rounds": 1} if algo == "fedpa" else {}
    hp.update(required_hyperparameters(algo))
    cfg = build_config(
        overrides={
            "algorithm.name": algo,
            "data.task": task,
            "train.executor": executor,
            "train.device": "cpu",
            "train.clients_per_round": 4,
            "train.local_epochs": 2,
            "train.batch_size": 16,
            **extra,
        },
        hp=hp,
    )
    setup = build(cfg)
    if executor == "process":  # the same back end, on the module's pool instead of a pool of its own
        setup.backend.close()
        on_pool = BackendSetup(
            cfg=cfg,
            model=setup.model,
            fed=setup.fed,
            device=setup.device,
            workers=2,
            inner=setup.backend.inner,
        )
        setup = dataclasses.replace(setup, backend=ProcessBackend(on_pool, pool=pool))
    state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    init = setup.alg.init_client_state
    store = ClientStateStore(None if init is None else (lambda: init(setup.init_params, setup.hp)))
    for round_idx in range(1, rounds + 1):
        state, _ = run_round(setup, state, store, round_idx, Timing())
    return setup.alg.global_params(state), store.state_dict()


def pick_task(algo: str) -> str:
    cfg = build_config(
        overrides={"algorithm.name": algo, "data.task": "lsq", "train.device": "cpu"},
        hp=required_hyperparameters(algo),
    )
    setup = build(cfg)
    try:
        setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    except HyperparameterError:
        return LSA_TASK
    return "lsq"


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["vmap", "process"])
@pytest.mark.parametrize("algo", [name for name, rec in ALGORITHMS.items() if rec.supports_vmap])
def test_loop_and_vmap_agree(algo: str, executor: str, request: pytest.FixtureRequest) -> None:
    task = pick_task(algo)
    extra = {"train.client_lr": 0.01}
    pool = request.getfixturevalue("pool") if executor == "process" else None
    loop_params, loop_states = two_rounds(algo, "loop", task, extra)
    vmap_params, vmap_states = two_rounds(algo, executor, task, extra, pool=pool)
    for key in loop_params:
        torch.testing.assert_close(vmap_params[key], loop_params[key], rtol=1e-4, atol=1e-5)
    assert loop_states.keys() == vmap_states.keys()
    for client in loop_states:
        pytree.tree_map(
            lambda a, b: torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5),
            loop_states[client],
            vmap_states[client],
        )


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["vmap", "process"])
def test_loop_and_vmap_agree_on_femnist_cnn_with_dropout(
    executor: str, request: pytest.FixtureRequest
) -> None:
    """Dropout masks come from per-(seed, round, client, step) keys, so even the CNN with two dropout
    layers gives the same result in both executors (one round: the CNN is compute-heavy on CPU)."""
    extra = {
        "data.model": "cnn",
        "partition.num_clients": 5,
        "train.clients_per_round": 2,
        "train.local_epochs": 1,
        "train.batch_size": 64,
        "train.client_momentum": 0.9,
    }
    loop_params, _ = two_rounds("fedavg", "loop", "femnist", extra, rounds=1)
    pool = request.getfixturevalue("pool") if executor == "process" else None
    vmap_params, _ = two_rounds("fedavg", executor, "femnist", extra, rounds=1, pool=pool)
    for key in loop_params:
        torch.testing.assert_close(vmap_params[key], loop_params[key], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("algo", ["fedavg", "scaffold", "fedpa"])
def test_chunked_vmap_agrees_with_the_loop(algo: str) -> None:
    """`--cohort-chunk 3` on a cohort of 4: the clients are regrouped by length, each chunk is
    padded only to its own longest client, and the results are put back in cohort order, so
    parameters and per-client states (SCAFFOLD's control variates) still equal the loop's."""
    extra = {"train.client_lr": 0.01, "train.client_momentum": 0.9 if algo == "fedavg" else 0.0}
    loop_params, loop_states = two_rounds(algo, "loop", "lsq", extra)
    chunk_params, chunk_states = two_rounds(algo, "vmap", "lsq", {**extra, "train.cohort_chunk": 3})
    for key in loop_params:
        torch.testing.assert_close(chunk_params[key], loop_params[key], rtol=1e-4, atol=1e-5)
    assert loop_states.keys() == chunk_states.keys()
    for client in loop_states:
        pytree.tree_map(
            lambda a, b: torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5),
            loop_states[client],
            chunk_states[client],
        )


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the CUDA run of the equivalence suite needs one"
)


@pytest.mark.slow
@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("executor", ["loop", "vmap", "vmap+graph"])
@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_every_algorithm_on_cuda_equals_the_cpu_loop(algo: str, executor: str) -> None:
    """The equivalence suite with --device cuda: two rounds of every algorithm on the GPU, client by
    client, vmapped and vmapped with --graph (captured CUDA graphs), equal the CPU loop (fp32: TF32
    off), parameters and client states."""
    if executor != "loop" and not ALGORITHMS[algo].supports_vmap:
        pytest.skip(f"{algo} runs client by client only (supports_vmap=False)")
    task = pick_task(algo)
    extra = {"train.client_lr": 0.01}
    gpu = {**extra, "train.device": "cuda", **({"train.graph": True} if executor == "vmap+graph" else {})}
    assert_same_run(
        two_rounds(algo, executor.split("+")[0], task, gpu), two_rounds(algo, "loop", task, extra)
    )


def assert_same_run(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    """Global parameters and every client's state agree to float tolerance (`got` may live on a GPU)."""
    (got_params, got_states), (want_params, want_states) = got, want
    for key in want_params:
        torch.testing.assert_close(got_params[key].cpu(), want_params[key], rtol=1e-4, atol=1e-5)
    assert got_states.keys() == want_states.keys()
    for client in want_states:
        pytree.tree_map(
            lambda a, b: torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5),
            want_states[client],
            got_states[client],
        )
