"""`fedcli list runs|algos|tasks|models|recipes`: what exists, as a table or JSON for scripts.

Over the 150-line budget of docs/style.md rule 1 by the layouts: git-style short ids, each run's
non-default hyperparameters, columns chosen to fit the terminal (80 columns without one, e.g.
in a pipe) and a record layout for algorithms and tasks on narrow terminals are presentation
of this command alone, so they live here. No value is ever cut: cells wrap (a run's name is
the one exception, cut with an ellipsis; `--json` has it whole).
"""

from __future__ import annotations

import json
import os
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Column, Table
from rich.text import Text

from fedcli.cli.common import Panel
from fedcli.cli.errors import user_errors
from fedcli.cli.hpdoc import algo_detail, algo_detail_rows, algo_rows
from fedcli.errors import ConfigError
from fedcli.runs.stores import open_store, tracking_config


class What(str, Enum):
    runs = "runs"
    algos = "algos"
    tasks = "tasks"
    models = "models"
    recipes = "recipes"


def list_command(
    ctx: typer.Context,
    what: Annotated[What, typer.Argument(help="runs | algos | tasks | models | recipes")],
    name: Annotated[
        str | None,
        typer.Argument(help="With algos: one algorithm, each hyperparameter with its default and meaning."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print a JSON list of objects (for scripts).")
    ] = False,
    experiment: Annotated[str | None, typer.Option(help="Only runs of this experiment.")] = None,
    store: Annotated[
        str | None,
        typer.Option(help="SQLAlchemy URL of the store. \\[env: FEDCLI_STORE]", rich_help_panel=Panel.TRACK),
    ] = None,
    root: Annotated[
        Path | None,
        typer.Option(
            help="Folder of the default store (<root>/fedcli.db). \\[default: ./fedcli-runs]",
            rich_help_panel=Panel.TRACK,
        ),
    ] = None,
) -> None:
    """List runs, algorithms, tasks, models or sweep recipes.

    Example: fedcli list runs --experiment demo --json; fedcli list algos fedpa
    """
    with user_errors(bool(ctx.obj and ctx.obj.get("debug"))):
        given = [
            flag
            for flag, value in (("--experiment", experiment), ("--store", store), ("--root", root))
            if value is not None
        ]
        if what is not What.runs and given:
            raise ConfigError(
                f"{given[0]} applies to `fedcli list runs` only; got `fedcli list {what.value} "
                f"{given[0]}`. Drop {given[0]}, or list runs."
            )
        if name is not None and what is not What.algos:
            raise ConfigError(
                f"a NAME applies to `fedcli list algos NAME` only; got `fedcli list {what.value} "
                f"{name}`. Drop {name!r}, or list algos."
            )
        rows = (
            algo_detail_rows(name)
            if name is not None
            else ROWS[what](experiment=experiment, store=store, root=root)
        )
    if as_json:
        typer.echo(
            json.dumps(
                [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows],
                indent=2,
                default=str,
            )
        )
        return
    out = Console()
    if name is not None:
        out.print(algo_detail(rows[0]))
        return
    if what is What.runs:
        out.print(runs_table(rows, out.width))
    elif out.width >= WIDE.get(what, 0):
        out.print(plain_table(what, rows))
    else:
        out.print(records(what, rows))


WIDE = {
    What.algos: 140,
    What.tasks: 160,
    What.models: 120,
}  # narrower terminals get records(): a table would wrap cells to a word


def plain_table(what: What, rows: list[dict[str, Any]]) -> Table:
    """One row per item; long cells wrap (fold), never cut."""
    table = Table(
        title=f"fedcli {what.value}",
        caption="fedcli list algos NAME: each hyperparameter's meaning" if what is What.algos else None,
    )
    for column in COLUMNS[what]:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(_cell(row.get(c)) for c in COLUMNS[what]))
    return table


def records(what: What, rows: list[dict[str, Any]]) -> Table:
    """The narrow layout: each item's name in bold beside its paper or description, then one
    indented line per field, its value wrapped in the width the labels leave (about 60
    characters at 80 columns)."""
    grid = Table.grid(Column(no_wrap=True), Column(overflow="fold"), padding=(0, 1))
    head, fields = RECORD_FIELDS[what]
    for i, row in enumerate(rows):
        if i:
            grid.add_row("", "")
        grid.add_row(Text(row["name"], style="bold"), _cell(row.get(head)))
        for label, key in fields:
            grid.add_row(f"  {label}", key(row) if callable(key) else _cell(row.get(key)))
    return grid


