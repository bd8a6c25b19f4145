"""The process executor's parts: cohort splitting, slicing, shared-memory transport, the pool,
the `auto` choice, precision and step padding (tests/engine/test_equivalence.py checks that
the whole executor agrees with `loop` for every algorithm).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree

from fedcli.algorithms import ALGORITHMS
from fedcli.config import build_config
from fedcli.engine.executors import CohortInputs, run_vmap
from fedcli.engine.seeding import Stream, numpy_rng, sample_cohort, step_keys
from fedcli.engine.train import build
from fedcli.engine.workers import (
    ProcessExecutor,
    WorkerError,
    WorkerPool,
    balanced_groups,
    choose_executor,
    close_runner,
    in_process_executor,
    merge_outs,
    pack,
    pad_steps,
    split_cohort,
    take_clients,
    unpack,
    with_precision,
)
from fedcli.errors import ConfigError


@pytest.fixture(scope="module")
def pool():  # noqa: ANN201 - one spawned worker shared by the tests below
    with WorkerPool(1) as workers:
        yield workers


def lsq_round(algo: str = "fedavg", cohort_size: int = 6, epochs: int = 2, **extra: object):  # noqa: ANN201
    """Build an lsq setup and round-1 inputs (cohort, plan, keys, states) by hand."""
    cfg = build_config(overrides={"algorithm.name": algo, "data.task": "lsq", "train.executor": "vmap", "train.device": "cpu",
                                  "train.clients_per_round": cohort_size, "train.local_epochs": epochs,
                                  "train.batch_size": 16, **extra})
    setup = build(cfg)
    state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    cohort = sample_cohort(setup.fed.num_clients, cohort_size, seed=0, round_idx=1)
    plan = setup.fed.plan(cohort, num_epochs=epochs, batch_size=16,
                          rngs=[numpy_rng(0, Stream.BATCH_ORDER, 1, int(c)) for c in cohort])
    states = None
    if setup.alg.init_client_state is not None:
        one = setup.alg.init_client_state(setup.init_params, setup.hp)
        states = pytree.tree_map(lambda t: torch.stack([t + 0.01 * c for c in range(cohort_size)]), one)
    inputs = CohortInputs(plan=plan, keys=step_keys(0, 1, cohort, plan.num_epochs * plan.steps_per_epoch),
                          noise={}, states=states)
    return cfg, setup, setup.alg.broadcast(state, setup.hp), inputs


def assert_trees_close(a: object, b: object) -> None:
    pytree.tree_map(lambda x, y: None if x is None else torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6), a, b)


@pytest.mark.parametrize(("steps", "parts"), [([3, 1, 4, 1, 5, 9, 2, 6], 2), ([5, 5, 5], 4), ([7], 3),
                                               ([2, 8, 8, 1, 1, 1, 1, 1, 1, 1], 3)])
def test_split_cohort_covers_every_row_once_and_minimises_the_largest_group(steps: list[int], parts: int) -> None:
    """Groups are contiguous in descending-step order; their cost is len(group) x its longest client.
    Brute force over every set of cut points of the sorted order gives the optimal largest cost."""
    steps_arr = np.array(steps)
    groups = split_cohort(steps_arr, parts)
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(steps)))
    assert len(groups) <= parts

    def cost(gs: list[np.ndarray]) -> int:
        return max(len(g) * int(steps_arr[g].max()) for g in gs)

    ordered = np.argsort(-steps_arr, kind="stable")
    best = min(cost([ordered[a:b] for a, b in itertools.pairwise((0, *cuts, len(steps)))])
               for k in range(min(parts, len(steps))) for cuts in itertools.combinations(range(1, len(steps)), k))
    assert cost(groups) == best


@pytest.mark.parametrize(("steps", "parts"), [([3, 1, 4, 1, 5, 9, 2, 6], 2), ([5, 5, 5], 4), ([7], 3),
                                               ([9, 9, 8, 8, 8, 8, 8, 7, 7, 5], 2), ([2, 8, 8, 1, 1, 1, 1, 1], 3)])
def test_balanced_groups_cover_every_row_once_within_the_lpt_bound(steps: list[int], parts: int) -> None:
    """LPT (longest first, each to the lightest group) is within 4/3 - 1/(3 parts) of the optimal
    largest sum of steps (Graham 1969); the optimum here by brute force over every assignment."""
    steps_arr = np.array(steps)
    groups = balanced_groups(steps_arr, parts)
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(steps)))
    assert len(groups) <= parts
    best = min(max(sum(s for s, p in zip(steps, assign, strict=True) if p == k) for k in range(parts))
               for assign in itertools.product(range(parts), repeat=len(steps)))
    largest = max(int(steps_arr[g].sum()) for g in groups)
    assert largest <= (4 / 3 - 1 / (3 * parts)) * best + 1e-9
    if steps == [9, 9, 8, 8, 8, 8, 8, 7, 7, 5]:  # the contiguous split puts 42 vs 35 steps on the two processes
        assert largest == 39 and max(int(steps_arr[g].sum()) for g in split_cohort(steps_arr, parts)) == 42


def test_slices_run_separately_and_merged_equal_the_whole_cohort() -> None:
    """A slice trimmed to its own longest client keeps every client's real steps, keys and state,
    so running slices apart and merging them gives the vmapped cohort's result row for row."""
    _, setup, bc, inputs = lsq_round("scaffold")
    whole = run_vmap(setup.alg, setup.fns, bc, inputs, setup.hp, setup.opt, 1)
    groups = [np.array([4, 0]), np.array([5, 1, 3]), np.array([2])]
    outs = [run_vmap(setup.alg, setup.fns, bc, take_clients(inputs, g), setup.hp, setup.opt, 1)
            for g in groups]
    assert all(take_clients(inputs, g).plan.steps_per_epoch == inputs.plan.steps_per_client[g].max() for g in groups)
    assert_trees_close(merge_outs(groups, outs), whole)


