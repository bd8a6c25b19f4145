"""BatchNorm running statistics carried by the clients (train.bn_stats, issue 37; docs/bring-your-own.md,
"BatchNorm"): each client updates them with BatchNorm's momentum rule at every local step on its
own batches, on the loop and under vmap alike; the server takes their example-weighted mean;
evaluation, model.pt and checkpoints use it; `estimate` keeps the server-side re-estimation; a
model without BatchNorm carries nothing. The CLI runs (SIGKILL + resume, every option) are at the end.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fedcli.algorithms import ALGORITHMS
from fedcli.config.build import build_config
from fedcli.config.checks import make_hyperparameters
from fedcli.datasets.federated import FederatedData
from fedcli.datasets.registry import TASKS
from fedcli.datasets.tasks import TaskOptions
from fedcli.engine.backends.loop import LoopBackend
from fedcli.engine.backends.vmap import VmapBackend
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.cohort import STATS_PREFIX
from fedcli.engine.model import aggregate_stats, final_buffers, model_functions, with_precision
from fedcli.engine.rounds import Timing, aggregate, plan_round, train_cohort
from fedcli.engine.setup import Setup
from tests.byo.test_stock_layers_engine import metrics, reference_and_killed, setup_folder
from tests.byo.test_user_model import fedcli, final_params, store

MOMENTUM = 0.3  # not PyTorch's default 0.1: a test of the rule, not of a constant
BATCH = 8


def bn_net(features: int, classes: int, momentum: float | None = MOMENTUM) -> nn.Module:
    """BatchNorm on the raw inputs (its statistics have a closed form), then one inside the network."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.BatchNorm1d(features, momentum=momentum),
        nn.Linear(features, 16),
        nn.BatchNorm1d(16, momentum=momentum),
        nn.ReLU(),
        nn.Linear(16, classes),
    )


def make_setup(
    backend: str,
    sizes: tuple[int, ...],
    model: nn.Module | None = None,
    algo: str = "fedavg",
    bn_stats: str = "aggregate",
    rounds: int = 1,
    epochs: int = 1,
    chunk: int | None = None,
    precision: str = "fp32",
) -> Setup:
    """A run's set-up on synthetic-iid with clients of `sizes` examples, every client in every round."""
    task = TASKS["synthetic-iid"]
    data = task.load(TaskOptions(seed=0))
    starts = np.cumsum((0, *sizes))
    clients = [np.arange(a, b) for a, b in zip(starts[:-1], starts[1:], strict=True)]
    cfg = build_config(
        overrides={
            "algorithm.name": algo,
            "data.task": "synthetic-iid",
            "train.rounds": rounds,
            "train.clients_per_round": len(sizes),
            "train.batch_size": BATCH,
            "train.executor": backend,
            "train.client_lr": 0.1,
            "train.bn_stats": bn_stats,
            "train.local_epochs": epochs,
            "train.cohort_chunk": chunk,
        }
    )
    model = model if model is not None else bn_net(int(data.x.shape[1]), int(data.num_classes or 10))
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    fed = FederatedData(data.x, data.y, clients, torch.device("cpu"))
    hp = make_hyperparameters(algo, {})
    fns = with_precision(model_functions(task, model, fed, bn_stats), precision, torch.device("cpu"))
    return Setup(
        cfg,
        task,
        data,
        fed,
        fns,
        ALGORITHMS[algo],
        hp,
        torch.device("cpu"),
        LoopBackend() if backend == "loop" else VmapBackend(),
        init,
        opt=cfg.train.optim(task.client_lr),
        model=model,
    )


def one_round(setup: Setup) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], np.ndarray]:
    """Round 1: (each client's final statistics [C, ...], the global ones after aggregation, the cohort)."""
    state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    store = ClientStateStore(None)
    trained = train_cohort(setup, state, store, 1)
    per_client = {
        k[len(STATS_PREFIX) :]: v.clone()
        for k, v in trained.outs.metrics.items()
        if k.startswith(STATS_PREFIX)
    }
    aggregate(setup, state, store, trained, 1, Timing())
    assert setup.fns.client_stats is not None
    return per_client, dict(setup.fns.client_stats.current), trained.cohort


