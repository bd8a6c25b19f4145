"""Pieces shared by the commands: panels, consoles, opening the stores, the progress bar."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

if TYPE_CHECKING:
    from fedcli.config import RunConfig, TrackingConfig
    from fedcli.engine.train import RunResult
    from fedcli.tracking.sinks import Tracker
    from fedcli.tracking.store import RunRecord, SqlStore


class Scheme(str, Enum):
    """Partition schemes (fedcli.config.SCHEMES) as a CLI choice."""

    natural = "natural"
    iid = "iid"
    dirichlet = "dirichlet"
    shards = "shards"
    labels = "labels"
    quantity = "quantity"
    two_level = "two-level"


class Panel:
    """Help panels of STYLE.md rule 12."""

    DATA = "Data"
    ALGO = "Algorithm"
    TRAIN = "Training"
    TRACK = "Tracking"


def console() -> Console:
    """Console for human-facing output (stderr), so stdout carries only results."""
    return Console(stderr=True, highlight=False)


def open_store(url: str) -> SqlStore:
    """Open the SQL results store at url (creates it)."""
    from fedcli.tracking.store import SqlStore

    return SqlStore(url)


def tracking_config(overrides: Mapping[str, Any]) -> TrackingConfig:
    """Build only the tracking section from dotted overrides (for commands that read the store)."""
    from fedcli.config import TrackingConfig, build_section

    values = {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("tracking.") and v is not None}
    return build_section("tracking", TrackingConfig, values)  # type: ignore[no-any-return]


def open_tracker(cfg: TrackingConfig) -> Tracker:
    """Open the SQL store and, unless --no-mlflow, the MLflow sink of one run."""
    from fedcli.tracking.sinks import BackgroundMlflow, Tracker

    store = open_store(cfg.store_url)
    # MLflow opens on a background thread: its import and store migrations overlap the data
    # loading and the first rounds instead of delaying them (issue 7, start-up).
    return Tracker(store, BackgroundMlflow(cfg.mlflow_uri, cfg.experiment) if cfg.use_mlflow else None)


def find_run(ref: str, overrides: Mapping[str, Any]) -> RunRecord:
    """Look a run up by id, name or unique id prefix in the configured store."""
    return open_store(tracking_config(overrides).store_url).get_run(ref)


ProgressFn = Callable[[int, dict[str, float]], None]


@contextmanager
def train_progress(cfg: RunConfig, quiet: bool = False) -> Iterator[ProgressFn | None]:
    """A rich progress bar over rounds with the live round metrics (stderr).

    While the bar is shown the engine's per-round INFO lines are held back (the bar shows
    the same numbers); `-v` still prints them.
    """
    if quiet:
        yield None
        return
    import logging

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    engine_log = logging.getLogger("fedcli.engine.train")
    previous = engine_log.level
    if logging.getLogger().level > logging.DEBUG:
        engine_log.setLevel(logging.WARNING)
    columns = (TextColumn("[bold]{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.fields[metrics]}"))
    try:
        with Progress(*columns, console=console(), transient=False) as progress:
            bar = progress.add_task(f"{cfg.algorithm.name}/{cfg.data.task}", total=cfg.train.rounds, metrics="")
            shown: dict[str, float] = {}

            def update(round_idx: int, metrics: dict[str, float]) -> None:
                shown.update({k: v for k, v in metrics.items() if k in LIVE_KEYS})
                text = "  ".join(f"{LIVE_KEYS[k]} {shown[k]:.4g}" for k in LIVE_KEYS if k in shown)
                progress.update(bar, completed=round_idx, metrics=text)

            yield update
    finally:
        engine_log.setLevel(previous)


LIVE_KEYS = {"eval/accuracy": "acc", "eval/dist_to_opt": "dist", "eval/loss": "eval_loss",
             "train/loss": "train_loss", "time/round_s": "s/round"}


def summarise_run(cfg: RunConfig, result: RunResult) -> None:
    """Print the end-of-run summary: final metrics, where the run is stored, what to run next."""
    out = console()
    metrics = result.final_metrics
    shown = [f"{k}={metrics[k]:.4f}" for k in ("eval/accuracy", "eval/loss", "eval/dist_to_opt") if k in metrics]
    split = result.timing.per_round()
    out.print(f"[bold green]run {result.run_id} finished[/] after {result.rounds_completed} rounds "
              f"in {result.wall_s:.1f}s ({result.executor} executor): " + "  ".join(shown))
    out.print("per round: " + "  ".join(f"{k} {v * 1000:.0f} ms" for k, v in split.items()))
    out.print(f"store:   {cfg.tracking.store_url}")
    if result.model_path:
        out.print(f"model:   {result.model_path}")
    if cfg.tracking.use_mlflow:
        out.print(f"browse:  mlflow ui --backend-store-uri {shlex.quote(cfg.tracking.mlflow_uri)}   (or: fedcli ui)")
    store_opt = "" if cfg.tracking.store is None else f" --store {shlex.quote(cfg.tracking.store)}"
    out.print(f"report:  fedcli report --runs {result.run_id[:8]}{store_opt} --output report.md")


def stdout_is_terminal() -> bool:
    return sys.stdout.isatty()


def resolve(path: Path | None) -> str | None:
    return None if path is None else str(path.resolve())
