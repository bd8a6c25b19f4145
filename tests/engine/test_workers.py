"""The process back end's parts: cohort splitting, slicing, shared-memory transport, the pool,
the `auto` choice, precision and step padding (tests/engine/test_equivalence.py checks that
the whole back end agrees with `loop` for every algorithm).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree

from fedcli.algorithms import ALGORITHMS
from fedcli.config.build import build_config
from fedcli.datasets.registry import TASKS
from fedcli.engine.backends import BackendSetup, Workload
from fedcli.engine.backends.loop import LoopBackend
from fedcli.engine.backends.process import ProcessBackend, WorkerError, WorkerPool, pack, unpack
from fedcli.engine.backends.vmap import VmapBackend
from fedcli.engine.cohort import (
    CohortInputs,
    CohortJob,
    balanced_groups,
    merge_outs,
    pad_steps,
    split_cohort,
    take_clients,
)
from fedcli.engine.model import with_precision
from fedcli.engine.seeding import Stream, numpy_rng, sample_cohort, step_keys
from fedcli.engine.select import choose, in_process
from fedcli.engine.setup import build
from fedcli.errors import ConfigError


@pytest.fixture(scope="module")
def pool():  # noqa: ANN201 - one spawned worker shared by the tests below
    with WorkerPool(1) as workers:
        yield workers


def lsq_round(algo: str = "fedavg", cohort_size: int = 6, epochs: int = 2, **extra: object):  # noqa: ANN201
    """Build an lsq setup and round-1 inputs (cohort, plan, keys, states) by hand."""
    cfg = build_config(
        overrides={
            "algorithm.name": algo,
            "data.task": "lsq",
            "train.executor": "vmap",
            "train.device": "cpu",
            "train.clients_per_round": cohort_size,
            "train.local_epochs": epochs,
            "train.batch_size": 16,
            **extra,
        }
    )
    setup = build(cfg)
    state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    cohort = sample_cohort(setup.fed.num_clients, cohort_size, seed=0, round_idx=1)
    plan = setup.fed.plan(
        cohort,
        num_epochs=epochs,
        batch_size=16,
        rngs=[numpy_rng(0, Stream.BATCH_ORDER, 1, int(c)) for c in cohort],
    )
    states = None
    if setup.alg.init_client_state is not None:
        one = setup.alg.init_client_state(setup.init_params, setup.hp)
        states = pytree.tree_map(lambda t: torch.stack([t + 0.01 * c for c in range(cohort_size)]), one)
    inputs = CohortInputs(
        plan=plan,
        keys=step_keys(0, 1, cohort, plan.num_epochs * plan.steps_per_epoch),
        noise={},
        states=states,
    )
    return cfg, setup, setup.alg.broadcast(state, setup.hp), inputs


def job(setup, bc, inputs: CohortInputs, round_idx: int = 1, **kw: object) -> CohortJob:  # noqa: ANN001
    """The CohortJob of a hand-built round (lsq_round) for a back end's `run`."""
    return CohortJob(setup.alg, setup.fns, bc, inputs, setup.hp, setup.opt, round_idx, **kw)


def vmap_run(setup, bc, inputs: CohortInputs, round_idx: int = 1):  # noqa: ANN001, ANN201
    """The vmap back end's result: what every other back end is checked against."""
    return VmapBackend().run(job(setup, bc, inputs, round_idx))


def process_backend(
    cfg,
    setup,
    pool: WorkerPool | None = None,
    inner: str = "vmap",  # noqa: ANN001
    workers: int = 2,
) -> ProcessBackend:
    """A process back end over `workers` processes running `inner` (on `pool` when given)."""
    return ProcessBackend(
        BackendSetup(
            cfg=cfg, model=setup.model, fed=setup.fed, device=setup.device, workers=workers, inner=inner
        ),
        pool=pool,
    )


def assert_trees_close(a: object, b: object) -> None:
    pytree.tree_map(
        lambda x, y: None if x is None else torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6), a, b
    )


