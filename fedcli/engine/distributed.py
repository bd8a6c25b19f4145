"""One run over K processes with torch.distributed: joining the group, and the channel (docs/scaling.md).

    torchrun --nproc-per-node K -m fedcli train ... --executor distributed

The `distributed` back end (engine/backends/distributed.py) is the `process` back end with
torch.distributed in place of pipes and shared memory, so that the K processes may sit on
several hosts (torchrun's rendezvous). This module joins the process group, places each rank
(its GPU, its share of the host's cores) and carries the messages (`Peers`); the back end
splits the cohort and serves the other ranks:

- Rank 0 is the run: it samples the cohort, plans every client's batches, draws keys and
  noise, holds every client's state, aggregates, evaluates, tracks (SQL store, MLflow mirror)
  and checkpoints, exactly as a single-process run does. Ranks 1..K-1 only train clients;
  they never open a store, start the MLflow mirror or print.
- Per round, the cohort is split into K slices of near-equal local steps (`split_cohort` or
  `balanced_groups`, as `process` does); rank r trains slice r with an in-process back end
  (fused / vmap / loop). Two collectives per round: a scatter from rank 0 (the
  round's broadcast, what the algorithm sends every client, and rank r's slice of the
  CohortInputs: plan rows, step keys, noise and client states) and a gather to rank 0 (each
  slice's ClientOut: uploads, new client states, local metrics). Rank 0 aggregates.
- Client state lives on rank 0 only and travels with the work: the cohort is resampled every
  round, so a client lands on any rank, and rank 0 already holds what a state depends on.
  Replicating every state on every rank would cost each rank N x state memory and an
  all-gather of the cohort's new states per round; here a rank receives and returns the
  states of its own slice only (C/K per round), and checkpoints and `--resume` are those of a
  single-process run (a distributed run resumes in one process and vice versa).
- The same inputs reach the same client code as in one process, so results equal the
  single-process run's to float tolerance for every algorithm (tests/engine/test_distributed.py).

Transport: each message is serialised with torch.save (tensors of any device) and sent by
torch.distributed's object collectives; the receiver maps the tensors to its own device. On
a CPU host the group is Gloo. On a CUDA host it is `cpu:gloo,cuda:nccl`, one GPU per rank
(LOCAL_RANK): torch routes object collectives over the CPU backend, so the per-round messages
are staged in host memory and go over Gloo there too (timeouts and a lost rank then raise a
catchable error, where NCCL's watchdog would abort the process); NCCL serves device
collectives. The CUDA path could not be run where this was written (no GPU): it is coded,
not tested.

Failures: the group has a timeout (TIMEOUT_S); Gloo notices a process that died at once
(its socket closes). A lost rank ends the run on rank 0 with one line (`RankLost`); the
run is marked failed and its newest checkpoint resumes it. An error on another rank is
reported by rank 0 with that rank's traceback (`RankError`).

Deviation from docs/style.md rules 9 and 18: the process group is torch.distributed's
process-wide default group (torch's design), and `join` reads torchrun's launch variables
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) here, as torch's own `env://` rendezvous
does; they say where this process runs, not how the run is configured.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import logging
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fedcli.engine.machine import available_cores
from fedcli.errors import ConfigError, FedcliError

if TYPE_CHECKING:
    from fedcli.config.sections import RunConfig

log = logging.getLogger(__name__)

TIMEOUT_S = 1800.0  # a collective waits this long for a rank that hangs (a dead one is noticed at once)
LAUNCH = "torchrun --nproc-per-node K -m fedcli train ... --executor distributed"
NOT_LAUNCHED = (
    f"--executor distributed runs one process per rank under torchrun; launch it with `{LAUNCH}` "
    "(across hosts add --nnodes and --rdzv-endpoint), or pick another --executor."
)


class RankLost(FedcliError):
    """Another rank of the run stopped answering (it died, hangs, or its host is gone)."""


class RankError(FedcliError):
    """Another rank failed to build the run or to train its slice; the message carries its traceback."""


class Peers:
    """This process's place in the run's process group and the channel to the other ranks.

    Made by `join`. Rank 0 `post`s one message per rank and `collect`s their replies; the
    other ranks `receive` and `reply`. Every failure of a collective marks the group `lost`
    and raises RankLost.
    """

    def __init__(self, rank: int, world_size: int, local_rank: int, local_world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.local_rank, self.local_world_size = local_rank, local_world_size
        self.lost = False
        self.stopped = False

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def post(self, messages: list[Any], during: str) -> None:
        """Rank 0: send messages[r] to rank r (messages[0] is ignored)."""
        if self.world_size == 1:
            return
        payload = [b""] + [_dump(m) for m in messages[1:]]
        self._guard(lambda: dist.scatter_object_list([None], payload, src=0), during)

    def collect(self, device: torch.device, during: str) -> list[Any]:
        """Rank 0: every other rank's reply, in rank order (index 0 is None)."""
        if self.world_size == 1:
            return [None]
        gathered: list[Any] = [None] * self.world_size
        self._guard(lambda: dist.gather_object(None, gathered, dst=0), during)
        return [None] + [_load(b, device) for b in gathered[1:]]

    def receive(self, device: torch.device) -> Any:
        """Ranks 1..K-1: the next message from rank 0, its tensors on `device`."""
        box: list[Any] = [None]
        self._guard(lambda: dist.scatter_object_list(box, None, src=0), "while waiting for work")
        return _load(box[0], device)

    def reply(self, message: Any) -> None:
        """Ranks 1..K-1: send rank 0 this round's reply."""
        data = _dump(message)
        self._guard(lambda: dist.gather_object(data, None, dst=0), "while replying")

    def stop(self) -> None:
        """Rank 0: tell the other ranks the run is over (idempotent; nothing to tell a lost group)."""
        if not self.is_leader or self.stopped or self.lost:
            return
        self.stopped = True
        try:
            self.post([("stop",)] * self.world_size, "stopping")
        except RankLost as err:
            log.warning("%s", err)

    def _guard(self, collective: Callable[[], Any], during: str) -> None:
        try:
            collective()
        except (
            RuntimeError
        ) as err:  # DistBackendError, DistNetworkError: a peer died, hangs or is unreachable
            self.lost = True
            who = "rank 0" if not self.is_leader else f"another of the {self.world_size} ranks"
            raise RankLost(
                f"lost contact with {who} {during} ({_first_line(err)}); every rank stops."
            ) from None


