"""`fedcli sweep`: run a grid of configurations x seeds, skipping finished trials."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.table import Table

from fedcli.cli.common import Panel, console, open_store
from fedcli.cli.errors import user_errors
from fedcli.errors import ConfigError


class Backend(str, Enum):
    local = "local"
    ray = "ray"


def sweep(
    ctx: typer.Context,
    spec: Annotated[Path | None, typer.Argument(exists=True, dir_okay=False, resolve_path=True,
                                                help="Sweep spec (YAML): experiment, base, grid, seeds, report.")] = None,
    recipe: Annotated[str | None, typer.Option(help="Run a built-in recipe instead of a spec file.")] = None,
    list_recipes: Annotated[bool, typer.Option("--list-recipes", help="List the built-in recipes and exit.")] = False,
    workers: Annotated[int, typer.Option(min=1, help="Trials run at once, each in its own process.")] = 1,
    backend: Annotated[Backend, typer.Option(help="local processes, or a Ray cluster (needs fedcli[ray]).")] = Backend.local,
    address: Annotated[str | None, typer.Option(help="Ray cluster address (with --backend ray).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the trials and whether each would run.")] = False,
    root: Annotated[Path | None, typer.Option(help="Folder of the default stores. \\[default: ./fedcli-runs]",
                                              rich_help_panel=Panel.TRACK)] = None,
    store: Annotated[str | None, typer.Option(help="SQLAlchemy URL of the store. \\[env: FEDCLI_STORE]",
                                              rich_help_panel=Panel.TRACK)] = None,
    tracking_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI.", rich_help_panel=Panel.TRACK)] = None,
    no_mlflow: Annotated[bool, typer.Option("--no-mlflow", help="Log to the SQL store only.",
                                            rich_help_panel=Panel.TRACK)] = False,
) -> None:
    """Expand a sweep spec into runs and run those not finished yet.

    Example: fedcli sweep --recipe fedpa-vs-fedavg-femnist --workers 2
    """
    from fedcli.sweeps import RECIPES, expand, load_spec

    if list_recipes:
        for name, body in RECIPES.items():
            typer.echo(f"{name}\t{body['description']}")
        return
    with user_errors(bool(ctx.obj and ctx.obj.get("debug"))):
        if backend is Backend.ray:
            raise ConfigError("--backend ray is not available in this release; use --backend local --workers N.")
        tracking = {"tracking.root": root and str(root), "tracking.store": store,
                    "tracking.tracking_uri": tracking_uri, "tracking.use_mlflow": False if no_mlflow else None}
        trials = expand(load_spec(spec, recipe), {k: v for k, v in tracking.items() if v is not None})
        done = finished_hashes(trials[0].config.tracking.store_url, trials[0].config.tracking.experiment) if trials else set()
        todo = [t for t in trials if t.config.config_hash not in done]
        show(trials, done)
        if dry_run or not todo:
            return
        from fedcli.engine.workers import available_cores

        cores = max(1, available_cores() // workers)  # each trial's share of the CPU (train.workers)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            codes = list(pool.map(lambda trial: run_trial(trial, cores), todo))
    failed = [t.name for t, code in zip(todo, codes, strict=True) if code != 0]
    console().print(f"{len(todo) - len(failed)}/{len(todo)} trials finished; skipped {len(trials) - len(todo)}.")
    if failed:
        console().print(f"[red]failed:[/] {', '.join(failed)}")
        raise typer.Exit(1)


def finished_hashes(store_url: str, experiment: str) -> set[str]:
    """Config hashes of the finished runs of an experiment."""
    store = open_store(store_url)
    if experiment not in {r.experiment for r in store.list_runs()}:
        return set()  # a new experiment: nothing finished yet
    runs = store.list_runs(experiment=experiment)
    return {r.tags.get("fedcli.config_hash", "") for r in runs if r.status == "finished"}


def run_trial(trial: object, cores: int | None = None) -> int:
    """Run one trial as `fedcli -q train --config <resolved.yaml>` in its own process.

    `cores`: the trial's share of the CPU cores, given to it as train.workers unless its
    config sets that (so N trials at once do not each start a worker per core).
    """
    body = trial.config.to_dict()  # type: ignore[attr-defined]
    if cores is not None and body["train"].get("workers") is None:
        body["train"]["workers"] = cores
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.yaml"
        path.write_text(yaml.safe_dump(body, sort_keys=True))
        proc = subprocess.run([sys.executable, "-m", "fedcli", "-q", "train", "--config", str(path),
                               "--run-name", trial.name], capture_output=True, text=True)  # type: ignore[attr-defined]
    if proc.returncode != 0:
        console().print(f"[red]{trial.name}[/]: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")  # type: ignore[attr-defined]
    return proc.returncode


def show(trials: list, done: set[str]) -> None:
    table = Table("trial", "algo", "seed", "config hash", "state", title=f"{len(trials)} trials")
    for t in trials:
        state = "finished (skip)" if t.config.config_hash in done else "to run"
        table.add_row(t.name, t.config.algorithm.name, str(t.config.seed), t.config.config_hash[:10], state)
    console().print(table)