def test_pack_round_trips_nested_values_and_grows_the_arena() -> None:
    message = {"a": torch.arange(5, dtype=torch.int64), "b": (torch.ones(2, 3, dtype=torch.float64), None),
               "c": [torch.tensor(2.5), torch.zeros(0, 4)], "d": np.array([1, 2]), "e": "text",
               "f": torch.tensor([True, False]), "g": torch.arange(12.0).reshape(3, 4).T}
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


def test_process_executor_matches_vmap_and_carries_client_states(pool: WorkerPool) -> None:
    cfg, setup, bc, inputs = lsq_round("scaffold")
    runner = ProcessExecutor(cfg, setup.fed, workers=2, inner="vmap", pool=pool)
    want = run_vmap(setup.alg, setup.fns, bc, inputs, setup.hp, setup.opt, 1)
    got = runner(setup.alg, setup.fns, bc, inputs, setup.hp, setup.opt, 1)
    assert_trees_close(got, want)
    assert pool.bound_token == runner.token and all(w.process.is_alive() for w in pool.workers)


def test_failures_are_reported_and_leave_the_pool_usable(pool: WorkerPool) -> None:
    cfg, setup, bc, inputs = lsq_round("fedavg")
    opt = setup.opt
    want = run_vmap(setup.alg, setup.fns, bc, inputs, setup.hp, opt, 1)
    missing_task = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, task="no-such-task"))
    with pytest.raises(WorkerError, match=r"(?s)a worker failed to build the run.*KeyError: 'no-such-task'"):
        ProcessExecutor(missing_task, setup.fed, workers=2, inner="vmap", pool=pool)(
            setup.alg, setup.fns, bc, inputs, setup.hp, opt, 1)
    runner = ProcessExecutor(cfg, setup.fed, workers=2, inner="vmap", pool=pool)
    broken = bc._replace(params={k: torch.zeros(3, 5) for k in bc.params})  # wrong shapes: every slice fails
    with pytest.raises(RuntimeError, match=r"shapes cannot be multiplied"):
        runner(setup.alg, setup.fns, broken, inputs, setup.hp, opt, 1)
    assert_trees_close(runner(setup.alg, setup.fns, bc, inputs, setup.hp, opt, 1), want)  # pipes still in step


def test_closing_stops_every_worker() -> None:
    cfg, setup, _, _ = lsq_round("fedavg", cohort_size=2, epochs=1)
    runner = ProcessExecutor(cfg, setup.fed, workers=2, inner="vmap")
    runner.start()
    processes = [w.process for w in runner.pool.workers]
    assert len(processes) == 1 and all(p.daemon and p.is_alive() for p in processes)
    close_runner(runner)
    close_runner(runner)  # idempotent
    assert not any(p.is_alive() for p in processes)


def test_auto_picks_processes_only_for_compute_bound_cpu_rounds() -> None:
    fedavg = ALGORITHMS["fedavg"]
    cpu = torch.device("cpu")
    auto = build_config(overrides={"train.workers": 2, "train.clients_per_round": 10})
    assert choose_executor(auto, fedavg, cpu, lambda: 100.0, has_conv=True)[0] == "process"
    assert choose_executor(auto, fedavg, cpu, lambda: 0.01, has_conv=True)[0] == "loop"
    assert choose_executor(auto, fedavg, cpu, lambda: 100.0, has_conv=False)[0] == "vmap"
    assert choose_executor(auto, fedavg, torch.device("cuda"), lambda: 100.0, has_conv=True)[0] == "vmap"
    one_core = build_config(overrides={"train.workers": 1})
    assert choose_executor(one_core, fedavg, cpu, lambda: 100.0, has_conv=True)[0] == "loop"
    compiled = build_config(overrides={"train.compile": True, "train.workers": 2})
    assert choose_executor(compiled, fedavg, cpu, lambda: 100.0, has_conv=True)[0] == "vmap"
    assert build(build_config(overrides={"data.task": "lsq", "train.device": "cpu"})).executor == "vmap"  # in-process
    cnn = build(build_config(overrides={"data.model": "cnn", "train.workers": 2, "train.device": "cpu"}))
    assert (cnn.executor, cnn.runner.inner) == ("process", "loop")