def lost_hint(lost: RankLost, run_id: str | None, world_size: int, store_options: str = "") -> RankLost:
    """The RankLost of rank 0 with what became of the run and the commands that continue it."""
    if not run_id:
        return lost
    resume = f"train --resume {run_id[:8]}{store_options}"
    return RankLost(
        f"{lost} Run {run_id[:8]} is marked failed; continue it from its newest checkpoint with "
        f"`torchrun --nproc-per-node {world_size} -m fedcli {resume} --executor distributed` "
        f"(or in one process: `fedcli {resume} --executor auto`)."
    )


def _first_line(err: BaseException) -> str:
    text = str(err).split("\n", 1)[0]
    text = text.split("] ", 1)[-1] if text.startswith("[") else text  # gloo's "[file.cc:123] " prefix
    return text.split(". ", 1)[0][:160]


def _dump(message: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(message, buffer)
    return buffer.getvalue()


def _load(data: bytes | None, device: torch.device) -> Any:
    if data is None:
        return None
    return torch.load(io.BytesIO(data), map_location=device, weights_only=False)  # from our own ranks


# ----------------------------------------------------------------------------- joining the group


def launch_env() -> tuple[int, int, int, int] | None:
    """(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) as torchrun sets them; None outside torchrun."""
    env = os.environ
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank, local_world = int(env.get("LOCAL_RANK", rank)), int(env.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        raise ConfigError(
            f"RANK, WORLD_SIZE, LOCAL_RANK must be integers; got RANK={env['RANK']!r}, "
            f"WORLD_SIZE={env['WORLD_SIZE']!r}. {NOT_LAUNCHED}"
        ) from None
    return rank, world, local_rank, local_world


def join(timeout_s: float = TIMEOUT_S) -> Peers:
    """Join the run's process group (env:// rendezvous: torchrun's variables) and return this rank's Peers.

    On a CUDA host each rank takes the GPU of its LOCAL_RANK (where the host has that many).

    Raises:
        ConfigError: not launched by torchrun (no RANK / WORLD_SIZE), or no MASTER_ADDR/PORT.
        RankLost: the rendezvous did not complete within `timeout_s`.
    """
    env = launch_env()
    if env is None:
        raise ConfigError(NOT_LAUNCHED)
    rank, world, local_rank, local_world = env
    cuda = torch.cuda.is_available()
    if cuda and local_rank < torch.cuda.device_count():
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        _import_what_binds_the_group()
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        except ValueError as err:  # env:// without MASTER_ADDR / MASTER_PORT
            raise ConfigError(f"{_first_line(err)}. {NOT_LAUNCHED}") from None
        except RuntimeError as err:
            raise RankLost(
                f"rank {rank} could not join the {world} ranks within {timeout_s:.0f} s "
                f"({_first_line(err)}); check that every rank was started with the same "
                "MASTER_ADDR / --rdzv-endpoint."
            ) from None
    log.debug("rank %d of %d joined (local rank %d)", rank, world, local_rank)
    return Peers(rank, world, local_rank, local_world)


def _import_what_binds_the_group() -> None:
    """Import, before the group exists, the torch modules that bind `group.WORLD` when imported.

    torch.distributed.nn.functional (and others) take `group=group.WORLD` as a default argument,
    which Python evaluates at import. Imported after `init_process_group` (torch.func.grad imports
    torch._dynamo, which imports them, at a run's first local step), they keep the live group
    alive: `destroy_process_group` then cannot free it, Gloo's worker threads outlive it, and
    the group is destroyed during interpreter shutdown, where it aborted rank 0 about one run in
    four ("terminate called without an active exception" after the run had finished). Imported
    first, they bind None.
    """
    import torch._dynamo  # noqa: F401 - what torch.func.grad imports lazily
    import torch.distributed.nn.functional  # noqa: F401 - binds group.WORLD in ten defaults


@contextlib.contextmanager
def process_group(timeout_s: float = TIMEOUT_S) -> Iterator[Peers]:
    """Join, yield this rank's Peers; on the way out rank 0 stops the others, and the group is left."""
    peers = join(timeout_s)
    try:
        yield peers
    finally:
        peers.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


def placement(cfg: RunConfig, device: torch.device, peers: Peers | None) -> tuple[torch.device, int]:
    """This rank's device and intra-op threads: its LOCAL_RANK's GPU, its share of the host's cores.

    Without peers (`fedcli evaluate` or `report` rebuilding a distributed run) the process's own.

    Raises:
        ConfigError: an explicit cuda:N, or more ranks on this host than GPUs.
    """
    if peers is None:
        return device, cfg.train.threads or available_cores()
    threads = cfg.train.threads or max(1, available_cores() // peers.local_world_size)
    if device.type != "cuda":
        return device, threads
    if cfg.train.device.startswith("cuda:"):
        raise ConfigError(
            f"train.device={cfg.train.device!r} with --executor distributed: each rank takes the GPU "
            "of its LOCAL_RANK; use --device cuda (or auto)."
        )
    if peers.local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"LOCAL_RANK={peers.local_rank} but this host has {torch.cuda.device_count()} GPU(s); "
            "start at most one rank per GPU (--nproc-per-node), or use --device cpu."
        )
    return torch.device("cuda", peers.local_rank), threads
