"""`--graph` (engine/backends/graphed.py): the vmapped cohort update traced once per key into one program
and replayed; on CUDA captured as one CUDA graph.

What the CPU checks: the traced program computes what the eager executors compute (every
algorithm that runs vmapped, over two rounds, against the client-by-client loop; the CNN's
keyed dropout; chunks), a program is reused across rounds with new inputs and rebuilt only for
a new key (shapes, FedPA's burn-in), the fallbacks, the device check before a capture, and the
CLI's refusals. The tests marked `cuda` replay captured graphs on a GPU; they skip without one.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys

import pytest
import torch
from torch.utils import _pytree as pytree

from fedcli.algorithms import ALGORITHMS
from fedcli.config.checks import make_hyperparameters
from fedcli.engine.backends import graphed, keyed_every_round
from fedcli.engine.backends.graphed import GraphedVmap, Untraceable
from tests.engine.test_equivalence import assert_same_run, pick_task, required_hyperparameters, two_rounds
from tests.engine.test_workers import assert_trees_close, job, lsq_round, vmap_run

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("algo", [name for name, rec in ALGORITHMS.items() if rec.supports_vmap])
def test_graph_agrees_with_the_loop_for_every_algorithm(algo: str, caplog: pytest.LogCaptureFixture) -> None:
    """Two rounds (state crosses rounds, clients of different lengths, 2 local epochs) with --graph
    equal the loop back end's: the program holds every local step, mask and state update. Every
    algorithm is traced (no fallback warning), except those whose round_key changes every round
    (FOLA), which run eagerly by design."""
    task = pick_task(algo)
    extra = {"train.client_lr": 0.01}
    with caplog.at_level(logging.WARNING, logger="fedcli.engine.backends.graphed"):
        graph_run = two_rounds(algo, "vmap", task, {**extra, "train.graph": True})
    assert_same_run(graph_run, two_rounds(algo, "loop", task, extra))
    warnings = [r.getMessage() for r in caplog.records]
    hp = make_hyperparameters(
        algo, {**required_hyperparameters(algo), **({"burn_in_rounds": 1} if algo == "fedpa" else {})}
    )
    if keyed_every_round(ALGORITHMS[algo], hp, 1):
        assert len(warnings) == 1 and "round_key changes every round" in warnings[0]
    else:
        assert warnings == []


def test_graph_keeps_the_cnn_dropout_keys() -> None:
    """The CNN's two dropout layers draw their masks from the step keys, which are program inputs:
    a round of the FEMNIST CNN with --graph equals the loop's (momentum 0.9 carried in the program)."""
    extra = {
        "data.model": "cnn",
        "partition.num_clients": 5,
        "train.clients_per_round": 2,
        "train.local_epochs": 1,
        "train.batch_size": 64,
        "train.client_momentum": 0.9,
    }
    assert_same_run(
        two_rounds("fedavg", "vmap", "femnist", {**extra, "train.graph": True}, rounds=1),
        two_rounds("fedavg", "loop", "femnist", extra, rounds=1),
    )


def test_graph_with_cohort_chunks_agrees_with_the_loop() -> None:
    """--cohort-chunk 3 on a cohort of 4: one program per chunk shape, results back in cohort order."""
    extra = {"train.client_lr": 0.01}
    assert_same_run(
        two_rounds("scaffold", "vmap", "lsq", {**extra, "train.graph": True, "train.cohort_chunk": 3}),
        two_rounds("scaffold", "loop", "lsq", extra),
    )


@pytest.mark.parametrize(("algo", "programs"), [("fedavg", 1), ("scaffold", 1), ("fedpa", 2)])
def test_a_program_is_built_once_per_key_and_replayed_with_each_rounds_inputs(
    algo: str, programs: int
) -> None:
    """Six rounds of the same shapes: FedAvg and SCAFFOLD build one program, FedPA two (burn-in rounds
    1-3 run FedAvg, rounds 4-6 sample: its round_key). Each round's inputs differ (the broadcast moves,
    the keys change), and every round's result equals the eager vmap executor's on the same inputs,
    so a replay computes from its new inputs, not the ones it was traced with."""
    extra = {"algorithm.hp": {"burn_in_rounds": 3}} if algo == "fedpa" else {}
    _, setup, bc, inputs = lsq_round(algo, cohort_size=3, epochs=2, **extra)
    runner = GraphedVmap(torch.device("cpu"))
    previous = None
    for round_idx in range(1, 7):
        keys = inputs.keys + 1000 * round_idx
        moved = pytree.tree_map(lambda t, r=round_idx: t * (1 + 0.1 * r) if t.is_floating_point() else t, bc)
        these = dataclasses.replace(inputs, keys=keys)
        got = runner.run(job(setup, moved, these, round_idx))
        assert_trees_close(got, vmap_run(setup, moved, these, round_idx))
        if previous is not None:
            assert not torch.equal(pytree.tree_leaves(got.upload)[0], pytree.tree_leaves(previous.upload)[0])
        previous = got
    assert len(runner.programs) == programs
    assert all(program is not None for program in runner.programs.values())
    assert runner.build_s > 0