def by_hand(
    setup: Setup, cohort: np.ndarray, momentum: float | None = MOMENTUM, rounds: tuple[int, ...] = (1,)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first BatchNorm's statistics per client, by its momentum rule over the client's real
    steps in the planned order: mean <- (1 - m) mean + m batch mean, var <- (1 - m) var + m unbiased
    batch variance, from mean 0 and variance 1; momentum None: m = 1 / (steps so far, this one
    included), PyTorch's cumulative average. `rounds`: one chain through these rounds' plans (the
    cohort, every client, in the same order each round: train.bn_stats local). Returns ([C, D]
    means, [C, D] variances, [C] steps)."""
    plans = [plan_round(setup, r) for r in rounds]
    x = setup.fed.x
    means, variances, steps = [], [], []
    for c in range(len(cohort)):
        mean, var, count = torch.zeros(x.shape[1]), torch.ones(x.shape[1]), 0
        for planned in plans:
            assert planned.cohort[c] == cohort[c]
            plan = planned.plan
            for s in range(plan.index.shape[1]):
                if not bool(plan.step_mask[c, s]):
                    continue
                rows = plan.index[c, s][plan.weight[c, s] > 0]
                assert len(rows) == BATCH  # whole batches only: the closed form has no padding slots
                batch = x[rows].to(torch.float64)
                count += 1
                m = 1.0 / count if momentum is None else momentum
                mean = (1 - m) * mean + m * batch.mean(0)
                var = (1 - m) * var + m * batch.var(0, unbiased=True)
        means.append(mean)
        variances.append(var)
        steps.append(count)
    return torch.stack(means), torch.stack(variances), torch.tensor(steps)


def test_one_client_one_step_is_the_closed_form() -> None:
    """One client, one step: running mean = (1 - m) * 0 + m * batch mean, running var =
    (1 - m) * 1 + m * unbiased batch variance, num_batches_tracked = 1; the global statistics
    are that client's."""
    setup = make_setup("vmap", (BATCH,))
    per_client, global_, cohort = one_round(setup)
    batch = setup.fed.x[np.asarray(setup.fed.client_indices[int(cohort[0])])].to(torch.float64)
    expected_mean = MOMENTUM * batch.mean(0)
    expected_var = (1 - MOMENTUM) + MOMENTUM * batch.var(0, unbiased=True)
    torch.testing.assert_close(per_client["0.running_mean"][0].double(), expected_mean, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(per_client["0.running_var"][0].double(), expected_var, atol=1e-6, rtol=1e-5)
    assert int(per_client["0.num_batches_tracked"][0]) == 1
    torch.testing.assert_close(global_["0.running_mean"].double(), expected_mean, atol=1e-6, rtol=1e-5)
    assert int(global_["2.num_batches_tracked"]) == 1


def test_each_client_its_own_momentum_update_loop_and_vmap_alike() -> None:
    """Clients of 1, 2 and 3 whole batches: each client's statistics are its own momentum update
    over its steps (masked padded steps under vmap write nothing), by hand for the first
    BatchNorm; loop and vmap agree within 1e-6 on every BatchNorm; the global statistics are the
    example-weighted mean of the clients'."""
    sizes = (BATCH, 2 * BATCH, 3 * BATCH)
    results = {}
    for backend in ("loop", "vmap"):
        setup = make_setup(backend, sizes)
        results[backend] = one_round(setup)
    per_loop, global_loop, cohort = results["loop"]
    per_vmap, global_vmap, _ = results["vmap"]
    means, variances, steps = by_hand(setup, cohort)
    for per in (per_loop, per_vmap):
        torch.testing.assert_close(per["0.running_mean"].double(), means, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(per["0.running_var"].double(), variances, atol=1e-6, rtol=1e-5)
        assert torch.equal(per["0.num_batches_tracked"], steps)
        assert torch.equal(per["2.num_batches_tracked"], steps)
    assert sorted(steps.tolist()) == [1, 2, 3]
    for k in per_loop:
        torch.testing.assert_close(per_vmap[k], per_loop[k], atol=1e-6, rtol=0)
        torch.testing.assert_close(global_vmap[k], global_loop[k], atol=1e-6, rtol=0)
    weights = torch.tensor([len(setup.fed.client_indices[int(c)]) for c in cohort], dtype=torch.float64)
    for k in ("0.running_mean", "0.running_var", "2.running_mean", "2.running_var"):
        expected = (per_loop[k].double() * weights[:, None]).sum(0) / weights.sum()
        torch.testing.assert_close(global_loop[k].double(), expected, atol=1e-6, rtol=1e-6)
        assert not torch.allclose(
            global_loop[k], per_loop[k].mean(0), atol=1e-4
        )  # weighted, not a plain mean
    assert int(global_loop["0.num_batches_tracked"]) == round(float((steps * weights).sum() / weights.sum()))


def test_cumulative_batchnorm_over_two_epochs_loop_and_vmap_alike() -> None:
    """momentum=None (a cumulative average) over two local epochs, clients of 1, 2 and 3 batches: under
    vmap the shorter clients' second epoch starts after masked steps, and each client still gets its
    own factor 1 / count; by hand for the first BatchNorm, loop and vmap within 1e-6 on both."""
    sizes = (BATCH, 2 * BATCH, 3 * BATCH)
    results = {}
    for backend in ("loop", "vmap"):
        model = bn_net(60, 10, momentum=None)
        setup = make_setup(backend, sizes, model=model, epochs=2)
        results[backend] = one_round(setup)
    (per_loop, _, cohort), (per_vmap, _, _) = results["loop"], results["vmap"]
    means, variances, steps = by_hand(setup, cohort, momentum=None)
    assert sorted(steps.tolist()) == [2, 4, 6]
    for per in (per_loop, per_vmap):
        torch.testing.assert_close(per["0.running_mean"].double(), means, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(per["0.running_var"].double(), variances, atol=1e-6, rtol=1e-5)
        assert torch.equal(per["2.num_batches_tracked"], steps)
    for k in per_loop:
        torch.testing.assert_close(per_vmap[k], per_loop[k], atol=1e-6, rtol=0)


def test_bf16_carries_them_under_vmap_as_on_the_loop() -> None:
    """--precision bf16: the second BatchNorm gets a bfloat16 input from the autocast Linear before it;
    under vmap, with batched float32 running statistics, PyTorch refused that ("expected scalar type
    BFloat16 but found Float"). Both back ends train the round; the statistics stay float32; the first
    BatchNorm (raw float32 inputs) is still its closed form; the second agrees between loop and vmap
    to bfloat16's rounding (its input is a bfloat16 Linear's output on both)."""
    sizes = (BATCH, 2 * BATCH, 3 * BATCH)
    results = {}
    for backend in ("loop", "vmap"):
        setup = make_setup(backend, sizes, precision="bf16")
        results[backend] = one_round(setup)
    (per_loop, global_loop, cohort), (per_vmap, global_vmap, _) = results["loop"], results["vmap"]
    means, variances, steps = by_hand(setup, cohort)
    for per in (per_loop, per_vmap):
        assert all(v.dtype == torch.float32 for k, v in per.items() if "running" in k)
        torch.testing.assert_close(per["0.running_mean"].double(), means, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(per["0.running_var"].double(), variances, atol=1e-6, rtol=1e-5)
        assert torch.equal(per["2.num_batches_tracked"], steps)
    for k in ("2.running_mean", "2.running_var"):
        assert torch.isfinite(per_vmap[k]).all()
        torch.testing.assert_close(per_vmap[k], per_loop[k], atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(global_vmap[k], global_loop[k], atol=2e-2, rtol=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_a_round_made_a_group_at_a_time_carries_them_alike(backend: str) -> None:
    """--cohort-chunk 1 (the round's inputs made a group of clients at a time, engine/cohort.py
    stream_cohort): each client's statistics and the global ones equal the whole cohort's."""
    sizes = (BATCH, 2 * BATCH, 3 * BATCH)
    whole, _, _ = one_round(make_setup(backend, sizes))
    grouped_setup = make_setup(backend, sizes, chunk=1)
    grouped, global_, _ = one_round(grouped_setup)
    assert set(grouped) == set(whole) and "0.running_mean" in grouped
    for k in whole:
        torch.testing.assert_close(grouped[k], whole[k], atol=1e-6, rtol=0)
    weights = torch.tensor(sorted(sizes, reverse=True), dtype=torch.float64)
    expected = (grouped["0.running_mean"].double() * weights[:, None]).sum(0) / weights.sum()
    torch.testing.assert_close(global_["0.running_mean"].double(), expected, atol=1e-6, rtol=1e-6)


def test_local_keeps_each_clients_own_across_rounds() -> None:
    """--bn-stats local (FedBN): over two rounds each client continues its own statistics (its round-2
    start is its round-1 end, never an average): by hand for the first BatchNorm as one momentum
    chain through both rounds; loop and vmap within 1e-6; the evaluation statistics are the
    example-weighted mean of the stored clients' statistics."""
    sizes = (BATCH, 2 * BATCH, 3 * BATCH)
    results = {}
    for backend in ("loop", "vmap"):
        setup = make_setup(backend, sizes, bn_stats="local")
        carried = setup.fns.client_stats
        assert carried is not None and carried.store is not None
        state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
        store = ClientStateStore(None)
        ends: dict[int, dict[str, torch.Tensor]] = {}
        for round_idx in (1, 2):
            trained = train_cohort(setup, state, store, round_idx)
            assert trained.stats_start is not None and trained.stats_seen is not None
            assert trained.stats_seen.tolist() == [round_idx == 2] * len(sizes)
            for row, client in enumerate(trained.cohort):
                for k, v in ends.get(int(client), {}).items():
                    assert torch.equal(trained.stats_start[k][row], v), (round_idx, client, k)
            state, _ = aggregate(setup, state, store, trained, round_idx, Timing())
            ends = {c: {k: v.clone() for k, v in s.items()} for c, s in carried.store.state_dict().items()}
        results[backend] = (ends, dict(carried.current), trained.cohort)
    (ends_loop, current_loop, cohort), (ends_vmap, current_vmap, _) = results["loop"], results["vmap"]
    means, variances, steps = by_hand(setup, cohort, rounds=(1, 2))
    for ends in (ends_loop, ends_vmap):
        mine = {k: torch.stack([ends[int(c)][k] for c in cohort]) for k in ends[int(cohort[0])]}
        torch.testing.assert_close(mine["0.running_mean"].double(), means, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(mine["0.running_var"].double(), variances, atol=1e-6, rtol=1e-5)
        assert torch.equal(mine["2.num_batches_tracked"], steps)
    assert sorted(steps.tolist()) == [2, 4, 6]
    for c in ends_loop:
        for k in ends_loop[c]:
            torch.testing.assert_close(ends_vmap[c][k], ends_loop[c][k], atol=1e-6, rtol=0)
    weights = {int(c): float(len(setup.fed.client_indices[int(c)])) for c in cohort}
    total = sum(weights.values())
    for k in ("0.running_mean", "2.running_var"):
        expected = sum(weights[c] * ends_loop[c][k].double() for c in ends_loop) / total
        torch.testing.assert_close(current_loop[k].double(), expected, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(current_vmap[k], current_loop[k], atol=1e-6, rtol=0)


def test_aggregate_stats_is_the_example_weighted_mean() -> None:
    """aggregate_stats on given numbers: (1 * 1 + 3 * 5) / 4 = 4; counts rounded to the nearest integer."""
    out = aggregate_stats(
        {"m": torch.tensor([[1.0, 2.0], [5.0, 6.0]]), "n": torch.tensor([1, 4])}, torch.tensor([1.0, 3.0])
    )
    torch.testing.assert_close(out["m"], torch.tensor([4.0, 5.0]))
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 3  # 3.25 -> 3


def test_evaluation_and_model_pt_use_the_aggregate_estimate_its_own() -> None:
    """aggregate: evaluation in eval mode normalises by the aggregated statistics (the output
    equals a module loaded with them) and final_buffers returns them; estimate: the clients carry
    nothing and the statistics are the server's estimate."""
    setup = make_setup("vmap", (BATCH, 2 * BATCH))
    _, global_, _ = one_round(setup)
    params = setup.init_params
    x = setup.fed.x[:5]
    out = setup.fns.apply_fn(params, x)
    reference = bn_net(x.shape[1], out.shape[1])
    reference.load_state_dict(
        {
            **params,
            **global_,
            **{k: v for k, v in reference.state_dict().items() if k not in params and k not in global_},
        }
    )
    reference.eval()
    torch.testing.assert_close(out, reference(x))
    saved = final_buffers(setup.fns, setup.model, params)
    assert saved is not None and all(torch.equal(saved[k], global_[k]) for k in global_)

    estimated = make_setup("vmap", (BATCH, 2 * BATCH), bn_stats="estimate")
    assert estimated.fns.client_stats is None
    state = estimated.alg.server_init(estimated.init_params, estimated.hp, estimated.opt)
    trained = train_cohort(estimated, state, ClientStateStore(None), 1)
    assert not any(k.startswith(STATS_PREFIX) for k in trained.outs.metrics)
    saved = final_buffers(estimated.fns, estimated.model, params)
    assert saved is not None and not torch.allclose(saved["0.running_mean"], global_["0.running_mean"])


def test_a_model_without_batchnorm_carries_nothing() -> None:
    """No BatchNorm: no client statistics, no buffers in the cohort's inputs or outputs, no model.pt buffers."""
    task = TASKS["synthetic-iid"]
    model = task.models[task.default_model]()
    setup = make_setup("vmap", (BATCH, 2 * BATCH), model=model)
    assert setup.fns.client_stats is None
    state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    trained = train_cohort(setup, state, ClientStateStore(None), 1)
    assert set(trained.outs.metrics) == {"train_loss"}
    assert final_buffers(setup.fns, setup.model, setup.init_params) is None


# ---- the CLI, as a user runs it ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("option", ["aggregate", "local"])
def test_sigkill_then_resume_equals_the_uninterrupted_run_with_carried_stats(
    tmp_path: Path, option: str
) -> None:
    """The BatchNorm + Dropout CNN, statistics aggregated or kept per client (3 of 10 clients a
    round), on the loop: SIGKILL with round 3 logged, then --resume: the same parameters,
    statistics and metrics, bit for bit, as the uninterrupted run; the checkpoints hold the
    statistics (local: each stored client's own too)."""
    data = setup_folder(tmp_path)
    args = [
        "--bn-stats",
        option,
        "--data",
        str(data),
        "--model",
        "./stocknets.py:BNCNN",
        "--executor",
        "loop",
        "--rounds",
        "16",
        "--clients-per-round",
        "3",
        "--checkpoint-every",
        "1",
        "--no-mlflow",
    ]
    ref_id, root, run_id = reference_and_killed(tmp_path, args, rounds=16)
    checkpoints = sorted((root / "runs" / run_id / "checkpoints").glob("round-*.pt"))
    assert checkpoints
    saved = torch.load(checkpoints[-1], weights_only=True)["buffers"]
    assert any(k.endswith("running_mean") for k in saved)
    assert any(k.startswith("client.") for k in saved) == (option == "local")

    resumed = fedcli(root, "--resume", run_id[:8], "--model", f"{tmp_path / 'stocknets.py'}:BNCNN", cwd="/")
    assert resumed.returncode == 0, resumed.stderr
    for name, tensor in final_params(tmp_path / "ref", ref_id).items():
        assert torch.equal(final_params(root, run_id)[name], tensor), name
    ref_buffers = torch.load(tmp_path / "ref" / "runs" / ref_id / "model.pt", weights_only=True)["buffers"]
    got = torch.load(root / "runs" / run_id / "model.pt", weights_only=True)["buffers"]
    assert set(got) == set(ref_buffers) and all(torch.equal(got[k], ref_buffers[k]) for k in got)
    assert metrics(root, run_id) == metrics(tmp_path / "ref", ref_id)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fedcli_train_with_each_bn_stats_option(tmp_path: Path) -> None:
    """`fedcli train --model file.py:factory` with a BatchNorm + Dropout CNN under each --bn-stats:
    exit 0, finite accuracy, the option recorded; model.pt's statistics are the clients' aggregate
    (counting their steps) or the server's estimate (other values); a bad value is one line,
    exit 2, nothing written."""
    data = setup_folder(tmp_path)
    done: dict[str, dict[str, torch.Tensor]] = {}
    for option in ("aggregate", "local", "estimate"):
        root = tmp_path / option
        run = fedcli(
            root,
            "--data",
            str(data),
            "--model",
            "stocknets.py:BNCNN",
            "--bn-stats",
            option,
            "--executor",
            "vmap",
            "--rounds",
            "2",
            "--clients-per-round",
            "3",
            "--no-mlflow",
            cwd=tmp_path,
        )
        assert run.returncode == 0, run.stderr
        (record,) = store(root).list_runs()
        assert record.config["train"]["bn_stats"] == option
        scores = metrics(root, record.id)
        assert np.isfinite(scores[2, "eval/accuracy"])
        done[option] = torch.load(root / "runs" / record.id / "model.pt", weights_only=True)["buffers"]
    means = [k for k in done["aggregate"] if k.endswith("running_mean")]
    assert means and all(not torch.equal(done["aggregate"][k], done["estimate"][k]) for k in means)
    assert all(not torch.equal(done["aggregate"][k], done["local"][k]) for k in means)
    counts = [int(v) for k, v in done["aggregate"].items() if k.endswith("num_batches_tracked")]
    assert min(counts) >= 2  # two rounds of at least one step each, carried from round to round
    bad = fedcli(
        tmp_path / "bad",
        "--data",
        str(data),
        "--model",
        "stocknets.py:BNCNN",
        "--bn-stats",
        "fedbn",
        "--rounds",
        "1",
        "--no-mlflow",
        cwd=tmp_path,
    )
    assert bad.returncode == 2
    line = bad.stderr.strip()
    assert len(line.splitlines()) == 1 and "bn_stats" in line and "Traceback" not in line, line
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_process_workers_carry_them_as_the_loop_and_evaluate_reads_them(tmp_path: Path) -> None:
    """--executor process (2 workers; what auto picks for a CNN on a multi-core CPU) gives the loop's
    parameters and statistics bit for bit; `fedcli evaluate` of the run (model.pt) and of its last
    checkpoint reproduces the last round's eval/loss (the aggregated statistics, not fresh ones)."""
    import json

    data = setup_folder(tmp_path)
    args = [
        "--data",
        str(data),
        "--model",
        "stocknets.py:BNCNN",
        "--rounds",
        "3",
        "--clients-per-round",
        "4",
        "--workers",
        "2",
        "--checkpoint-every",
        "1",
        "--no-mlflow",
    ]
    models = {}
    for executor in ("loop", "process"):
        root = tmp_path / executor
        done = fedcli(root, *args, "--executor", executor, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        (run,) = store(root).list_runs()
        models[executor] = torch.load(root / "runs" / run.id / "model.pt", weights_only=True)
    for part in ("params", "buffers"):
        loop, process = models["loop"][part], models["process"][part]
        assert set(loop) == set(process) and all(torch.equal(loop[k], process[k]) for k in loop), part

    root = tmp_path / "loop"
    (run,) = store(root).list_runs()
    final = float(store(root).metrics_frame([run.id], keys=["eval/loss"])["value"].iloc[-1])
    for extra in ((), ("--checkpoint", "3")):
        evaluated = fedcli(
            root,
            run.id[:8],
            "--json",
            "--split",
            "test",
            *extra,
            "--model",
            "stocknets.py:BNCNN",
            command="evaluate",
            cwd=tmp_path,
        )
        assert evaluated.returncode == 0, evaluated.stderr
        assert json.loads(evaluated.stdout)["metrics"]["test/loss"] == pytest.approx(final, abs=1e-5), extra