@pytest.mark.parametrize(
    ("steps", "parts"),
    [([3, 1, 4, 1, 5, 9, 2, 6], 2), ([5, 5, 5], 4), ([7], 3), ([2, 8, 8, 1, 1, 1, 1, 1, 1, 1], 3)],
)
def test_split_cohort_covers_every_row_once_and_minimises_the_largest_group(
    steps: list[int], parts: int
) -> None:
    """Groups are contiguous in descending-step order; their cost is len(group) x its longest client.
    Brute force over every set of cut points of the sorted order gives the optimal largest cost."""
    steps_arr = np.array(steps)
    groups = split_cohort(steps_arr, parts)
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(steps)))
    assert len(groups) <= parts

    def cost(gs: list[np.ndarray]) -> int:
        return max(len(g) * int(steps_arr[g].max()) for g in gs)

    ordered = np.argsort(-steps_arr, kind="stable")
    best = min(
        cost([ordered[a:b] for a, b in itertools.pairwise((0, *cuts, len(steps)))])
        for k in range(min(parts, len(steps)))
        for cuts in itertools.combinations(range(1, len(steps)), k)
    )
    assert cost(groups) == best


@pytest.mark.parametrize(
    ("steps", "parts"),
    [
        ([3, 1, 4, 1, 5, 9, 2, 6], 2),
        ([5, 5, 5], 4),
        ([7], 3),
        ([9, 9, 8, 8, 8, 8, 8, 7, 7, 5], 2),
        ([2, 8, 8, 1, 1, 1, 1, 1], 3),
    ],
)
def test_balanced_groups_cover_every_row_once_within_the_lpt_bound(steps: list[int], parts: int) -> None:
    """LPT (longest first, each to the lightest group) is within 4/3 - 1/(3 parts) of the optimal
    largest sum of steps (Graham 1969); the optimum here by brute force over every assignment."""
    steps_arr = np.array(steps)
    groups = balanced_groups(steps_arr, parts)
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(steps)))
    assert len(groups) <= parts
    best = min(
        max(sum(s for s, p in zip(steps, assign, strict=True) if p == k) for k in range(parts))
        for assign in itertools.product(range(parts), repeat=len(steps))
    )
    largest = max(int(steps_arr[g].sum()) for g in groups)
    assert largest <= (4 / 3 - 1 / (3 * parts)) * best + 1e-9
    if steps == [
        9,
        9,
        8,
        8,
        8,
        8,
        8,
        7,
        7,
        5,
    ]:  # the contiguous split puts 42 vs 35 steps on the two processes
        assert largest == 39 and max(int(steps_arr[g].sum()) for g in split_cohort(steps_arr, parts)) == 42


def test_slices_run_separately_and_merged_equal_the_whole_cohort() -> None:
    """A slice trimmed to its own longest client keeps every client's real steps, keys and state,
    so running slices apart and merging them gives the vmapped cohort's result row for row."""
    _, setup, bc, inputs = lsq_round("scaffold")
    whole = vmap_run(setup, bc, inputs)
    groups = [np.array([4, 0]), np.array([5, 1, 3]), np.array([2])]
    outs = [vmap_run(setup, bc, take_clients(inputs, g)) for g in groups]
    assert all(
        take_clients(inputs, g).plan.steps_per_epoch == inputs.plan.steps_per_client[g].max() for g in groups
    )
    assert_trees_close(merge_outs(groups, outs), whole)


def test_pack_round_trips_nested_values_and_grows_the_arena() -> None:
    message = {
        "a": torch.arange(5, dtype=torch.int64),
        "b": (torch.ones(2, 3, dtype=torch.float64), None),
        "c": [torch.tensor(2.5), torch.zeros(0, 4)],
        "d": np.array([1, 2]),
        "e": "text",
        "f": torch.tensor([True, False]),
        "g": torch.arange(12.0).reshape(3, 4).T,
    }
    small = torch.empty(8, dtype=torch.uint8)
    new, arena, data = pack(message, small)
    assert new is not None and new is arena and arena.numel() >= 1 << 20
    back = unpack(data, arena, copy=True)
    assert back["e"] == "text" and back["b"][1] is None and back["d"].tolist() == [1, 2]
    for got, want in zip(pytree.tree_leaves(back), pytree.tree_leaves(message), strict=True):
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    again, _, _ = pack(message, arena)
    assert again is None  # fits: the arena is reused