def test_a_new_shape_is_a_new_program() -> None:
    """A cohort of another size cannot replay the program of the first: a second program is built."""
    runner = GraphedVmap(torch.device("cpu"))
    for size in (3, 4, 3):
        _, setup, bc, inputs = lsq_round("fedavg", cohort_size=size, epochs=1)
        got = runner.run(job(setup, bc, inputs))
        assert_trees_close(got, vmap_run(setup, bc, inputs))
    assert len(runner.programs) == 2


def test_client_code_keyed_by_every_round_runs_eagerly_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """FOLA's client code depends on the round itself (P_n = F_n / r + ..., its declared round_key): a
    program per round never pays, so --graph runs it with the eager vmap computation, builds nothing,
    warns once."""
    _, setup, bc, inputs = lsq_round("fola", cohort_size=3, epochs=1)
    runner = GraphedVmap(torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="fedcli.engine.backends.graphed"):
        for round_idx in (1, 2, 3):
            got = runner.run(job(setup, bc, inputs, round_idx))
            assert_trees_close(got, vmap_run(setup, bc, inputs, round_idx))
    assert not runner.programs
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "round_key changes every round" in caplog.records[0].getMessage()


def test_a_program_that_cannot_be_traced_runs_eagerly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """When tracing fails the key runs the eager vmap executor (same results), with one warning
    naming the error, and is not traced again in later rounds."""
    import torch.fx.experimental.proxy_tensor as proxy_tensor

    calls = []

    def refuse(fn, **kwargs):  # noqa: ANN001, ANN003, ANN202
        calls.append(fn)
        raise RuntimeError("data-dependent control flow")

    monkeypatch.setattr(proxy_tensor, "make_fx", refuse)
    _, setup, bc, inputs = lsq_round("fedavg", cohort_size=3, epochs=1)
    runner = GraphedVmap(torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="fedcli.engine.backends.graphed"):
        for round_idx in (1, 2):
            got = runner.run(job(setup, bc, inputs, round_idx))
            assert_trees_close(got, vmap_run(setup, bc, inputs, round_idx))
    assert len(calls) == 1 and list(runner.programs.values()) == [None]
    assert len(caplog.records) == 1 and "data-dependent control flow" in caplog.records[0].getMessage()


def test_tracing_refuses_branching_on_tensor_values_and_keeps_item_a_runtime_value() -> None:
    """What a static program cannot hold fails while tracing, not silently later: Python branching
    on a tensor's value raises. `.item()` becomes an op of the program, evaluated on each call's
    inputs (not the value seen while tracing)."""
    with pytest.raises(Exception, match="data-dependent"):
        graphed.trace(lambda x: [x + 1 if x.sum() > 0 else x - 1], [torch.ones(3)])
    program = graphed.trace(lambda x: [x * x.sum().item()], [torch.ones(3)])
    assert program(torch.full((3,), 2.0))[0].tolist() == [12.0, 12.0, 12.0]


