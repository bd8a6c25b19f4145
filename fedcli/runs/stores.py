"""The stores a run writes and a command reads: the SQL store, the run's MLflow mirror, the tracker pairing them.

Both front ends open them here (fedcli/cli/*.py and fedcli/api.py, through fedcli/runs/run.py for a run).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedcli.errors import ConfigError

if TYPE_CHECKING:
    from fedcli.config.sections import TrackingConfig
    from fedcli.tracking.mlflow.handle import MirrorHandle
    from fedcli.tracking.sinks import Tracker
    from fedcli.tracking.store.records import RunRecord
    from fedcli.tracking.store.sql_store import SqlStore


def open_store(url: str, must_exist: bool = False) -> SqlStore:
    """Open the SQL results store at url (creates it, unless `must_exist`: then a missing file is an error)."""
    from fedcli.tracking.store.sql_store import SqlStore
    from fedcli.tracking.urls import sqlite_path

    path = sqlite_path(url)
    path = path and path.resolve()
    if must_exist and path is not None and not path.exists():
        raise ConfigError(
            f"no results store at {path}; pass --root or --store of the folder your runs are in "
            "(`fedcli train` creates it)."
        )
    return SqlStore(url)


def tracking_config(overrides: Mapping[str, Any]) -> TrackingConfig:
    """Build only the tracking section from dotted overrides (for commands that read the store)."""
    from fedcli.config.checks import build_section, check_blank_tracking
    from fedcli.config.sections import TrackingConfig

    values = {
        k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("tracking.") and v is not None
    }
    track: TrackingConfig = build_section("tracking", TrackingConfig, values)
    check_blank_tracking(track)  # `--store ""` read the default store
    return track


def spawn_mirror(cfg: TrackingConfig, parent_run_id: str | None = None) -> MirrorHandle | None:
    """Start the run's MLflow mirror process now (it imports MLflow, writes nothing), unless --no-mlflow."""
    from fedcli.tracking.mlflow.handle import MirrorHandle, discard_early

    if not cfg.use_mlflow:
        discard_early()  # `fedcli train` started one before it knew (tracking.use_mlflow: false in a config)
        return None
    return MirrorHandle(
        tracking_uri=cfg.mlflow_uri,
        experiment=cfg.experiment,
        store_url=cfg.store_url,
        runs_root=Path(cfg.root).resolve() / "runs",
        parent_run_id=parent_run_id,
    ).spawn()


def open_tracker(cfg: TrackingConfig, mirror: MirrorHandle | None = None) -> Tracker:
    """Open the SQL store and pair it with the run's MLflow mirror (None: --no-mlflow).

    Call it only after everything the command validates is validated: it creates the store.
    """
    from fedcli.tracking.sinks import Tracker

    if mirror is None and cfg.use_mlflow:
        mirror = spawn_mirror(cfg)
    return Tracker(open_store(cfg.store_url), mirror)


def check_mlflow(cfg: TrackingConfig, optional: bool) -> TrackingConfig:
    """Check MLflow is usable before anything is written; with `optional`, drop it (and say so) instead."""
    import dataclasses
    import logging

    from fedcli.tracking.mlflow.checks import preflight

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
