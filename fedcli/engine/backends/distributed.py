"""`distributed`: one run over torchrun's ranks; rank 0 runs the round loop (docs/scaling.md).

Each round rank 0 splits the cohort into one slice per rank (`split_cohort` for a vmapped
inner back end, whose cost is padded steps; `balanced_groups` otherwise, whose cost is steps),
sends every other rank its slice in one scatter (engine/distributed.py, `Peers`), trains its
own slice, and gathers the others' ClientOuts in one gather. The other ranks `serve`: they
build the run rank 0 announces, as rank 0 did, and run the same in-process back end on each
slice they receive. Never chosen by `auto`: it needs `torchrun ... --executor distributed`.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import torch

from fedcli.algorithms.base import Algorithm, ClientOut, OptimConfig
from fedcli.engine.backends import BackendInfo, BackendSetup, CohortBackend, Workload
from fedcli.engine.backends.inprocess import IN_PROCESS
from fedcli.engine.cohort import CohortJob, balanced_groups, merge_outs, split_cohort, take_clients
from fedcli.engine.distributed import Peers, RankError, RankLost
from fedcli.engine.model import ModelFunctions


class DistributedBackend:
    """Rank 0's back end: trains the cohort on every rank of the group (see the module doc).

    The other ranks learn the run's config with the first round (they then build it, as
    rank 0 did) and are stopped by `Peers.stop` when the process group is left.
    """

    def __init__(self, setup: BackendSetup) -> None:
        assert setup.peers is not None and setup.inner is not None, "engine/select.py checks both"
        self.cfg, self.inner_name, self.peers = setup.cfg, setup.inner, setup.peers
        self.inner = IN_PROCESS[setup.inner].build(setup)  # this rank's own slice (and a serving rank's)
        self.processes = self.peers.world_size  # recorded as train.workers
        self.name = "distributed + compile" if setup.cfg.train.compile else "distributed"
        self.bound = False

    def run(self, job: CohortJob) -> ClientOut:
        inputs, round_idx = job.inputs, job.round_idx
        split = split_cohort if self.inner_name == "vmap" else balanced_groups  # padded cost vs sum of steps
        groups = split(inputs.plan.steps_per_client, self.processes)
        during = f"in round {round_idx}"
        if not self.bound:
            self.peers.post([("config", self.cfg, self.inner_name)] * self.processes, during)
            self.bound = True
        work = [
            ("work", job.broadcast, take_clients(inputs, rows), round_idx, job.chunk_size)
            for rows in groups[1:]
        ]
        self.peers.post([None, *work] + [("idle",)] * (self.processes - len(groups)), during)
        device = inputs.keys.device
        try:
            own = self.inner.run(replace(job, inputs=take_clients(inputs, groups[0])))
        except BaseException:  # an error, or a signal that abandons the round (rounds.py): first take the
            with contextlib.suppress(RankLost):  # replies, so that the next collective (stop) is in step
                self.peers.collect(device, during)
            raise
        replies = self.peers.collect(device, during)[1 : len(groups)]
        for rank, (status, value) in enumerate(replies, start=1):
            if status != "ok":
                raise RankError(f"rank {rank} failed {during}:\n{value}")
        return merge_outs(groups, [own] + [value for _, value in replies])

    def close(self) -> None:
        """Nothing to stop here: the ranks outlive a run (`process_group` stops them)."""


class ServedRun(Protocol):
    """What a serving rank needs of the run it builds (engine/setup.py's Setup)."""

    alg: Algorithm
    fns: ModelFunctions
    hp: Any
    opt: OptimConfig
    device: torch.device
    backend: CohortBackend


def serve(peers: Peers, build: Callable[..., ServedRun]) -> None:
    """Ranks 1..K-1: build each run rank 0 announces (`build(cfg, peers=peers)`) and train its slices
    until rank 0 says stop."""
    # Ctrl-C, and the SIGTERM torchrun forwards to every rank, are rank 0's: it stops the run in order, then us
    on_main = threading.current_thread() is threading.main_thread()  # signal handlers: main thread only
    previous = {
        signum: signal.signal(signum, signal.SIG_IGN)
        for signum in ((signal.SIGINT, signal.SIGTERM, signal.SIGHUP) if on_main else ())
    }
    try:
        _serve(peers, build)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _serve(peers: Peers, build: Callable[..., ServedRun]) -> None:
    """Answer rank 0's messages: config (build the run), work (train the slice), idle, stop."""
    run: ServedRun | None = None
    inner: CohortBackend | None = None
    failure = "the run's config never arrived"
    while True:
        message = peers.receive(run.device if run is not None else torch.device("cpu"))
        kind = message[0]
        if kind == "stop":
            return
        if kind == "config":
            run, inner, failure = None, None, ""
            try:
                run = build(message[1], peers=peers)
                backend = run.backend
                assert isinstance(backend, DistributedBackend) and backend.inner_name == message[2], (
                    "every rank chooses the same back end for the same config"
                )
                inner = backend.inner
            except Exception:  # noqa: BLE001 - reported to rank 0 with the first round's reply
                failure = f"could not build the run on rank {peers.rank}:\n{traceback.format_exc()}"
            continue
        if kind == "idle":
            peers.reply(("idle", None))
            continue
        if run is None or inner is None:
            peers.reply(("error", failure))
            continue
        _, broadcast, inputs, round_idx, chunk_size = message
        try:
            out = inner.run(
                CohortJob(run.alg, run.fns, broadcast, inputs, run.hp, run.opt, round_idx, chunk_size)
            )
            reply: tuple[str, Any] = ("ok", out)
        except Exception:  # noqa: BLE001 - reported to rank 0, which raises RankError
            reply = ("error", traceback.format_exc())
        peers.reply(reply)


def refuses(w: Workload) -> str | None:
    """Every workload a rank's in-process back end can run (engine/select.py checks the launch)."""
    return None


INFO = BackendInfo(
    name="distributed",
    summary="one run over torchrun's ranks: rank 0 runs the round loop; one scatter "
    "and one gather per round, an in-process back end inside each rank",
    refuses=refuses,
    prefers=None,
    build=DistributedBackend,
)
