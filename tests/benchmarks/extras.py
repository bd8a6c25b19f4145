"""The other figures of `make bench`: FedPA's overhead, tracking's share, start-up, memory.

- FedPA Table 1 (Al-Shedivat et al. 2021): one client update on a synthetic linear
  regression, 5 local epochs x 100 steps, l = 5 samples, FedAvg vs FedPA (DP delta) for
  d = 1e2..1e6; overhead = t_FedPA / t_FedAvg - 1 (median of repeats, same context).
- Tracking: `engine.train` with the SQL store and MLflow on the MLP workload, one
  evaluation per round: the share of the round loop spent in `tracker.log_round`.
- Start-up: `fedcli train` as a fresh process, from launch to the start of round 1 (a
  sitecustomize probe prints the time of the first `run_round` call).
- Memory: a synthetic federation of 3,400 clients (EMNIST scale, 200 images each) trained
  with SCAFFOLD (one control variate per visited client): RSS against clients visited, at a
  fixed cohort, and the per-round transient for cohorts of 10 and 50 (and 50 in chunks of 10).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch

from fedcli.algorithms import ALGORITHMS
from fedcli.algorithms.base import Batch, ClientContext, tree_nbytes
from fedcli.config.build import build_config
from fedcli.config.checks import make_hyperparameters
from fedcli.datasets import models
from fedcli.datasets.bundled.femnist import FEMNIST
from fedcli.datasets.federated import FederatedData
from fedcli.datasets.tasks import Task, TaskData
from fedcli.engine.backends.vmap import VmapBackend
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.model import model_functions
from fedcli.engine.rounds import Timing, run_round
from fedcli.engine.setup import Setup

PAPER_FEDPA = {100: 26.0, 1_000: 21.0, 10_000: 16.0, 100_000: 4.0}  # Table 1, DP column, % over FedAvg


def _lsq_context(dim: int, epochs: int, steps: int, batch: int) -> ClientContext:
    """One client of a synthetic linear regression: a pool of 2 batches reused every step."""
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(2, batch, dim, generator=gen)
    y = x @ torch.randn(dim, generator=gen) + 0.1 * torch.randn(2, batch, generator=gen)

    def loss_fn(params: dict[str, torch.Tensor], b: Batch) -> torch.Tensor:
        return 0.5 * ((b.x @ params["w"] - b.y) ** 2).mean()

    def apply_fn(params: dict[str, torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
        return inputs @ params["w"]

    weight, key = torch.ones(batch), torch.zeros((), dtype=torch.int64)
    return ClientContext(
        loss_fn=loss_fn,
        apply_fn=apply_fn,
        batch=lambda step: Batch(x=x[step % 2], y=y[step % 2], weight=weight, key=key),
        step_mask=torch.ones(epochs * steps),
        num_examples=torch.tensor(float(steps * batch)),
        num_epochs=epochs,
        steps_per_epoch=steps,
        round_idx=1,
        noise={},
    )


def fedpa_overhead(
    dims: list[int], repeats: int = 5, steps: int = 100, batch: int = 10
) -> list[dict[str, float]]:
    """Return per d: ms of FedAvg's and FedPA's client update and FedPA's overhead (%)."""
    cfg = build_config(
        overrides={"algorithm.name": "fedpa", "train.local_epochs": 5, "train.client_lr": 1e-3},
        hp={"burn_in_rounds": 0},
    )
    opt = cfg.train.optim(default_client_lr=1e-3)  # client_lr is set above; the default is unused
    fedavg, fedpa = ALGORITHMS["fedavg"], ALGORITHMS["fedpa"]
    hp_avg, hp_pa = make_hyperparameters("fedavg", {}), make_hyperparameters("fedpa", {"burn_in_rounds": 0})
    rows = []
    for dim in dims:
        ctx = _lsq_context(dim, opt.local_epochs, steps, batch)
        params = {"w": torch.zeros(dim)}
        times: dict[str, list[float]] = {"fedavg": [], "fedpa": []}
        for alg, hp in ((fedavg, hp_avg), (fedpa, hp_pa)):  # warm-up: first-call costs of torch.func
            alg.client_update(ctx, alg.broadcast(alg.server_init(params, hp, opt), hp), None, hp, opt)
        for _ in range(repeats if dim < 1_000_000 else max(2, repeats // 2)):
            for name, alg, hp in (
                ("fedavg", fedavg, hp_avg),
                ("fedpa", fedpa, hp_pa),
            ):  # interleaved: same noise
                bc = alg.broadcast(alg.server_init(params, hp, opt), hp)
                start = time.perf_counter()
                alg.client_update(ctx, bc, None, hp, opt)
                times[name].append(time.perf_counter() - start)
        avg, pa = statistics.median(times["fedavg"]), statistics.median(times["fedpa"])
        rows.append(
            {
                "d": dim,
                "fedavg_ms": 1e3 * avg,
                "fedpa_ms": 1e3 * pa,
                "overhead_pct": 100 * (pa / avg - 1),
                "paper_pct": PAPER_FEDPA.get(dim),
            }
        )
    return rows


def _cli_round_times(args: list[str], root: Path) -> list[float]:
    """Run `fedcli train ARGS` (a fresh --root) and return its time/round_s of rounds 1..R from the store."""
    import subprocess
    import sys

    from fedcli.tracking.store.sql_store import SqlStore

    proc = subprocess.run(
        [sys.executable, "-m", "fedcli", "-q", "train", "--root", str(root), *args],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"fedcli train failed: {proc.stderr.strip().splitlines()[-1:]}")
    store = SqlStore(f"sqlite:///{root / 'fedcli.db'}")
    run = store.list_runs()[-1]
    frame = store.metrics_frame([run.id], keys=["time/round_s"])
    return [float(v) for v in frame.sort_values("round_idx")["value"]]


def component_cost(
    base: list[str], with_args: list[str], without_args: list[str], reps: int, root: Path, first: int = 10
) -> dict[str, float]:
    """Round wall time of `fedcli train` with vs without a component, as users run it (CLI, fresh root).

    The two variants alternate (with, without, with, ...) so both meet the same machine; each
    figure is the median over repetitions of the mean round time (rounds 1..R, and rounds
    1..`first`, where start-up work such as MLflow's import competes hardest).
    """
    means: dict[str, list[float]] = {"with": [], "without": [], "with_first": [], "without_first": []}
    for rep in range(reps):
        for name, extra in (("with", with_args), ("without", without_args)):
            times = _cli_round_times([*base, *extra], root / f"{name}-{rep}")
            means[name].append(statistics.fmean(times))
            means[f"{name}_first"].append(statistics.fmean(times[:first]))
    out = {k: statistics.median(v) for k, v in means.items()}
    out["overhead_pct"] = 100 * (out["with"] / out["without"] - 1)
    out["overhead_first_pct"] = 100 * (out["with_first"] / out["without_first"] - 1)
    out["reps"] = reps
    return out


def tracking_share(rounds: int, root: Path) -> dict[str, dict[str, float]]:
    """MLflow's cost: round wall time with the default MLflow sink vs `--no-mlflow`, 10 and 50 clients.

    FEMNIST MLP, FedAvg, fused executor, a fresh root each time (so MLflow's first-time set-up
    falls inside the run), measured from round 1 on.
    """
    out = {}
    for clients in (10, 50):
        base = [
            "--algo",
            "fedavg",
            "--task",
            "femnist",
            "--rounds",
            str(rounds),
            "--clients-per-round",
            str(clients),
            "--device",
            "cpu",
        ]
        out[f"clients_{clients}"] = component_cost(base, [], ["--no-mlflow"], 3, root / f"mlflow-{clients}")
    return out


def checkpoint_cost(rounds: int, root: Path) -> dict[str, float]:
    """The default checkpoints' cost on the demo (FedPA, examples/fedpa-femnist-demo.yaml) vs none."""
    base = [
        "--config",
        str(Path(__file__).resolve().parents[2] / "examples" / "fedpa-femnist-demo.yaml"),
        "--rounds",
        str(rounds),
        "--no-mlflow",
        "--device",
        "cpu",
    ]
    return component_cost(base, [], ["--checkpoint-every", "0"], 3, root / "checkpoints")


_PROBE = textwrap.dedent("""
    import importlib.abc, importlib.util, sys, time
    class _FirstRound(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "fedcli.engine.rounds":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module
            def exec_module(module):
                run(module)
                inner = module.train_cohort
                def train_cohort(*args, **kwargs):
                    if not getattr(train_cohort, "seen", False):
                        train_cohort.seen = True
                        print(f"FEDCLI_FIRST_ROUND {time.time()!r}", file=sys.stderr, flush=True)
                    return inner(*args, **kwargs)
                module.train_cohort = train_cohort
            spec.loader.exec_module = exec_module
            return spec
    sys.meta_path.insert(0, _FirstRound())
""")


def startup(args: list[str], root: Path) -> dict[str, float]:
    """Seconds from launching `fedcli train ARGS` to the start of its first round."""
    probe = root / "probe"
    probe.mkdir(parents=True, exist_ok=True)
    (probe / "sitecustomize.py").write_text(_PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(probe), os.environ.get("PYTHONPATH", "")])}
    command = [str(Path(sys.executable).with_name("fedcli")), "-q", "train", *args, "--root", str(root)]
    launched = time.time()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    ended = time.time()
    marks = [line.split()[1] for line in proc.stderr.splitlines() if line.startswith("FEDCLI_FIRST_ROUND")]
    if proc.returncode != 0 or not marks:
        return {"error": (proc.stderr or proc.stdout)[-1500:]}  # type: ignore[dict-item]
    return {"to_first_round_s": float(marks[0]) - launched, "total_s": ended - launched}