def test_in_process_choice_runs_convolutions_client_by_client_on_a_cpu() -> None:
    fedavg, cpu, cuda = ALGORITHMS["fedavg"], torch.device("cpu"), torch.device("cuda")
    assert in_process_executor(fedavg, cpu, has_conv=True) == "loop"
    assert in_process_executor(fedavg, cpu, has_conv=False) == "vmap"
    assert in_process_executor(fedavg, cuda, has_conv=True) == "vmap"
    assert in_process_executor(fedavg._replace(supports_vmap=False), cuda, has_conv=False) == "loop"
    assert in_process_executor(fedavg, cuda, has_conv=True, has_batchnorm=True) == "loop"


@pytest.mark.parametrize(("overrides", "device", "message"), [
    ({"train.executor": "process"}, "cuda", r"train.executor='process' splits the cohort over CPU processes"),
    ({"train.executor": "vmap"}, "cpu", r"the model has BatchNorm layers, whose running statistics vmap cannot"),
])
def test_impossible_executor_settings_are_refused(overrides: dict, device: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        choose_executor(build_config(overrides=overrides), ALGORITHMS["fedavg"], torch.device(device), lambda: 1.0,
                        has_batchnorm="BatchNorm" in message)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"train.workers": 0}, r"train.workers must be >= 1; got 0."),
    ({"train.precision": "fp16"}, r"train.precision must be one of fp32, tf32, bf16; got 'fp16'."),
])
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
def test_bf16_on_a_cpu_without_native_bf16_warns(native: bool, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """bf16 is emulated on CPUs without avx512_bf16/amx_bf16 (its convolutions ran 8x slower than
    fp32 in make bench there): --precision bf16 says so once, and stays silent where it is native."""
    import fedcli.engine.workers as workers

    _, setup, _, _ = lsq_round("fedavg")
    monkeypatch.setattr(workers, "_native_bf16_cpu", lambda: native)
    with caplog.at_level("WARNING", logger="fedcli.engine.workers"):
        with_precision(setup.fns, "bf16", torch.device("cpu"))
    warned = [r for r in caplog.records if "without native bf16" in r.getMessage()]
    assert len(warned) == (0 if native else 1)


def test_padding_steps_per_epoch_with_masked_steps_changes_nothing() -> None:
    """Extra steps at the end of every epoch have mask 0: exact no-ops (tree_where)."""
    _, setup, bc, inputs = lsq_round("fedavg", epochs=2)
    padded = pad_steps(inputs, 8)
    assert padded.plan.steps_per_epoch % 8 == 0 and padded.plan.steps_per_epoch > inputs.plan.steps_per_epoch
    opt = setup.opt
    assert_trees_close(run_vmap(setup.alg, setup.fns, bc, padded, setup.hp, opt, 1),
                       run_vmap(setup.alg, setup.fns, bc, inputs, setup.hp, opt, 1))
    assert dataclasses.replace(padded.plan).num_epochs == 2
    k = inputs.plan.steps_per_epoch
    assert pad_steps(inputs, 8, max_steps=k + 1).plan.steps_per_epoch == k + 1  # the federation's longest


@pytest.mark.parametrize("algo", ["fedavg", "fedpa"])
def test_compiled_client_step_equals_the_eager_loop(algo: str) -> None:
    """--compile with the loop executor compiles local_sgd's gradient step (forward, backward and
    the -lr * mask scaling) once and reuses it for every step and client: same uploads as the eager
    loop to float tolerance (inductor reorders sums). FedPA (burn-in 0) also checks the IASG means."""
    from fedcli.engine.executors import run_loop

    extra = {"algorithm.hp": {"burn_in_rounds": 0}} if algo == "fedpa" else {}
    cfg, setup, bc, inputs = lsq_round(algo, **extra)
    compiled_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, executor="loop", compile=True))
    compiled = build(compiled_cfg)
    assert compiled.fns.compile_step and not setup.fns.compile_step
    assert algo == "fedavg" or compiled.hp.burn_in_rounds == 0  # round 1 runs FedPA's own update
    opt = setup.opt
    eager = run_loop(setup.alg, setup.fns, bc, inputs, setup.hp, opt, 1)
    fast = run_loop(compiled.alg, compiled.fns, bc, inputs, compiled.hp, opt, 1)
    assert_trees_close(fast.upload, eager.upload)
    assert_trees_close(fast.metrics, eager.metrics)
