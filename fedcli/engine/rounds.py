"""The round loop of one run (docs/architecture.md §2), read top to bottom.

    for r in rounds:                                     RoundLoop.run
        plan    = plan_round(r)                          cohort, batches, step keys: from (seed, r) only
        trained = train_cohort(r)                        the back end trains the cohort; nothing kept changes
        state, metrics = aggregate(r)                    drop non-finite clients, server_update, client states
        metrics += evaluate(global params)               every eval_every rounds and at the last round
        tracker.log_round(r, metrics); checkpoint if due

A stop signal is acted on at safe points only (`signals.check()`: before a round, between its
clients or chunks, right after its local training, which abandons the round), never inside
aggregation, evaluation and logging (`signals.critical()`), so a checkpoint never mixes two
rounds. Around the loop, engine/train.py runs the run's life (start, resume, signals, the
checkpoint writer, the model); engine/setup.py builds what the loop runs on.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedcli.algorithms.base import ClientOut, UploadSums, tree_nbytes
from fedcli.datasets.federated import CohortPlan
from fedcli.engine.checkpoint_writer import CheckpointWriter
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.cohort import (
    STATS_PREFIX,
    CohortInputs,
    CohortJob,
    RoundPlan,
    finite_rows,
    take_rows,
)
from fedcli.engine.evaluation import eval_sample_index, evaluate, resolve_eval_sample
from fedcli.engine.lifecycle import GracefulSignals
from fedcli.engine.machine import release_free_memory
from fedcli.engine.seeding import Stream, numpy_rngs, sample_cohort, step_keys, torch_generator
from fedcli.engine.setup import Setup
from fedcli.engine.streaming import scatter_states, stream_cohort, stream_group
from fedcli.errors import FedcliError

if TYPE_CHECKING:
    from fedcli.tracking.sinks import Tracker

log = logging.getLogger(__name__)
ProgressFn = Callable[[int, dict[str, float]], None]
EvalHook = Callable[[int, dict[str, float]], bool]  # (round, its metrics) -> stop the run (pruned)
CUMULATIVE = {
    "comm/bytes_up": "comm/cum_bytes_up",
    "comm/bytes_down": "comm/cum_bytes_down",
    "time/round_s": "time/cum_train_s",
}  # round metric -> its running total (x-axes of the curves)


class DivergenceError(FedcliError):
    """A metric became NaN or inf; the run was marked failed at that round."""


@dataclass
class Timing:
    """Seconds spent per phase, summed over the rounds of this process."""

    train: float = 0.0
    aggregate: float = 0.0
    evaluate: float = 0.0
    tracking: float = 0.0
    rounds: int = 0

    def per_round(self) -> dict[str, float]:
        n = max(self.rounds, 1)
        return {
            "train": self.train / n,
            "aggregate": self.aggregate / n,
            "evaluate": self.evaluate / n,
            "tracking": self.tracking / n,
        }


@dataclass
class Trained:
    """A round after local training, before aggregation (see `train_cohort`)."""

    cohort: np.ndarray
    plan: CohortPlan
    broadcast: Any
    outs: ClientOut
    start: float
    clients: list[tuple[int, str, float]] = field(default_factory=list)  # set by `aggregate`: per-client rows
    # BatchNorm statistics the clients carry (engine/model.py ClientStats): each client's at the start of the
    # round [C, ...], and (train.bn_stats local) whether it had stored its own before
    stats_start: dict[str, torch.Tensor] | None = None
    stats_seen: np.ndarray | None = None


def plan_round(setup: Setup, round_idx: int, on_host: bool = False) -> RoundPlan:
    """Sample the round's cohort and build its plan and step keys (on the run's device, or in
    pinned host memory with on_host, for a plan built ahead while the GPU trains)."""
    cfg = setup.cfg
    cohort = sample_cohort(
        setup.fed.num_clients, cfg.train.clients_per_round, seed=cfg.seed, round_idx=round_idx
    )
    # largest local data first (ties by id): the clients still training at local step k are then a
    # prefix of the cohort, which the fused back end uses without permuting (results do not depend on it)
    cohort = cohort[np.argsort(-setup.fed.sizes[cohort], kind="stable")]
    rngs = numpy_rngs(cfg.seed, Stream.BATCH_ORDER, round_idx, cohort)
    plan = setup.fed.plan(
        cohort, num_epochs=setup.opt.local_epochs, batch_size=cfg.train.batch_size, rngs=rngs, on_host=on_host
    )
    keys = step_keys(cfg.seed, round_idx, cohort, plan.num_epochs * plan.steps_per_epoch)
    if on_host and setup.device.type == "cuda":
        keys = keys.pin_memory()
    return RoundPlan(cohort, plan, keys if on_host else keys.to(setup.device))


@functools.cache
def prefetcher() -> ThreadPoolExecutor:
    """The one background thread that builds the disk store's next plan (reads its cohort's examples),
    started on first use."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedcli-prefetch")