@pytest.mark.slow
def test_process_backend_matches_vmap_and_carries_client_states(pool: WorkerPool) -> None:
    cfg, setup, bc, inputs = lsq_round("scaffold")
    runner = process_backend(cfg, setup, pool)
    want = vmap_run(setup, bc, inputs)
    got = runner.run(job(setup, bc, inputs))
    assert_trees_close(got, want)
    assert pool.bound_token == runner.token and all(w.process.is_alive() for w in pool.workers)


@pytest.mark.slow
def test_failures_are_reported_and_leave_the_pool_usable(pool: WorkerPool) -> None:
    cfg, setup, bc, inputs = lsq_round("fedavg")
    want = vmap_run(setup, bc, inputs)
    missing_task = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, task="no-such-task"))
    with pytest.raises(WorkerError, match=r"(?s)a worker failed to build the run.*KeyError: 'no-such-task'"):
        process_backend(missing_task, setup, pool).run(job(setup, bc, inputs))
    runner = process_backend(cfg, setup, pool)
    broken = bc._replace(params={k: torch.zeros(3, 5) for k in bc.params})  # wrong shapes: every slice fails
    with pytest.raises(RuntimeError, match=r"shapes cannot be multiplied"):
        runner.run(job(setup, broken, inputs))
    assert_trees_close(runner.run(job(setup, bc, inputs)), want)  # pipes still in step


@pytest.mark.slow
def test_closing_stops_every_worker() -> None:
    cfg, setup, _, _ = lsq_round("fedavg", cohort_size=2, epochs=1)
    runner = process_backend(cfg, setup)
    runner.start()
    processes = [w.process for w in runner.pool.workers]
    assert len(processes) == 1 and all(p.daemon and p.is_alive() for p in processes)
    runner.close()
    runner.close()  # idempotent
    assert not any(p.is_alive() for p in processes)


def workload(
    model: str | torch.nn.Module | None = "mlp",
    device: str = "cpu",
    alg: str = "fedavg",
    task: str = "femnist",
    clients: int = 10,
    **flags: object,
) -> Workload:
    """What `auto` knows of a run: a registered task's model by name (None: its default, or any module)."""
    name = TASKS[task].default_model if model is None else model
    net = TASKS[task].models[name]() if isinstance(name, str) else name
    return Workload(
        alg=ALGORITHMS[alg],
        task=TASKS[task],
        model=net,
        device=torch.device(device),
        precision=str(flags.get("precision", "fp32")),
        clients_per_round=clients,
        compile=bool(flags.get("compile")),
        graph=bool(flags.get("graph")),
    )


BATCHNORM = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2), torch.nn.Flatten())


def test_auto_spreads_convolutions_over_processes_on_a_multi_core_cpu_and_keeps_the_rest_in_one() -> None:
    """auto on a CPU: a convolutional model runs on `process` (the loop inside each worker) when the
    cohort has two or more cores (make bench, docs/architecture.md §3 "Which back ends stay": CNN-10 on
    2 cores 1.10 s a round against the loop's 1.25 s and the plain PyTorch loop's 1.18 s), client by
    client in one process with one core (BatchNorm too, issue 37); models vmap cannot run stay on the loop; a GPU
    keeps the cohort vmapped; dense classifiers are fused."""
    two = {"slots": 2}
    assert choose(workload("cnn"), "auto").backend == "loop"  # one core for the cohort
    spread = choose(dataclasses.replace(workload("cnn"), **two), "auto")
    assert (spread.backend, spread.executor, spread.inner) == ("process", "process", "loop")
    assert "one single-threaded process per core (2)" in spread.why
    assert choose(dataclasses.replace(workload(BATCHNORM), **two), "auto").backend == "process"
    no_vmap = dataclasses.replace(
        workload("cnn"), alg=ALGORITHMS["fedavg"]._replace(supports_vmap=False), **two
    )
    assert choose(no_vmap, "auto").backend == "loop"
    assert choose(dataclasses.replace(workload("cnn", "cuda"), **two), "auto").backend == "vmap"
    assert (
        choose(dataclasses.replace(workload("mlp"), **two), "auto").backend == "fused"
    )  # a dense classifier
    assert choose(workload(None, task="lsq"), "auto").backend == "vmap"  # ... regression is not
    assert choose(workload("cnn", compile=True), "auto") == (
        "vmap + compile",
        "vmap",
        None,
        "--compile: the cohort vmapped and compiled in the main process",
    )
    assert build(build_config(overrides={"data.task": "lsq", "train.device": "cpu"})).executor == "vmap"
    one = build(build_config(overrides={"data.model": "cnn", "train.workers": 1, "train.device": "cpu"}))
    assert (one.executor, one.backend.name) == ("loop", "loop")
    cnn = build(build_config(overrides={"data.model": "cnn", "train.workers": 2, "train.device": "cpu"}))
    assert isinstance(cnn.backend, ProcessBackend) and (cnn.executor, cnn.backend.inner) == (
        "process",
        "loop",
    )
    assert cnn.backend.processes == 2
    cnn.backend.close()


