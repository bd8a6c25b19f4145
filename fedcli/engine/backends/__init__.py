"""Back ends: interchangeable ways to run one round's local training (docs/architecture.md §3).

Every back end takes a `CohortJob` (engine/cohort.py) and returns the cohort's stacked
`ClientOut` in cohort order; results agree to float tolerance whichever runs
(tests/engine/test_equivalence.py). One module per back end, each exporting `INFO`, a
`BackendInfo`: its name, what it refuses (one line with the fix), auto's rule for it
(None: opt-in), and how to build it. engine/select.py holds the registry, checks the
request and picks for `auto`, logging why. This package's own module holds only the
interface, so a back end's module never imports another's except the in-process ones a
multi-process back end runs inside (process, distributed).

    loop.py         client by client, each on its own unpadded plan (the reference)
    vmap.py         the cohort as one torch.func.vmap over the padded plan
    fused.py        dense classifiers: the cohort's declared local SGD as hand-derived stacked GEMMs
    compiled.py     vmap + --compile: the vmapped cohort compiled by torch.compile
    graphed.py      vmap + --graph: the vmapped cohort traced (CPU) or captured (CUDA) once per shape
    process.py      the cohort split over worker processes (CPU), an in-process back end inside each
    distributed.py  the cohort split over torchrun's ranks, an in-process back end inside each
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch import nn

from fedcli.algorithms.base import Algorithm, ClientOut
from fedcli.datasets.federated import FederatedData
from fedcli.datasets.tasks import Task
from fedcli.engine.cohort import CohortJob

if TYPE_CHECKING:
    from fedcli.config.sections import RunConfig
    from fedcli.engine.distributed import Peers


class CohortBackend(Protocol):
    """A way to run a round's local training. Built once per run, closed at its end."""

    @property
    def name(self) -> str:
        """As runs and summaries name it: "vmap", "vmap + graph", "loop + compile"."""
        ...

    @property
    def processes(self) -> int | None:
        """Processes the cohort is spread over (process, distributed); None: this one."""
        ...

    def run(self, job: CohortJob) -> ClientOut:
        """Train the job's cohort; the stacked ClientOut in cohort order."""
        ...

    def close(self) -> None:
        """Release what the back end holds (worker processes); idempotent."""
        ...


class InProcess:
    """What the back ends that train in this process share: no processes of their own, nothing to release."""

    processes: int | None = None

    def close(self) -> None:
        """Nothing to release (what a back end built, compiled graphs included, goes with the object)."""


@dataclass(frozen=True)
class Workload:
    """What the refusals and `auto` know before the first round."""

    alg: Algorithm
    task: Task
    model: nn.Module
    device: torch.device
    precision: str  # train.precision: fp32 | tf32 | bf16
    clients_per_round: int
    compile: bool  # train.compile
    graph: bool  # train.graph
    augment: bool = False  # data.augment crops / flips training batches (engine/cohort.py make_context)
    slots: int = (
        1  # processes the process back end would run: min(train.workers or the usable cores, the cohort)
    )
    client_bytes: int = (
        0  # one client's training step under vmap, estimated (engine/footprint.py); 0: not estimated
    )

    @property
    def has_conv(self) -> bool:
        return any(isinstance(m, nn.modules.conv._ConvNd) for m in self.model.modules())

    @property
    def has_rnn(self) -> bool:
        return any(isinstance(m, nn.RNNBase) for m in self.model.modules())

    @property
    def has_batchnorm(self) -> bool:
        return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.model.modules())


@dataclass(frozen=True)
class BackendSetup:
    """What a back end is built from (engine/setup.py makes it once per run)."""

    cfg: RunConfig
    model: nn.Module
    fed: FederatedData
    device: torch.device
    workers: int = 1  # processes for the process back end (train.workers or the cores, at most the cohort)
    inner: str | None = None  # process, distributed: the in-process back end each worker or rank runs
    peers: Peers | None = None  # distributed: this process's place in the torchrun group


class BackendInfo(NamedTuple):
    """A back end as engine/select.py sees it."""

    name: str  # the --executor value, or value + flag ("vmap + compile")
    summary: str  # what it does, one line (docs/architecture.md §3 "Back ends")
    refuses: Callable[
        [Workload], str | None
    ]  # why it cannot run this workload (one line with the fix), or None
    prefers: (
        Callable[[Workload], str | None] | None
    )  # auto's rule: why to pick it here, or None; None: opt-in
    build: Callable[[BackendSetup], CohortBackend]


def round_key(alg: Algorithm, hp: Any, round_idx: int) -> Hashable:
    """What a program built from the client update (--compile, --graph) is keyed by across rounds:
    the algorithm's declared round_key (FedPA: past burn-in or not; FOLA: the round), else one
    value for every round (the contract: tests/algorithms/test_contract.py)."""
    return None if alg.round_key is None else ("round", alg.round_key(hp, round_idx))


def keyed_every_round(alg: Algorithm, hp: Any, round_idx: int) -> bool:
    """True when the declared round key differs in rounds r, r + 1 and r + 2: a program per round."""
    keys = [round_key(alg, hp, r) for r in (round_idx, round_idx + 1, round_idx + 2)]
    return len(set(keys)) == 3