def prefetched(setup: Setup, round_idx: int) -> RoundPlan | None:
    """The plan built ahead for this round (a Future's result on the disk store), if any."""
    ahead: Any = setup.prefetched.pop(round_idx, None)
    return ahead.result() if isinstance(ahead, Future) else ahead


def draw_noise(
    setup: Setup, params: dict[str, torch.Tensor], cohort: np.ndarray, round_idx: int, num_steps: int
) -> dict[str, torch.Tensor]:
    """Pre-draw each client's N(0, 1) noise from its own stream (shapes lead with S steps)."""
    if setup.alg.noise_shapes is None:
        return {}
    shapes = setup.alg.noise_shapes(params, setup.hp, num_steps)
    out: dict[str, torch.Tensor] = {}
    for slot, (name, shape) in enumerate(sorted(shapes.items()), start=1):
        draws = [
            torch.randn(
                shape, generator=torch_generator(setup.cfg.seed, Stream.NOISE, round_idx, int(c), slot)
            )
            for c in cohort
        ]
        out[name] = torch.stack(draws).to(setup.device)
    return out


def overlaps_host_work(device: torch.device) -> bool:
    """True where a back end returns while the device still trains (CUDA launches are
    asynchronous): train_cohort then builds the next round's plan before it waits."""
    return device.type == "cuda"


def train_cohort(
    setup: Setup,
    state: Any,
    store: ClientStateStore,
    round_idx: int,
    interrupt: Callable[[], None] | None = None,
) -> Trained:
    """Sample the round's cohort and run its local training (no state changes: interruptible).

    `interrupt` (GracefulSignals.check) is called between the clients (`loop`) or cohort chunks
    (`--cohort-chunk`) of the round and raises there when the run was asked to stop. On a GPU
    the next round's cohort, plan and step keys (numpy shuffles, seed derivation: a few ms of
    host time at 100 clients) are built while the device trains this round, before the
    synchronisation that ends it, and copied to the device without blocking when their round comes.
    """
    cfg, alg, hp = setup.cfg, setup.alg, setup.hp
    start = time.perf_counter()
    planned = prefetched(setup, round_idx) or plan_round(setup, round_idx)
    cohort, plan = planned.cohort, planned.plan.to(setup.device)
    fns = (
        setup.fns if plan.data is None else replace(setup.fns, data=plan.data)
    )  # disk store: the cohort's examples
    ahead = None
    if (
        setup.fed.prefetches and round_idx < cfg.train.rounds
    ):  # disk store: read the next cohort while this one trains
        ahead = prefetcher().submit(plan_round, setup, round_idx + 1, setup.device.type == "cuda")
    bc = alg.broadcast(state, hp)
    params, steps = alg.global_params(state), plan.num_epochs * plan.steps_per_epoch
    group = stream_group(setup, store, params, len(cohort), steps)  # None: the whole cohort's inputs at once
    carried = (
        setup.fns.client_stats
    )  # BatchNorm statistics the clients carry: the global ones, or (local) its own
    seen = (
        None
        if carried is None or carried.store is None
        else np.array([int(c) in carried.store for c in cohort])
    )
    start_stats = None if carried is None else carried.start(cohort, setup.device)
    inputs = CohortInputs(
        plan=plan,
        keys=planned.keys.to(setup.device, non_blocking=True),
        noise={} if group else draw_noise(setup, params, cohort, round_idx, steps),
        states=None if group else store.gather(cohort, setup.device),
        buffers=start_stats,
    )
    job = CohortJob(alg, fns, bc, inputs, hp, setup.opt, round_idx, cfg.train.cohort_chunk, interrupt)
    upload_sums = alg.upload_sums
    reduce = (
        None if upload_sums is None else (lambda up, w: upload_sums(up, w, bc, hp))
    )  # uploads summed per group
    outs = (
        setup.backend.run(job)
        if group is None
        else stream_cohort(  # a group's noise and states at a time
            job,
            setup.backend.run,
            group,
            lambda rows: draw_noise(setup, params, cohort[rows], round_idx, steps),
            lambda rows: store.gather(cohort[rows], setup.device),
            store.folder if store.on_disk else None,
            reduce,
        )
    )
    setup.prefetched.clear()
    if ahead is not None:
        setup.prefetched[round_idx + 1] = ahead  # type: ignore[assignment]  # a Future of the RoundPlan
    elif overlaps_host_work(setup.device) and round_idx < cfg.train.rounds:
        setup.prefetched[round_idx + 1] = plan_round(setup, round_idx + 1, on_host=True)
    _sync(setup.device)
    return Trained(cohort, plan, bc, outs, start, stats_start=start_stats, stats_seen=seen)