def test_in_process_choice_runs_convolutions_client_by_client_on_a_cpu() -> None:
    assert in_process(workload("cnn"))[0] == "loop"
    assert in_process(workload(None, task="lsq"))[0] == "vmap"
    assert in_process(workload("cnn", "cuda"))[0] == "vmap"
    assert in_process(workload("mlp", "cuda", alg="fola"))[0] == "vmap"  # its own local loop: not fused
    assert in_process(workload(BATCHNORM, "cuda"))[0] == "vmap"  # BatchNorm runs under vmap (issue 37)
    no_vmap = dataclasses.replace(
        workload("mlp", "cuda"), alg=ALGORITHMS["fedavg"]._replace(supports_vmap=False)
    )
    assert in_process(no_vmap) == ("loop", "fedavg has no vmap")


@pytest.mark.parametrize(
    ("requested", "device", "model", "message"),
    [
        ("process", "cuda", "mlp", r"train.executor='process' splits the cohort over CPU processes"),
    ],
)
def test_impossible_executor_settings_are_refused(
    requested: str, device: str, model: object, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        choose(workload(model, device), requested)  # type: ignore[arg-type]


def test_vmap_takes_batchnorm() -> None:
    """BatchNorm trains on batch statistics per client, so vmap runs it (issue 37; engine/model.py)."""
    assert choose(workload(BATCHNORM), "vmap").backend == "vmap"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"train.workers": 0}, r"train.workers must be >= 1; got 0."),
        ({"train.precision": "fp16"}, r"train.precision must be one of fp32, tf32, bf16; got 'fp16'."),
    ],
)
def test_speed_settings_are_validated(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(overrides=overrides)


def test_tf32_needs_cuda_and_bf16_stays_close_to_fp32() -> None:
    _, setup, bc, inputs = lsq_round("fedavg")
    with pytest.raises(ConfigError, match=r"train.precision='tf32' needs a CUDA device; got device cpu"):
        with_precision(setup.fns, "tf32", torch.device("cpu"))
    bf16 = with_precision(setup.fns, "bf16", torch.device("cpu"))
    x = setup.fed.x[:32]
    want = setup.fns.apply_fn(bc.params, x)
    got = bf16.apply_fn(bc.params, x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize("native", [True, False])
def test_bf16_on_a_cpu_without_native_bf16_warns(
    native: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """bf16 is emulated on CPUs without avx512_bf16/amx_bf16 (its convolutions ran 8x slower than
    fp32 in make bench there): --precision bf16 says so once, and stays silent where it is native."""
    import fedcli.engine.model as model

    _, setup, _, _ = lsq_round("fedavg")
    monkeypatch.setattr(model, "_native_bf16_cpu", lambda: native)
    with caplog.at_level("WARNING", logger="fedcli.engine.model"):
        with_precision(setup.fns, "bf16", torch.device("cpu"))
    warned = [r for r in caplog.records if "without native bf16" in r.getMessage()]
    assert len(warned) == (0 if native else 1)


@pytest.mark.slow
def test_padding_steps_per_epoch_with_masked_steps_changes_nothing() -> None:
    """Extra steps at the end of every epoch have mask 0: exact no-ops (tree_where)."""
    _, setup, bc, inputs = lsq_round("fedavg", epochs=2)
    padded = pad_steps(inputs, 8)
    assert padded.plan.steps_per_epoch % 8 == 0 and padded.plan.steps_per_epoch > inputs.plan.steps_per_epoch
    assert_trees_close(vmap_run(setup, bc, padded), vmap_run(setup, bc, inputs))
    assert dataclasses.replace(padded.plan).num_epochs == 2
    k = inputs.plan.steps_per_epoch
    assert pad_steps(inputs, 8, max_steps=k + 1).plan.steps_per_epoch == k + 1  # the federation's longest


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algo", "backend"),
    [("fedavg", "inductor"), ("fedpa", "inductor"), ("fedprox", "aot_eager"), ("scaffold", "aot_eager")],
)
def test_compiled_client_step_equals_the_eager_loop(algo: str, backend: str) -> None:
    """--compile with the loop back end compiles the declared local SGD's gradient step (forward,
    backward, FedProx's proximal and SCAFFOLD's linear term, the -lr * mask scaling) once, with the
    start and the correction as inputs, and reuses it for every step, client and round: same uploads
    as the eager loop to float tolerance (inductor reorders sums). FedPA (burn-in 0) also checks the
    IASG means. FedProx and SCAFFOLD compile with aot_eager (the same graph, no codegen: seconds)."""
    from fedcli.engine.local import CompiledStep

    extra = {"algorithm.hp": {"burn_in_rounds": 0}} if algo == "fedpa" else {}
    cfg, setup, bc, inputs = lsq_round(algo, **extra)
    compiled_cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, executor="loop", compile=True)
    )
    compiled = build(compiled_cfg)
    assert isinstance(compiled.backend, LoopBackend) and compiled.backend.name == "loop + compile"
    trainer = compiled.backend.trainer = CompiledStep(backend)
    assert algo != "fedpa" or compiled.hp.burn_in_rounds == 0  # round 1 samples
    eager = LoopBackend().run(job(setup, bc, inputs))
    for round_idx in (1, 2):
        fast = compiled.backend.run(job(compiled, bc, inputs, round_idx))
        if round_idx == 1:
            assert_trees_close(fast.upload, eager.upload)
            assert_trees_close(fast.metrics, eager.metrics)
    assert len(trainer.compiled) == 1  # one graph for 6 clients x 2 rounds


