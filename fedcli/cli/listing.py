"""`fedcli list runs|algos|tasks|recipes`: what exists, as a table or JSON for scripts."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from fedcli.cli.common import Panel, open_store, tracking_config
from fedcli.cli.errors import user_errors
from fedcli.errors import ConfigError


class What(str, Enum):
    runs = "runs"
    algos = "algos"
    tasks = "tasks"
    recipes = "recipes"


def list_command(
    ctx: typer.Context,
    what: Annotated[What, typer.Argument(help="runs | algos | tasks | recipes")],
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list of objects (for scripts).")] = False,
    experiment: Annotated[str | None, typer.Option(help="Only runs of this experiment.")] = None,
    store: Annotated[str | None, typer.Option(help="SQLAlchemy URL of the store. \\[env: FEDCLI_STORE]",
                                              rich_help_panel=Panel.TRACK)] = None,
) -> None:
    """List runs, algorithms, tasks or sweep recipes.

    Example: fedcli list runs --experiment demo --json
    """
    with user_errors(bool(ctx.obj and ctx.obj.get("debug"))):
        if what is not What.runs and (experiment is not None or store is not None):
            flag = "--experiment" if experiment is not None else "--store"
            raise ConfigError(f"{flag} applies to `fedcli list runs` only; got `fedcli list {what.value} {flag}`. "
                              f"Drop {flag}, or list runs.")
        rows = ROWS[what](experiment=experiment, store=store)
    if as_json:
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    table = Table(*COLUMNS[what], title=f"fedcli {what.value}")
    for row in rows:
        table.add_row(*(_cell(row.get(c)) for c in COLUMNS[what]))
    Console().print(table)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "—"
    return "—" if value is None else str(value)


def run_rows(*, experiment: str | None, store: str | None) -> list[dict[str, Any]]:
    """Runs of the store with their final metrics (none, and no store created, before the first run)."""
    import os

    from fedcli.config import require_store, store_file

    url = tracking_config({"tracking.store": store}).store_url
    if store is None and not os.environ.get("FEDCLI_STORE") and not (store_file(url) or Path(".")).exists():
        return []  # the default store is made by the first `fedcli train`
    require_store(url)
    db = open_store(url)
    rows = []
    for run in db.list_runs(experiment=experiment):
        last = db.metrics_frame([run.id], keys=["eval/accuracy", "eval/loss"])
        final = {k: float(g.sort_values("round_idx")["value"].iloc[-1]) for k, g in last.groupby("key")}
        rows.append({"id": run.id, "name": run.run_name, "run_name": run.run_name, "status": run.status,
                     "algo": run.algo, "task": run.task, "experiment": run.experiment, "seed": run.seed,
                     "rounds": db.last_round(run.id), "accuracy": final.get("eval/accuracy"),
                     "created": run.created_at.isoformat(timespec="seconds")})
    return rows


def algo_rows(**_: Any) -> list[dict[str, Any]]:
    """Registered algorithms with their paper and hyperparameter defaults."""
    from fedcli.algorithms import ALGORITHMS
    from fedcli.algorithms.base import hyperparameter_defaults

    def executors(a: Any) -> str:  # process runs whichever of these fits, in each worker
        names = ["loop", "vmap", "process"] if a.supports_vmap else ["loop", "process"]
        if a.supports_vmap and a.fused_local is not None:
            names.insert(2, "fused (dense classifiers)")
        return ", ".join(names)

    return [{"id": a.name, "name": a.name, "paper": a.paper, "hyperparameters": hyperparameter_defaults(a.config_cls),
             "executors": executors(a), "description": a.description}
            for a in ALGORITHMS.values()]


def task_rows(**_: Any) -> list[dict[str, Any]]:
    """Registered tasks with their default model and its parameter count."""
    from fedcli.datasets.models import num_parameters
    from fedcli.datasets.registry import TASKS

    rows = []
    for task in TASKS.values():
        params = num_parameters(task.models[task.default_model]())
        rows.append({"id": task.name, "name": task.name, "model": task.default_model,
                     "models": ", ".join(task.models), "params": params, "source": task.source,
                     "offline": task.offline, "kind": task.kind, "description": task.description})
    return rows


def recipe_rows(**_: Any) -> list[dict[str, Any]]:
    """Built-in sweep recipes (fedcli sweep --recipe NAME)."""
    from fedcli.sweeps import RECIPES

    return [{"id": name, "name": name, "description": r["description"]} for name, r in RECIPES.items()]


ROWS = {What.runs: run_rows, What.algos: algo_rows, What.tasks: task_rows, What.recipes: recipe_rows}
COLUMNS = {
    What.runs: ("id", "name", "status", "algo", "task", "experiment", "seed", "rounds", "accuracy"),
    What.algos: ("name", "paper", "hyperparameters", "executors"),
    What.tasks: ("name", "model", "params", "source", "offline", "description"),
    What.recipes: ("name", "description"),
}