RECORD_FIELDS: dict[What, tuple[str, list[tuple[str, Any]]]] = {
    What.algos: ("paper", [("hyperparameters", "hyperparameters"), ("executors", "executors")]),
    What.tasks: (
        "description",
        [
            ("model", lambda r: f"{r['model']} ({r['params']:,} parameters); models: {r['models']}"),
            ("client lr", "client_lr"),
            ("data", lambda r: f"{r['source']}; {'offline' if r['offline'] else 'not bundled'}"),
            ("package", "package"),
        ],
    ),
    What.models: ("tasks", [("package", "package"), ("reference", "reference")]),
    What.recipes: ("description", []),
}


def runs_table(rows: list[dict[str, Any]], width: int) -> Table:
    """Runs with short ids and each run's non-default hyperparameters, in columns that fit `width`.

    Columns join in order of importance (RUN_PRIORITY) while the table still fits; the hp column
    claims 16 characters to join, then takes the width left up to its longest value and wraps
    beyond that. The name is always shown, in the width left after that (12 to 32 characters),
    cut with an ellipsis. `--json` keeps every field and the full ids.
    """
    shorts = short_ids([row["id"] for row in rows])
    cells = {
        **{c: [_cell(row.get(c)) for row in rows] for c in COLUMNS[What.runs]},
        "id": [shorts[row["id"]] for row in rows],
        "hp": [
            " ".join(f"{k}={v}" for k, v in row["non_default_hyperparameters"].items()) or "—" for row in rows
        ],
    }
    sizes = {c: max([len(c), *map(len, v)]) for c, v in cells.items()}
    claim = {**sizes, "hp": min(sizes["hp"], 16)}
    shown, used = ["name"], 1 + min(sizes["name"], 12) + 3  # left border; the name keeps >= 12 characters
    for column in RUN_PRIORITY:
        if any(v != "—" for v in cells[column]) and used + claim[column] + 3 <= width:
            shown.append(column)
            used += claim[column] + 3
    if "hp" in shown:  # the hp column grows into what is left, before the name does
        grown = min(sizes["hp"], claim["hp"] + width - used)
        used, claim["hp"] = used + grown - claim["hp"], grown
    sizes["name"] = min(sizes["name"], 32, 12 + width - used)  # and takes what is left, cut with …
    order = [
        c
        for c in ("id", "name", "status", "algo", "hp", "task", "experiment", "seed", "rounds", "accuracy")
        if c in shown
    ]
    table = Table(
        *(
            Column(
                column,
                no_wrap=column != "hp",
                overflow="ellipsis" if column == "name" else "fold",
                max_width={"name": sizes["name"], "hp": claim["hp"]}.get(column),
                justify="right" if column in ("seed", "rounds", "accuracy") else "left",
            )
            for column in order
        ),
        title="fedcli runs",
    )
    for i in range(len(rows)):
        table.add_row(*(cells[c][i] for c in order))
    return table


RUN_PRIORITY = (
    "id",
    "status",
    "algo",
    "hp",
    "accuracy",
    "rounds",
    "task",
    "seed",
    "experiment",
)  # besides name


def short_ids(ids: list[str], minimum: int = 8) -> dict[str, str]:
    """Git-style: each id's shortest prefix of >= `minimum` characters no other listed id starts with."""
    ordered = sorted(set(ids))
    out = {}
    for i, run_id in enumerate(ordered):
        shared = max(  # sorted: the longest common prefix is with a neighbour
            (len(os.path.commonprefix([run_id, o])) for o in ordered[max(i - 1, 0) : i + 2] if o != run_id),
            default=0,
        )
        out[run_id] = run_id[: max(minimum, shared + 1)]
    return out


def non_default(algo: str, hp: dict[str, str]) -> dict[str, str]:
    """The run's hyperparameters whose value is not the algorithm's default (flattened, as stored).

    Defaults are the algorithm's config dataclass (`fedcli list algos NAME`), so a value the
    algorithm recommended for the run (FedPA's burn-in of ceil(R/15) rounds) is shown too: it
    is not the bare default. An algorithm that is not installed shows every value.
    """
    from fedcli.algorithms import ALGORITHMS
    from fedcli.algorithms.base import hyperparameter_defaults
    from fedcli.tracking.keys import flatten_config

    record = ALGORITHMS.get(algo)
    defaults = flatten_config(hyperparameter_defaults(record.config_cls)) if record is not None else {}
    return {k: v for k, v in sorted(hp.items()) if defaults.get(k) != v}


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "—"
    return "—" if value is None else str(value)