@pytest.mark.slow
@pytest.mark.parametrize("algo", [name for name, alg in ALGORITHMS.items() if alg.local is not None])
def test_the_loops_autograd_trainer_is_bit_equal_to_torch_func_grad(algo: str) -> None:
    """The loop back end takes its declared-local-SGD gradients from torch.autograd on leaf copies
    (local.eager_train_local) instead of torch.func.grad (optim.train_local): outside vmap both run
    the same kernels in the same order, so every upload, client state and metric is bit-equal, for
    every algorithm that declares its local training (FedProx's proximal and SCAFFOLD's linear term
    included). Two rounds, so the iterate updated in place across steps is covered too."""
    from fedcli.algorithms.optim import train_local

    extra: dict[str, object] = {"algorithm.hp": {"burn_in_rounds": 0}} if algo == "fedpa" else {}
    if algo.endswith("lsa"):  # local LSA steps need a linear stochastic approximation task
        extra["data.task"] = "garnet-het-n10"
    _, setup, bc, inputs = lsq_round(algo, **extra)
    reference = LoopBackend()
    reference.trainer = train_local
    for round_idx in (1, 2):
        fast, slow = (
            LoopBackend().run(job(setup, bc, inputs, round_idx)),
            reference.run(job(setup, bc, inputs, round_idx)),
        )
        pytree.tree_map(
            lambda x, y: None if x is None else torch.testing.assert_close(x, y, rtol=0, atol=0),
            (fast.upload, fast.state, fast.metrics),
            (slow.upload, slow.state, slow.metrics),
        )
