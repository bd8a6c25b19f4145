"""Device-facing parts of the engine that a CPU can check: row indices built on the tensors'
own device (merge_outs, take_clients, the fused blocks), the TF32 flags of --precision, the
compiled cohort's graph count across rounds, and the `auto` back-end rule for CUDA.

The tests marked `cuda` run the same code on a GPU (--cohort-chunk crashed there with
"index is on cpu"); they skip where torch sees no CUDA device.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree

from fedcli.algorithms.base import ClientOut
from fedcli.engine.backends.compiled import CompiledVmap
from fedcli.engine.backends.fused import CUDA_FUSED_MAX_CLIENTS
from fedcli.engine.cohort import RowIndex, merge_outs, take_clients
from fedcli.engine.model import cuda_tf32_flags, with_precision
from fedcli.engine.select import choose, in_process
from tests.engine.test_equivalence import two_rounds
from tests.engine.test_workers import assert_trees_close, job, lsq_round, vmap_run, workload

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


# ----------------------------------------------------------------------------- row indices


@pytest.mark.parametrize("sizes", [[3, 1, 2], [1] * 6, [6], [2, 4]])
def test_merge_outs_puts_every_row_back_in_its_cohort_slot(sizes: list[int]) -> None:
    """Groups are any partition of the cohort's rows, in any order; each group's ClientOut holds
    its rows in group order. merge_outs returns row r of the cohort in slot r for every leaf,
    whatever its shape and dtype, and keeps None (stateless algorithms) as None."""
    rng = np.random.default_rng(sum(sizes) * 7 + len(sizes))
    rows = rng.permutation(sum(sizes))
    groups = np.split(rows, np.cumsum(sizes)[:-1])
    upload = torch.arange(6 * 2 * 3, dtype=torch.float32).reshape(6, 2, 3)[: sum(sizes)]
    metric = torch.arange(sum(sizes), dtype=torch.int64) * 10
    outs = [ClientOut(upload={"w": upload[g]}, state=None, metrics={"n": metric[g]}) for g in groups]
    merged = merge_outs(groups, outs)
    assert merged.state is None
    torch.testing.assert_close(merged.upload["w"], upload, rtol=0, atol=0)
    torch.testing.assert_close(merged.metrics["n"], metric, rtol=0, atol=0)


def test_row_index_builds_one_index_per_device_on_that_device() -> None:
    take = RowIndex(np.array([2, 0]))
    t = torch.arange(6.0).reshape(3, 2)
    torch.testing.assert_close(take(t), t[[2, 0]])
    assert take.on(t.device) is take.on(t.device) and take.on(t.device).dtype == torch.int64
    assert take.on(torch.device("meta")).device.type == "meta"


@needs_cuda
@pytest.mark.cuda
def test_take_clients_and_merge_outs_keep_cuda_tensors_on_cuda() -> None:
    """The slice and the merge of a cohort whose plan, keys and states live on the GPU."""
    _, setup, bc, inputs = lsq_round("scaffold", **{"train.device": "cuda"})
    assert inputs.plan.index.device.type == "cuda" and inputs.states is not None
    inputs = dataclasses.replace(inputs, keys=inputs.keys.cuda())
    whole = vmap_run(setup, bc, inputs)
    groups = [np.array([4, 0]), np.array([5, 1, 3]), np.array([2])]
    parts = [take_clients(inputs, g) for g in groups]
    assert all(
        t.device.type == "cuda" for p in parts for t in pytree.tree_leaves(p) if isinstance(t, torch.Tensor)
    )
    merged = merge_outs(groups, [vmap_run(setup, bc, p) for p in parts])
    assert_trees_close(merged, whole)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize(
    ("executor", "task", "extra"),
    [
        ("vmap", "lsq", {}),
        ("fused", "synthetic-1-1", {"data.model": "logreg"}),
    ],
)
def test_cohort_chunk_on_cuda_equals_the_cpu_loop(
    executor: str, task: str, extra: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--cohort-chunk 3 (and, for fused, blocks of one client: the index_copy_ of each block's
    rows) on the GPU: SCAFFOLD's parameters and client states equal the CPU loop's."""
    from fedcli.engine.backends import fused

    monkeypatch.setattr(fused, "BLOCK_BYTES", 1)
    extra = {**extra, "train.client_lr": 0.05}
    loop_params, loop_states = two_rounds("scaffold", "loop", task, {**extra, "train.device": "cpu"})
    gpu_params, gpu_states = two_rounds(
        "scaffold", executor, task, {**extra, "train.device": "cuda", "train.cohort_chunk": 3}
    )
    for key in loop_params:
        torch.testing.assert_close(gpu_params[key].cpu(), loop_params[key], rtol=1e-4, atol=1e-5)
    for client in loop_states:
        pytree.tree_map(
            lambda a, b: torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5),
            loop_states[client],
            gpu_states[client],
        )