def aggregate(
    setup: Setup, state: Any, store: ClientStateStore, trained: Trained, round_idx: int, timing: Timing
) -> tuple[Any, dict[str, float]]:
    """Drop clients whose upload is not finite, aggregate, store client states. Returns (state, metrics).

    A client whose upload holds NaN/inf is left out of this round as if it had not been
    sampled (its state is not updated) and counted in `client/dropped_nonfinite`; if every
    client of the cohort is non-finite the run has diverged. The kept clients' BatchNorm
    statistics (train.bn_stats aggregate) become the global ones: their example-weighted mean
    (engine/model.py aggregate_stats).
    """
    alg, hp, opt = setup.alg, setup.hp, setup.opt
    cohort, plan, outs = trained.cohort, trained.plan, trained.outs
    trained_at = time.perf_counter()
    weights = plan.num_examples
    sums = outs.upload if isinstance(outs.upload, UploadSums) else None  # reduced per group (upload_sums)
    finite = sums.finite if sums is not None else finite_rows(outs.upload, len(cohort))
    dropped = int((~finite).sum())
    if dropped == len(cohort):
        raise DivergenceError(
            f"run diverged at round {round_idx}: every client's upload is NaN/inf; "
            "lower --client-lr. The run is marked failed."
        )
    stats_start, stats_seen = trained.stats_start, trained.stats_seen
    if dropped:
        keep = torch.nonzero(torch.as_tensor(finite)).flatten()
        outs = take_rows(outs, keep)
        weights, cohort = weights[keep.to(weights.device)], cohort[finite]
        stats_start = None if stats_start is None else take_rows(stats_start, keep)
        stats_seen = None if stats_seen is None else stats_seen[finite]
    stats = {k[len(STATS_PREFIX) :]: v for k, v in outs.metrics.items() if k.startswith(STATS_PREFIX)}
    if stats:
        outs = outs._replace(
            metrics={k: v for k, v in outs.metrics.items() if not k.startswith(STATS_PREFIX)}
        )
    state, diagnostics = alg.server_update(state, outs, weights, hp, opt)
    if stats and setup.fns.client_stats is not None and stats_start is not None:
        setup.fns.client_stats.update(cohort, stats_seen, stats_start, stats, weights)
    scatter_states(store, cohort, outs.state)
    _sync(setup.device)
    timing.train += trained_at - trained.start
    timing.aggregate += time.perf_counter() - trained_at
    share = weights / weights.sum()
    up = (
        sums.nbytes
        if sums is not None
        else alg.upload_nbytes(trained.outs.upload)
        if alg.upload_nbytes
        else tree_nbytes(trained.outs.upload)
    )
    up += sum(
        v.numel() * v.element_size() for k, v in trained.outs.metrics.items() if k.startswith(STATS_PREFIX)
    )
    down = alg.download_nbytes(trained.broadcast) if alg.download_nbytes else tree_nbytes(trained.broadcast)
    if setup.fns.client_stats is not None:  # the global BatchNorm statistics go down with the broadcast
        down += sum(v.numel() * v.element_size() for v in setup.fns.client_stats.current.values())
    # every number the round logs crosses to the host in one copy (one sync on a GPU)
    means = {f"client/{k}": (v.to(share.dtype) * share).sum() for k, v in outs.metrics.items()}
    columns = {("train/loss" if k == "train_loss" else f"client/{k}"): v for k, v in outs.metrics.items()}
    columns["client/num_examples"] = weights
    host = to_host({**means, **diagnostics, "comm/bytes_up": up}, columns)
    metrics = {k: host[k][0] for k in means}
    metrics["train/loss"] = metrics.pop("client/train_loss", float("nan"))
    metrics.update({k: host[k][0] for k in diagnostics})
    metrics["comm/bytes_up"] = host["comm/bytes_up"][0]
    metrics["comm/bytes_down"] = float(down) * len(trained.cohort)
    metrics["client/dropped_nonfinite"] = float(dropped)
    trained.clients = [
        (int(c), key, float(host[("column", key)][i])) for key in columns for i, c in enumerate(cohort)
    ]
    return state, metrics


