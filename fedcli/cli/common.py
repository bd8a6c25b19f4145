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


def open_store(url: str, must_exist: bool = False) -> SqlStore:
    """Open the SQL results store at url (creates it, unless `must_exist`: then a missing file is an error)."""
    from fedcli.errors import ConfigError
    from fedcli.tracking.mirror import sqlite_path
    from fedcli.tracking.store import SqlStore

    path = sqlite_path(url)
    if must_exist and path is not None and not path.exists():
        raise ConfigError(f"no results store at {path}; pass --root or --store of the folder your runs are in "
                          "(`fedcli train` creates it).")
    return SqlStore(url)


def tracking_config(overrides: Mapping[str, Any]) -> TrackingConfig:
    """Build only the tracking section from dotted overrides (for commands that read the store)."""
    from fedcli.config import TrackingConfig, build_section

    values = {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("tracking.") and v is not None}
    return build_section("tracking", TrackingConfig, values)  # type: ignore[no-any-return]


def open_tracker(cfg: TrackingConfig, parent_run_id: str | None = None) -> Tracker:
    """Open the SQL store and, unless --no-mlflow, the handle of the run's MLflow mirror process.

    Call it only after everything the command validates is validated: it creates the store.
    """
    from fedcli.tracking.mirror import MirrorHandle
    from fedcli.tracking.sinks import Tracker

    store = open_store(cfg.store_url)
    mirror = None
    if cfg.use_mlflow:
        mirror = MirrorHandle(tracking_uri=cfg.mlflow_uri, experiment=cfg.experiment, store_url=cfg.store_url,
                              runs_root=Path(cfg.root).resolve() / "runs", parent_run_id=parent_run_id)
    return Tracker(store, mirror)


def check_mlflow(cfg: TrackingConfig, optional: bool) -> TrackingConfig:
    """Check MLflow is usable before anything is written; with `optional`, drop it (and say so) instead."""
    import dataclasses
    import logging

    from fedcli.errors import ConfigError
    from fedcli.tracking.mirror import preflight

    if not cfg.use_mlflow:
        return cfg
    try:
        preflight(cfg.mlflow_uri)
    except ConfigError as err:
        if not optional:
            raise
        logging.getLogger("fedcli").warning("%s Training with the SQL store only (--mlflow-optional).", err)
        return dataclasses.replace(cfg, use_mlflow=False)
    return cfg


def find_run(ref: str, overrides: Mapping[str, Any]) -> RunRecord:
    """Look a run up by id, name, MLflow id or unique id prefix in the configured store (never creates it)."""
    return open_store(tracking_config(overrides).store_url, must_exist=True).get_run(ref)


def resume_hint(cfg: Any, run_id: str) -> str:
    """The command that continues `run_id`, with the store options it needs."""
    track = cfg.tracking
    extra = ""
    if track.store:
        extra += f" --store {shlex.quote(track.store)}"
    elif Path(track.root).resolve() != Path("fedcli-runs").resolve():
        extra += f" --root {shlex.quote(track.root)}"
    return f"fedcli train --resume {run_id[:8]}{extra}"


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