def test_tests_pin_device_auto_to_the_cpu_even_where_cuda_is_available(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tests/conftest.py's autouse pin (tests not marked `cuda`): `auto` resolves to the CPU,
    explicit devices pass through. CUDA is faked as available: resolve_device only names it."""
    import fedcli.engine.setup as setup
    from tests.conftest import pin_auto_device_to_cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pin_auto_device_to_cpu(monkeypatch)
    assert setup.resolve_device("auto") == torch.device("cpu")
    assert setup.resolve_device("cuda") == torch.device("cuda")
    assert setup.resolve_device("cpu") == torch.device("cpu")


# ----------------------------------------------------------------------------- precision


@pytest.fixture
def tf32_flags():  # noqa: ANN201 - restores the process-wide flags after the test
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


@pytest.mark.usefixtures("tf32_flags")
def test_precision_sets_both_tf32_flags_on_cuda() -> None:
    """PyTorch's default leaves cuDNN's TF32 on (convolutions in TF32 under --precision fp32):
    fp32 and bf16 turn matmul and cuDNN TF32 off, tf32 turns both on. Only flags are touched, so
    this runs without a GPU (torch.device('cuda') is just a name here)."""
    _, setup, _, _ = lsq_round("fedavg", epochs=1)
    cuda = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True  # PyTorch's defaults
    assert with_precision(setup.fns, "fp32", cuda) is setup.fns
    assert flags() == (False, False)
    with_precision(setup.fns, "tf32", cuda)
    assert flags() == (True, True)
    with_precision(setup.fns, "bf16", cuda)
    assert flags() == (False, False)
    cuda_tf32_flags("tf32")
    assert flags() == (True, True)


@pytest.mark.usefixtures("tf32_flags")
def test_precision_on_a_cpu_leaves_the_cuda_flags_alone() -> None:
    _, setup, _, _ = lsq_round("fedavg", epochs=1)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = True, True
    with_precision(setup.fns, "fp32", torch.device("cpu"))
    with_precision(setup.fns, "bf16", torch.device("cpu"))
    assert flags() == (True, True)


# ----------------------------------------------------------------------------- --compile across rounds


@pytest.mark.slow
@pytest.mark.parametrize(("algo", "graphs"), [("fedavg", 1), ("fedpa", 2), ("fola", 10)])
def test_compiled_cohort_compiles_once_per_key_over_ten_rounds(algo: str, graphs: int) -> None:
    """Ten rounds of the same cohort shapes through CompiledVmap (dynamo with the `eager` backend:
    the graph capture of --compile, without Inductor's codegen): FedAvg captures one graph and
    reuses it; FedPA captures two (burn-in rounds 1-3, sampling rounds 4-10: its round_key);
    FOLA (its round_key is the round) captures one per round, each from its own code object,
    so rounds past dynamo's recompile limit of 8 are still compiled graphs, not eager fallbacks.
    Every round equals the vmap back end's result (rounds 1, 4 and 10 checked)."""
    from torch._dynamo.utils import counters

    extra = {"algorithm.hp": {"burn_in_rounds": 3}} if algo == "fedpa" else {}
    _, setup, bc, inputs = lsq_round(algo, cohort_size=3, epochs=1, **extra)
    torch._dynamo.reset()
    counters.clear()
    runner = CompiledVmap(backend="eager")
    for round_idx in range(1, 11):
        got = runner.run(job(setup, bc, inputs, round_idx))
        if round_idx in (1, 4, 10):
            assert_trees_close(got, vmap_run(setup, bc, inputs, round_idx))
    assert len(runner.compiled) == graphs
    assert counters["stats"]["unique_graphs"] == graphs
    assert not counters["recompile_limit"] if "recompile_limit" in counters else True
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- the auto back end on CUDA


def test_cuda_auto_rule_fused_for_small_cohorts_vmap_for_large_never_process() -> None:
    """Measured on an H100 (FEMNIST MLP): fused 0.015 s vs vmap 0.042 s at 10 clients, vmap
    0.052 s vs fused 0.128 s at 100. CUDA: fused up to CUDA_FUSED_MAX_CLIENTS, vmap above and
    for convolutional models, never worker processes; on a CPU fused for dense classifiers at any
    cohort size and the loop for convolutional models."""
    small, large = CUDA_FUSED_MAX_CLIENTS, CUDA_FUSED_MAX_CLIENTS + 1
    assert in_process(workload("mlp", "cuda", clients=10))[0] == "fused"
    assert in_process(workload("mlp", "cuda", clients=small))[0] == "fused"
    assert in_process(workload("mlp", "cuda", clients=large))[0] == "vmap"
    assert in_process(workload("mlp", "cuda", clients=100))[0] == "vmap"
    assert in_process(workload("cnn", "cuda", clients=10))[0] == "vmap"
    assert in_process(workload("mlp", "cpu", clients=100))[0] == "fused"
    assert in_process(workload("cnn", "cpu", clients=100))[0] == "loop"

    def auto(clients: int, model: str = "mlp", device: str = "cuda") -> str:
        return choose(workload(model, device, clients=clients), "auto").backend

    assert [auto(10), auto(100), auto(10, "cnn"), auto(100, "cnn")] == ["fused", "vmap", "vmap", "vmap"]
    assert [auto(100, device="cpu"), auto(10, "cnn", device="cpu")] == ["fused", "loop"]


# ----------------------------------------------------------------------------- make bench's GPU table


def test_bench_gpu_table_renders_and_says_why_it_is_skipped() -> None:
    """tests/benchmarks/gpu.py (make bench): the table with the GPU's name from a results dict, and
    on a machine without CUDA a skip with its reason instead of measurements."""
    from tests.benchmarks import gpu, report

    if not torch.cuda.is_available():
        skipped = gpu.run_gpu_workloads("quick", 1)
        assert "no CUDA device" in skipped["skipped"]
        assert "Skipped: no CUDA device" in "\n".join(gpu.markdown(skipped))
    work = {
        "model": "mlp",
        "cohort": 100,
        "rounds": 3,
        "best_s": {"fedcli fused": 0.128, "fedcli vmap": 0.052, "plain GPU loop": 1.3},
        "fedcli_best_s": 0.052,
        "plain_s": 1.3,
        "auto": {"executor": "vmap"},
        "floor": {"floor_s": 0.004},
    }
    measured = {
        "device": {"name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "memory_gib": 79.1, "cuda": "12.8"},
        "throughput_gflops": {"gemm": 51_000.0, "conv": 30_000.0},
        "workloads": {"mlp-100": work},
    }
    text = "\n".join(gpu.markdown(measured))
    assert (
        "## GPU: NVIDIA H100 80GB HBM3" in text
        and "| mlp-100 (R=3) | 0.004 | 0.128 | 0.052 | 1.3 | 25.00x" in text
    )
    cnn = {
        "model": "cnn",
        "cohort": 10,
        "rounds": 3,
        "best_s": {
            "fedcli vmap": 0.08,
            "fedcli vmap + graph": 0.010,
            "fedcli vmap + graph, tf32": 0.007,
            "plain GPU loop": 0.31,
            "plain GPU loop, tf32": 0.1,
        },
        "fedcli_best_s": 0.010,
        "plain_s": 0.31,
        "auto": {"executor": "vmap"},
        "floor": {"floor_s": 0.0019},
    }
    targets = gpu.gpu_targets({"cnn-10": cnn})
    assert [(t["name"], t["status"]) for t in targets] == [
        ("cnn-10 fp32: seconds per round (--graph)", "met"),
        ("cnn-10 fp32: plain GPU loop / --graph", "met"),
        ("cnn-10 tf32: seconds per round (--graph)", "MISSED"),
        ("cnn-10 tf32: plain GPU loop / --graph", "MISSED"),
    ]
    text = "\n".join(gpu.markdown({**measured, "workloads": {"cnn-10": cnn}, "targets": targets}))
    assert "| cnn-10 tf32: seconds per round (--graph) | 0.007 | <= 0.006 | MISSED |" in text
    machine = {
        "cpu": "x",
        "cores": 2,
        "torch": "2",
        "python": "3",
        "date": "d",
        "load_avg": (0.0, 0.0, 0.0),
        "gpu": "NVIDIA H100 80GB HBM3",
    }
    assert "GPU NVIDIA H100 80GB HBM3" in report.markdown({"machine": machine, "gpu": measured})


# ----------------------------------------------------------------------------- host work during device work


def test_next_rounds_plan_built_during_this_round_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where back ends return before the device is done (CUDA), train_cohort builds round r+1's cohort,
    plan and step keys on the host before it waits for round r; round r+1 then takes that plan. Forced
    on here: three rounds of SCAFFOLD give bit-identical parameters and client states, rounds 2 and 3
    use the prefetched plans (built on the host), and nothing is built past the last round."""
    from fedcli.engine import rounds

    made: list[tuple[int, bool]] = []
    real = rounds.plan_round

    def recording(setup, round_idx: int, on_host: bool = False):  # noqa: ANN001, ANN202
        made.append((round_idx, on_host))
        return real(setup, round_idx, on_host)

    extra = {"train.client_lr": 0.05, "train.rounds": 3}
    monkeypatch.setattr(rounds, "plan_round", recording)
    plain_params, plain_states = two_rounds("scaffold", "vmap", "lsq", extra, rounds=3)
    assert made == [(1, False), (2, False), (3, False)]
    made.clear()
    monkeypatch.setattr(rounds, "overlaps_host_work", lambda device: True)
    ahead_params, ahead_states = two_rounds("scaffold", "vmap", "lsq", extra, rounds=3)
    assert made == [(1, False), (2, True), (3, True)]
    for key in plain_params:
        assert torch.equal(ahead_params[key], plain_params[key])
    for client in plain_states:
        pytree.tree_map(
            lambda a, b: torch.testing.assert_close(b, a, rtol=0, atol=0),
            plain_states[client],
            ahead_states[client],
        )


def test_round_metrics_cross_to_the_host_in_one_copy_with_their_exact_values() -> None:
    """aggregate's to_host: scalar tensors (float32, float64, int), Python numbers and per-client
    columns come back as the floats float() / tolist() give, whatever their dtype."""
    from fedcli.engine.rounds import to_host

    scalars = {
        "a": torch.tensor(0.1, dtype=torch.float32),
        "b": torch.tensor(1 / 3, dtype=torch.float64),
        "n": torch.tensor(7),
        "up": 123456789,
        "x": 2.5,
    }
    columns = {
        "loss": torch.tensor([0.25, 1e-8, 3.0]),
        "n_i": torch.tensor([10.0, 20.0, 30.0], dtype=torch.float64),
    }
    host = to_host(scalars, columns)
    assert {k: host[k] for k in scalars} == {k: [float(v)] for k, v in scalars.items()}
    assert host[("column", "loss")] == columns["loss"].tolist()
    assert host[("column", "n_i")] == columns["n_i"].tolist()
    assert to_host({}, {}) == {}