def _rss_mb() -> tuple[float, float]:
    """(current RSS, peak RSS since the last reset) in MB, from /proc/self/status (after a GC + trim)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # return freed heap pages, so RSS shows live memory
    except OSError:
        pass
    fields = dict(
        line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def synthetic_setup(num_clients: int, per_client: int, cohort: int, chunk: int | None, algo: str) -> Setup:
    """A FEMNIST-shaped synthetic federation (uint8 28x28, 62 classes) with the MLP, built in memory."""
    gen = torch.Generator().manual_seed(0)
    n = num_clients * per_client
    x = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=gen)
    y = torch.randint(0, 62, (n,), generator=gen)
    indices = list(np.arange(n).reshape(num_clients, per_client))
    task = Task(
        name="synthetic-emnist",
        description="",
        source="",
        offline=True,
        kind="classification",
        models=MappingProxyType({"mlp": lambda: models.MLP(784, (200, 200), 62)}),
        default_model="mlp",
        load=lambda options: None,
        prepare=FEMNIST.prepare,
    )  # type: ignore[arg-type,return-value]
    data = TaskData(x=x, y=y, client_indices=indices, client_names=[], test_x=x[:1], test_y=y[:1])
    cfg = build_config(
        overrides={
            "algorithm.name": algo,
            "train.clients_per_round": cohort,
            "train.cohort_chunk": chunk,
            "train.executor": "vmap",
            "seed": 0,
        }
    )
    torch.manual_seed(0)
    model = task.models["mlp"]()
    fed = FederatedData(x, y, indices, torch.device("cpu"))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return Setup(
        cfg,
        task,
        data,
        fed,
        model_functions(task, model, fed),
        ALGORITHMS[algo],
        make_hyperparameters(algo, {}),
        torch.device("cpu"),
        VmapBackend(),
        params,
    )


def memory(
    num_clients: int = 3400, per_client: int = 200, visits: int = 300, algo: str = "scaffold"
) -> dict[str, object]:
    """RSS vs clients visited (cohort 10) and the per-round transient for cohorts 10, 50, 50/chunk 10."""
    rss_empty = _rss_mb()[0]
    out: dict[str, object] = {"num_clients": num_clients, "examples": num_clients * per_client, "algo": algo}
    runs = []
    for cohort, chunk in ((10, None), (50, None), (50, 10)):
        setup = synthetic_setup(num_clients, per_client, cohort, chunk, algo)
        state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
        store = ClientStateStore(lambda s=setup: s.alg.init_client_state(s.init_params, s.hp))
        state_bytes = tree_nbytes(setup.alg.init_client_state(setup.init_params, setup.hp))
        base = _rss_mb()[0]
        curve, transients = [], []
        for round_idx in range(1, visits // cohort + 1):
            before = _rss_mb()[0]
            _reset_peak()
            state, _ = run_round(setup, state, store, round_idx, Timing())
            now, peak = _rss_mb()
            transients.append(peak - before)
            curve.append(
                {
                    "visited": len(store),
                    "rss_mb": now,
                    "growth_mb": now - base,
                    "store_mb": len(store) * state_bytes / 2**20,
                }
            )
        runs.append(
            {
                "cohort": cohort,
                "chunk": chunk,
                "base_rss_mb": base,
                "curve": curve[:: max(1, len(curve) // 10)],
                "final": curve[-1],
                "transient_mb_median": statistics.median(transients[1:] or transients),
                "state_mb_per_client": state_bytes / 2**20,
            }
        )
        del setup, state, store
    out["rss_before_data_mb"] = rss_empty
    out["runs"] = runs
    out["dense_store_mb"] = num_clients * runs[0]["state_mb_per_client"]
    return out


def tmpdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="fedcli-bench-"))