@pytest.mark.parametrize(("algo", "programs"), [("scaffold", 1), ("fedpa", 2)])
def test_the_eager_program_that_a_gpu_captures_replays_like_vmap(algo: str, programs: int) -> None:
    """On CUDA the eager cohort function itself is captured (no trace). Here the same function runs
    uncaptured (trace=False, capture=False) through the same static plumbing: flat inputs, statics,
    the output layout, one program per key; every round equals the vmap back end's."""
    extra = {"algorithm.hp": {"burn_in_rounds": 2}} if algo == "fedpa" else {}
    _, setup, bc, inputs = lsq_round(algo, cohort_size=3, epochs=2, **extra)
    runner = GraphedVmap(torch.device("cpu"), capture=False, trace=False)
    for round_idx in range(1, 5):
        moved = pytree.tree_map(lambda t, r=round_idx: t * (1 + 0.1 * r) if t.is_floating_point() else t, bc)
        these = dataclasses.replace(inputs, keys=inputs.keys + 1000 * round_idx)
        got = runner.run(job(setup, moved, these, round_idx))
        assert_trees_close(got, vmap_run(setup, moved, these, round_idx))
    assert len(runner.programs) == programs and all(p is not None for p in runner.programs.values())


def test_capture_refuses_a_program_with_host_tensors() -> None:
    """A CUDA graph replays only device work: a program whose inputs (or held data) are on the CPU is
    refused before any capture starts (the traced program then runs uncaptured)."""
    _, setup, bc, inputs = lsq_round("fedavg", cohort_size=3, epochs=1)
    runner = GraphedVmap(torch.device("cpu"), capture=False)
    runner.run(job(setup, bc, inputs))
    (program,) = runner.programs.values()
    assert program is not None
    with pytest.raises(Untraceable, match="one GPU"):
        graphed.capture(program, [inputs.plan.weight])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--executor", "process"], "does not apply to --executor process"),
        (["--compile"], "choose one of them"),
    ],
)
def test_cli_refuses_graph_where_it_cannot_apply(tmp_path, args: list[str], message: str) -> None:  # noqa: ANN001
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            "--task",
            "lsq",
            "--rounds",
            "1",
            "--graph",
            "--device",
            "cpu",
            "--root",
            str(tmp_path),
            "--no-mlflow",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "fedcli.db").exists() or "finished" not in proc.stdout


def test_cli_graph_run_names_its_executor(tmp_path) -> None:  # noqa: ANN001
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "train",
            "--task",
            "lsq",
            "--rounds",
            "2",
            "--graph",
            "--device",
            "cpu",
            "--root",
            str(tmp_path),
            "--no-mlflow",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "(vmap + graph executor)" in proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- on a GPU


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("algo", ["fedavg", "scaffold", "fedpa", "fedprox"])
def test_captured_graph_on_cuda_equals_the_cpu_loop(algo: str) -> None:
    """On the GPU every program is captured (graph present) and two rounds replayed from it equal the
    CPU loop's parameters and client states."""
    extra = {"train.client_lr": 0.01}
    assert_same_run(
        two_rounds(algo, "vmap", "lsq", {**extra, "train.graph": True, "train.device": "cuda"}),
        two_rounds(algo, "loop", "lsq", {**extra, "train.device": "cpu"}),
    )


@needs_cuda
@pytest.mark.cuda
def test_captured_programs_replay_new_inputs_on_cuda() -> None:
    """Six rounds on the GPU with moving inputs: one captured graph, every round equal to eager vmap."""
    _, setup, bc, inputs = lsq_round("fedavg", cohort_size=3, epochs=2, **{"train.device": "cuda"})
    runner = GraphedVmap(torch.device("cuda"))
    for round_idx in range(1, 7):
        moved = pytree.tree_map(lambda t, r=round_idx: t * (1 + 0.1 * r) if t.is_floating_point() else t, bc)
        these = dataclasses.replace(inputs, keys=inputs.keys + 1000 * round_idx)
        got = runner.run(job(setup, moved, these, round_idx))
        assert_trees_close(got, vmap_run(setup, moved, these, round_idx))
    (program,) = runner.programs.values()
    assert program is not None and program.graph is not None


@needs_cuda
@pytest.mark.cuda
def test_captured_cnn_with_dropout_on_cuda_equals_the_cpu_loop() -> None:
    extra = {
        "data.model": "cnn",
        "partition.num_clients": 5,
        "train.clients_per_round": 2,
        "train.local_epochs": 1,
        "train.batch_size": 64,
        "train.client_momentum": 0.9,
    }
    assert_same_run(
        two_rounds(
            "fedavg", "vmap", "femnist", {**extra, "train.graph": True, "train.device": "cuda"}, rounds=1
        ),
        two_rounds("fedavg", "loop", "femnist", {**extra, "train.device": "cpu"}, rounds=1),
    )
