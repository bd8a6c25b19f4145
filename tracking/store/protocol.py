"""`RunStore`: what a run's process needs of the results store.

The engine (fedcli/engine/train.py, lifecycle.py) and the `Tracker` (tracking/sinks.py) reach the
store only through this protocol: starting or resuming a run, writing its rounds and checkpoints,
its heartbeat and its end, and the few reads a resume makes. `SqlStore` (sql_store.py) satisfies it structurally: the signatures here are copies of its own
(tests/test_layering.py compares them), and mypy checks SqlStore against it where the run layer
hands one to a `Tracker` (fedcli/runs/stores.py). The engine never imports `sql_store` or SQLAlchemy
(docs/architecture.md §6).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import pandas as pd

    from fedcli.tracking.store.records import RunRecord

__all__ = ["RunStore"]


class RunStore(Protocol):
    """What a run's process needs of the results store (`SqlStore` is one).

    Attributes:
        retry_s: How long a locked or unreachable store is retried, in seconds (a run that lost
            its store lowers it to end quickly).
    """

    retry_s: float

    def close(self) -> None: ...

    def start_run(
        self,
        *,
        experiment: str,
        run_name: str | None,
        config: Mapping[str, Any],
        algo: str,
        task: str,
        seed: int,
        tags: Mapping[str, str],
        fedcli_version: str,
        torch_version: str,
        git_commit: str | None,
        run_id: str | None = None,
        requested: Mapping[str, Any] | None = None,
        config_hash: str | None = None,
    ) -> str: ...

    def end_run(
        self, run_id: str, status: str, *, reason: str | None = None, diverged_at_round: int | None = None
    ) -> None: ...

    def mark_running(self, run_id: str) -> None: ...

    def heartbeat(self, run_id: str) -> None: ...

    def update_config(
        self, run_id: str, config: Mapping[str, Any], hash_: str, requested: Mapping[str, Any] | None = None
    ) -> None: ...

    def set_run_fields(self, run_id: str, **fields: str | int | None) -> None: ...

    def get_run(self, ref: str) -> RunRecord: ...

    def log_round(
        self,
        run_id: str,
        round_idx: int,
        metrics: Mapping[str, float],
        clients: Iterable[tuple[int, str, float]] = (),
    ) -> None: ...

    def delete_rounds_after(self, run_id: str, round_idx: int) -> int: ...

    def add_checkpoint(self, run_id: str, round_idx: int, path: str | Path) -> None: ...

    def delete_checkpoints(self, run_id: str, rounds: Sequence[int]) -> None: ...

    def checkpoints(self, run_id: str) -> list[tuple[int, str]]: ...

    def metrics_frame(self, run_ids: Sequence[str], keys: Sequence[str] | None = None) -> pd.DataFrame: ...