def to_host(scalars: dict[str, Any], columns: dict[str, torch.Tensor]) -> dict[Any, list[float]]:
    """Python floats of scalar tensors (or numbers) and of per-client columns, copied to the host
    in one transfer: {name: [value]} and {("column", name): [value per client]}."""
    names: list[Any] = [*scalars, *(("column", k) for k in columns)]
    parts = [*scalars.values(), *columns.values()]
    flat = [
        p.detach().reshape(-1).to(torch.float64)
        if isinstance(p, torch.Tensor)
        else torch.tensor([float(p)], dtype=torch.float64)
        for p in parts
    ]
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(flat):
        by_device.setdefault(t.device, []).append(i)
    out: dict[Any, list[float]] = {}
    for rows in by_device.values():  # one copy per device the values live on
        values = torch.cat([flat[i] for i in rows]).cpu().tolist()
        start = 0
        for i in rows:
            out[names[i]] = values[start : start + flat[i].numel()]
            start += flat[i].numel()
    return out


def run_round(
    setup: Setup, state: Any, store: ClientStateStore, round_idx: int, timing: Timing
) -> tuple[Any, dict[str, float]]:
    """One communication round: sample, train clients, aggregate. Returns (state, metrics)."""
    return aggregate(setup, state, store, train_cohort(setup, state, store, round_idx), round_idx, timing)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class RoundLoop:
    """The rounds of one run and what an orderly stop needs: the last completed state."""

    setup: Setup
    tracker: Tracker
    store: ClientStateStore
    writer: CheckpointWriter
    state: Any
    completed: int  # last round whose state, client states and metrics are all in place
    timing: Timing
    cumulative: dict[str, float]  # comm/cum_bytes_* totals up to `completed`
    # a sweep's pruning hook (fedcli.sweep.search.make_on_eval): called after each evaluation round is
    # logged; True stops the run after that round (RoundLoop.pruned_at; docs/sweeps.md, "Pruning")
    on_eval: EvalHook | None = None
    pruned_at: int | None = None

    def run(self, signals: GracefulSignals, progress: ProgressFn | None) -> dict[str, float]:
        """Train the remaining rounds; a stop signal raises RunInterrupted at the next `signals.check()`."""
        cfg, setup = self.setup.cfg, self.setup
        metrics: dict[str, float] = {}
        signals.check()  # a signal while the run started (store, MLflow's set-up, checkpoint read)
        if self.completed == 0:
            with signals.critical():
                metrics = self._evaluate(self.state)
                self._check_finite(0, metrics)  # a model whose output is NaN before any training
                self._log(0, metrics, [], progress)
        for round_idx in range(self.completed + 1, cfg.train.rounds + 1):
            signals.check()
            trained = train_cohort(setup, self.state, self.store, round_idx, interrupt=signals.check)
            signals.check()  # the round's local training is abandoned: it changed no kept state
            with signals.critical():  # aggregation, evaluation and logging finish together
                state, metrics = aggregate(setup, self.state, self.store, trained, round_idx, self.timing)
                started, clients = trained.start, trained.clients
                del trained  # the cohort's uploads: not held through evaluation and the next round
                release_free_memory()  # the round's freed client states and uploads, off the C heap
                if round_idx % cfg.train.eval_every == 0 or round_idx == cfg.train.rounds:
                    eval_start = time.perf_counter()
                    metrics.update(self._evaluate(state))
                    self.timing.evaluate += time.perf_counter() - eval_start
                round_s = time.perf_counter() - started
                metrics["time/round_s"] = round_s
                for key, total in CUMULATIVE.items():
                    metrics[total] = self.cumulative.get(total, 0.0) + metrics[key]
                self.timing.rounds += 1
                self._check_finite(round_idx, metrics)
                self._log(round_idx, metrics, clients, progress)
                self.state, self.completed = state, round_idx
                self.cumulative = {v: metrics[v] for v in CUMULATIVE.values()}
                if self.writer.due(round_idx, round_s) or round_idx == cfg.train.rounds:
                    self.checkpoint()
                if (
                    self.on_eval is not None
                    and round_idx % cfg.train.eval_every == 0
                    and round_idx < cfg.train.rounds
                    and self.on_eval(round_idx, metrics)
                ):
                    self.pruned_at = round_idx
                    if self.writer.last_round != round_idx:
                        self.checkpoint()
                    break
        self.writer.wait()
        return metrics

    def checkpoint(self) -> None:
        """Snapshot the last completed round; the writer saves it on its own thread."""
        cfg, carried = self.setup.cfg, self.setup.fns.client_stats
        self.writer.submit(
            self.completed,
            self.state,
            self.store.take_changes(self.completed),
            cfg.to_dict(),
            cfg.seed,
            buffers=None if carried is None else carried.snapshot(),
        )

    def save_on_exit(self) -> None:
        """Checkpoint the last completed round if it is not yet (an orderly stop loses no finished round)."""
        try:
            self.writer.wait()
            if self.completed > 0 and self.writer.last_round != self.completed:
                self.checkpoint()
                self.writer.wait()
        except Exception as err:  # the stop goes on; the run resumes from an older checkpoint
            log.warning("could not checkpoint round %d on the way out: %s", self.completed, err)

    def _evaluate(self, state: Any) -> dict[str, float]:
        setup = self.setup
        sample = resolve_eval_sample(
            setup.cfg.train.eval_sample, setup.task.name
        )  # --eval-sample: a fixed sample
        return evaluate(
            setup.task,
            setup.fns,
            setup.alg.global_params(state),
            setup.data.test_x,
            setup.data.test_y,
            setup.data.optimum,
            index=eval_sample_index(len(setup.data.test_y), sample),
        )

    def _log(
        self,
        round_idx: int,
        metrics: dict[str, float],
        clients: list[tuple[int, str, float]],
        progress: ProgressFn | None,
    ) -> None:
        start = time.perf_counter()
        self.tracker.log_round(round_idx, metrics, clients)
        self.timing.tracking += time.perf_counter() - start
        log.info(
            "round %d  %s",
            round_idx,
            "  ".join(
                f"{k}={v:.4g}" for k, v in sorted(metrics.items()) if k.startswith(("eval/", "train/"))
            ),
        )
        if progress is not None:
            progress(round_idx, metrics)

    def _check_finite(self, round_idx: int, metrics: dict[str, float]) -> None:
        bad = sorted(k for k, v in metrics.items() if not np.isfinite(v))
        if bad:
            self.tracker.finish(
                "failed",
                reason=f"non-finite {', '.join(bad)} at round {round_idx}",
                diverged_at_round=round_idx,
            )
            fix = (
                " for the initial model, before any training; check the model's forward pass, its initialisation "
                "and the data"
                if round_idx == 0
                else "; lower --client-lr / --server-lr"
            )
            raise DivergenceError(
                f"run diverged at round {round_idx}: {', '.join(bad)} not finite{fix}. "
                "The run is marked failed."
            )