def run_rows(*, experiment: str | None, store: str | None, root: Path | None) -> list[dict[str, Any]]:
    """Runs of the store with their final metrics (none, and no store created, before the first run).

    `hyperparameters` holds every hyperparameter the run trained with, `non_default_hyperparameters`
    those that differ from the algorithm's defaults (the table's hp column); both flattened
    (`key.sub`), values as strings.
    """
    from fedcli.config.checks import require_store, store_file
    from fedcli.tracking.keys import flatten_config

    url = tracking_config({"tracking.store": store, "tracking.root": root and str(root)}).store_url
    made = (store_file(url) or Path(".")).exists()
    if store is None and root is None and not os.environ.get("FEDCLI_STORE") and not made:
        return []  # the default store is made by the first `fedcli train`
    require_store(url)
    db = open_store(url)
    rows = []
    for run in db.list_runs(experiment=experiment):
        hp = flatten_config(run.config.get("algorithm", {}).get("hp") or {})
        last = db.metrics_frame([run.id], keys=["eval/accuracy", "eval/loss"]).groupby("key")
        final = {k: float(g.sort_values("round_idx")["value"].iloc[-1]) for k, g in last}
        rows.append(
            {
                "id": run.id,
                "name": run.run_name,
                "run_name": run.run_name,
                "status": run.status,
                "algo": run.algo,
                "task": run.task,
                "experiment": run.experiment,
                "seed": run.seed,
                "rounds": db.last_round(run.id),
                "accuracy": final.get("eval/accuracy"),
                "created": run.created_at.isoformat(timespec="seconds"),
                "hyperparameters": hp,
                "non_default_hyperparameters": non_default(run.algo, hp),
            }
        )
    return rows


def task_rows(**_: Any) -> list[dict[str, Any]]:
    """Registered tasks with their default model and its parameter count."""
    from fedcli.datasets.models import num_parameters
    from fedcli.datasets.registry import TASK_SOURCES, TASKS

    return [
        {
            "id": task.name,
            "name": task.name,
            "model": task.default_model,
            "models": ", ".join(task.models),
            "params": num_parameters(task.models[task.default_model]()),
            "client_lr": task.client_lr,
            "source": task.source,
            "package": TASK_SOURCES[task.name],
            "offline": task.offline,
            "kind": task.kind,
            "description": task.description,
        }
        for task in TASKS.values()
    ]


def model_rows(**_: Any) -> list[dict[str, Any]]:
    """Models by name: each task's own (package fedcli, or the task plugin's) and the model plugins'
    (entry-point group fedcli.models: any task, `--model NAME`; docs/bring-your-own.md, "Plugins")."""
    from fedcli.datasets.registry import TASK_SOURCES, TASKS
    from fedcli.datasets.yours.plugins import model_plugins

    own: dict[tuple[str, str], list[str]] = {}
    for task in TASKS.values():
        for name in task.models:
            own.setdefault((name, TASK_SOURCES[task.name]), []).append(task.name)
    return [
        {"id": name, "name": name, "package": package, "tasks": ", ".join(tasks), "reference": None}
        for (name, package), tasks in sorted(own.items())
    ] + [
        {
            "id": name,
            "name": name,
            "package": package,
            "tasks": "any (your own model: --model NAME)",
            "reference": ref,
        }
        for name, (ref, package) in model_plugins().items()
    ]


def recipe_rows(**_: Any) -> list[dict[str, Any]]:
    """Built-in sweep recipes (fedcli sweep --recipe NAME)."""
    from fedcli.recipes import read_recipe, recipe_names

    return [
        {"id": name, "name": name, "description": read_recipe(name)["description"]} for name in recipe_names()
    ]


ROWS = {
    What.runs: run_rows,
    What.algos: algo_rows,
    What.tasks: task_rows,
    What.models: model_rows,
    What.recipes: recipe_rows,
}
COLUMNS = {
    What.runs: ("id", "name", "status", "algo", "task", "experiment", "seed", "rounds", "accuracy"),
    What.algos: ("name", "paper", "hyperparameters", "executors"),
    What.tasks: ("name", "model", "params", "client_lr", "source", "package", "offline", "description"),
    What.models: ("name", "package", "tasks", "reference"),
    What.recipes: ("name", "description"),
}
