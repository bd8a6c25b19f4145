"""`vmap`: the cohort as one torch.func.vmap over the padded plan (masked steps are exact no-ops).

`--cohort-chunk N` runs chunks of N similar-length clients (longest first), each padded only to
its own longest client: chunking bounds memory and also cuts the masked steps a cohort of
uneven clients would otherwise compute.
"""

from __future__ import annotations

from fedcli.algorithms.base import ClientOut
from fedcli.engine.backends import BackendInfo, InProcess, Workload
from fedcli.engine.cohort import CohortJob, in_chunks, job_client_fn, vmap_clients


class VmapBackend(InProcess):
    """The cohort vmapped in the main process; a stop signal is acted on between chunks."""

    name = "vmap"

    def run(self, job: CohortJob) -> ClientOut:
        chunked = in_chunks(job, self.run)
        if chunked is not None:
            return chunked
        return vmap_clients(job_client_fn(job), job.inputs)


def refuses(w: Workload) -> str | None:
    """Algorithms that cannot run vmapped. (BatchNorm runs per client on batch statistics, stock
    dropout and RNNs through datasets/stock_layers.py; a model whose training step the model check
    could not vmap is refused by engine/select.py.)"""
    if not w.alg.supports_vmap:
        return f"{w.alg.name} does not support --executor vmap; use --executor loop or auto."
    return None


def prefers(w: Workload) -> str | None:
    """auto, where nothing before it applies: dense models and any model on a GPU."""
    return "the whole cohort in one vmapped computation"


INFO = BackendInfo(
    name="vmap",
    summary="the cohort as one torch.func.vmap over the padded plan; --cohort-chunk N "
    "runs chunks of similar-length clients",
    refuses=refuses,
    prefers=prefers,
    build=lambda setup: VmapBackend(),
)
