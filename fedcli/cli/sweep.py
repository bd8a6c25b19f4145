"""`fedcli sweep`: run a grid of configurations x seeds; a rerun continues it (fedcli.sweep).

This module holds the command (its options, the spec's checks, `--list-recipes`, `study:` recipes, the Ray
connection, the rerun hint); the run of the trials is in fedcli/cli/sweep_run.py, the tables in
fedcli/cli/sweep_tables.py, the end-of-sweep report in fedcli/cli/sweep_report.py, a search's set-up in
fedcli/cli/sweep_search.py. Planning, processes and signals are in fedcli.sweep, the Ray backend
(`--backend ray`, docs/scaling.md) in fedcli.sweep.ray_runner.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from fedcli.cli.common import DataStore, Panel
from fedcli.cli.errors import user_errors
from fedcli.cli.sweep_report import report_output
from fedcli.cli.sweep_run import run_plans
from fedcli.cli.sweep_tables import show_estimates, show_plan
from fedcli.errors import ConfigError
from fedcli.runs.outputs import check_output
from fedcli.runs.progress import console
from fedcli.runs.stores import open_store


class Backend(str, Enum):
    local = "local"
    ray = "ray"


def sweep(
    ctx: typer.Context,
    spec: Annotated[
        Path | None,
        typer.Argument(
            exists=True,
            dir_okay=False,
            resolve_path=True,
            help="Sweep spec (YAML): experiment, base, grid, seeds, report.",
        ),
    ] = None,
    recipe: Annotated[str | None, typer.Option(help="Run a built-in recipe instead of a spec file.")] = None,
    list_recipes: Annotated[
        bool, typer.Option("--list-recipes", help="List the built-in recipes and exit.")
    ] = False,
    workers: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Trials run at once, each in its own process. \\[default: "
            "1; with --backend ray as many as the cluster holds]",
        ),
    ] = None,
    backend: Annotated[
        Backend,
        typer.Option(
            help="local processes, or a Ray cluster (pip install 'fedcli\\[ray]'; docs/scaling.md)."
        ),
    ] = Backend.local,
    address: Annotated[
        str | None,
        typer.Option(
            help="Ray cluster: auto, HOST:PORT or ray://HOST:PORT (with --backend "
            "ray). \\[default: RAY_ADDRESS, else this machine's `ray start` "
            "cluster, else a new local Ray]"
        ),
    ] = None,
    cpus_per_trial: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="CPUs of each trial's Ray task (its train.workers "
            "and threads; with --backend ray). \\[default: 1]",
        ),
    ] = None,
    gpus_per_trial: Annotated[
        float | None,
        typer.Option(
            min=0, help="GPUs of each trial's Ray task, e.g. 0.5 (with --backend ray). \\[default: 0]"
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the trials and what a run would do with each; "
            "for a paper-scale recipe (or with --estimate) also each "
            "trial's federation size, estimated peak host/device "
            "memory and time per round (a short measured probe).",
        ),
    ] = False,
    estimate: Annotated[
        bool,
        typer.Option(
            "--estimate",
            help="With --dry-run: probe every trial (federation size, "
            "peak memory, time per round) for any spec.",
        ),
    ] = False,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="Every trial's data folder (data.data_dir): where a recipe's "
            "TFF/LEAF files are (the recipe says where they come from)."
        ),
    ] = None,
    data_store: Annotated[
        DataStore | None,
        typer.Option(
            help="Every trial's data store (data.data_store): memory, "
            "disk (memory-mapped, cohorts read per round) or auto "
            "(disk above 1 GiB; docs/scaling.md)."
        ),
    ] = None,
    eval_sample: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Every trial evaluates on a fixed sample of N test "
            "examples (train.eval_sample); 0 = the whole split. \\[default: "
            "the spec's, else the task's paper setting]",
        ),
    ] = None,
    smoke: Annotated[
        bool,
        typer.Option("--smoke", help="The spec's seconds-long `smoke:` version (experiment NAME-smoke)."),
    ] = False,
    output: Annotated[
        Path | None,
        typer.Option(
            help="Write the report here (PNGs beside it). \\[default: the spec's "
            "report.output, else <root>/reports/<experiment>.md]"
        ),
    ] = None,
    root: Annotated[
        Path | None,
        typer.Option(
            help="Folder of the default stores. \\[default: ./fedcli-runs]", rich_help_panel=Panel.TRACK
        ),
    ] = None,
    store: Annotated[
        str | None,
        typer.Option(help="SQLAlchemy URL of the store. \\[env: FEDCLI_STORE]", rich_help_panel=Panel.TRACK),
    ] = None,
    tracking_uri: Annotated[
        str | None, typer.Option(help="MLflow tracking URI.", rich_help_panel=Panel.TRACK)
    ] = None,
    no_mlflow: Annotated[
        bool, typer.Option("--no-mlflow", help="Log to the SQL store only.", rich_help_panel=Panel.TRACK)
    ] = False,
) -> None:
    """Run the trials of a sweep spec not finished yet; a rerun resumes interrupted ones.

    Example: fedcli sweep --recipe fedpa-vs-fedavg-femnist --workers 2
    On a Ray cluster: fedcli sweep spec.yaml --backend ray --address HEAD:6379 --store postgresql+psycopg://...
    """
    if backend is Backend.local and not dry_run and not list_recipes:  # its imports overlap the sweep's own
        from fedcli.sweep.process import spawn_early

        spawn_early()
    from fedcli.config.build import warn_degenerate
    from fedcli.sweep.plan import plan_settled, plan_trials
    from fedcli.sweep.rows import experiment_runs
    from fedcli.sweep.spec import check_report_keys, expand, load_spec, short_keys

    if list_recipes:
        from fedcli.recipes import read_recipe, recipe_names

        for name in recipe_names():
            body = read_recipe(name)
            typer.echo(
                f"{name}\t{body['description']}" + (f" [{body['paper']}]" if body.get("paper") else "")
            )
        return
    with user_errors(bool(ctx.obj and ctx.obj.get("debug"))):
        if backend is Backend.local:
            for flag, value in (
                ("--address", address),
                ("--cpus-per-trial", cpus_per_trial),
                ("--gpus-per-trial", gpus_per_trial),
            ):
                if value is not None:
                    raise ConfigError(
                        f"{flag} applies to --backend ray; add --backend ray, or drop {flag} "
                        "(the local backend takes --workers N)."
                    )
        tracking = {
            "tracking.root": root and str(root),
            "tracking.store": store,
            "tracking.tracking_uri": tracking_uri,
            "tracking.use_mlflow": False if no_mlflow else None,
        }
        body = load_spec(spec, recipe, smoke=smoke)
        given = {
            "data_dir": data_dir and str(data_dir.resolve()),
            "eval_sample": eval_sample,
            "data_store": data_store and data_store.value,
        }
        if any(
            v is not None for v in given.values()
        ):  # --data-dir / --eval-sample / --data-store: every trial's base
            body["base"] = {**(body.get("base") or {}), **{k: v for k, v in given.items() if v is not None}}
        if smoke and body.get("data") and not (body.get("base") or {}).get("data_dir"):
            from fedcli.recipes import (
                smoke_data,  # a paper-scale recipe's smoke: a small generated federation
            )

            generated = smoke_data(body, Path(root or "fedcli-runs"))
            if generated is not None:
                body["base"] = {**(body.get("base") or {}), "data_dir": str(generated)}
        if output is not None:
            body["report"] = {**(body.get("report") or {}), "output": str(output)}
        if body.get("study"):
            run_study(body, root, dry_run, smoke)
            return
        if body.get("search"):  # trials asked of an Optuna study (fedcli/cli/sweep_search.py, docs/sweeps.md)
            from fedcli.cli.sweep_search import prepare_search

            if backend is not Backend.local:  # trials run on other nodes: their root must be absolute there
                tracking["tracking.root"] = str(Path(root or "fedcli-runs").resolve())
            track = prepare_search(body, tracking, report_output(body, str(root or "fedcli-runs")))
            with cluster_of(backend, address, cpus_per_trial, gpus_per_trial, track) as cluster:
                if dry_run:
                    return
                from fedcli.sweep.search_source import SearchSource

                db = open_store(track.store_url)
                source = SearchSource(body, {k: v for k, v in tracking.items() if v is not None}, db)
                code = run_plans(
                    db,
                    body,
                    [],
                    workers,
                    rerun_hint(ctx, spec, recipe),
                    report_output(body, track.root),
                    cluster,
                    source=source,
                    track=track,
                )
            raise typer.Exit(code)
        trials = expand(body, {k: v for k, v in tracking.items() if v is not None})
        if not trials:
            raise ConfigError("the sweep spec expands to no trials; give `grid` values or `seeds`.")
        check_report_keys(
            body.get("report") or {}, trials
        )  # a bad report block fails now, not after the trials
        track, report_path = trials[0].config.tracking, report_output(body, trials[0].config.tracking.root)
        aliases = short_keys()  # degenerate trials and swept keys without effect, one line each
        swept = [k if k.startswith("hp.") or "." in k else aliases.get(k, k) for k in body.get("grid") or {}]
        for line in warn_degenerate([t.config for t in trials], swept):
            console().print(f"warning: {line}", markup=False, soft_wrap=True)
        check_output(report_path, "report.output")
        with cluster_of(backend, address, cpus_per_trial, gpus_per_trial, track) as cluster:
            if cluster is not None:
                from fedcli.sweep.ray_runner import absolute_root

                trials = absolute_root(trials)
            if (
                dry_run
            ):  # writes nothing on any store, not even its schema: a store without one holds no trials
                from fedcli.tracking.store.sql_store import SqlStore

                reader = SqlStore.reader(track.store_url)
                show_plan(
                    plan_trials(trials, [])
                    if reader is None
                    else plan_settled(trials, lambda: experiment_runs(reader, track.experiment))
                )
                if estimate or body.get(
                    "data"
                ):  # paper scale: will it fit, how long (fedcli/sweep/estimate.py)
                    show_estimates(trials, body)
                return
            db = open_store(track.store_url)
            plans = plan_settled(trials, lambda: experiment_runs(db, track.experiment))
            show_plan(plans)
            code = run_plans(db, body, plans, workers, rerun_hint(ctx, spec, recipe), report_path, cluster)
    raise typer.Exit(code)


def cluster_of(
    backend: Backend, address: str | None, cpus: int | None, gpus: float | None, track: Any
) -> AbstractContextManager[Any]:
    """The connected Ray cluster for --backend ray (fedcli.sweep.ray_runner.connect: checked before anything
    is written; `track`'s URLs with a password reach the workers through their environment), else None."""
    if backend is Backend.local:
        return nullcontext(None)
    from fedcli.sweep.ray_runner import connect

    return connect(address, cpus or 1, gpus or 0.0, track)


def run_study(body: Mapping[str, Any], root: Path | None, dry_run: bool, smoke: bool) -> None:
    """A `study:` recipe: compute and write its report (fedcli.studies); no runs, no store."""
    from fedcli.studies import load_study

    path = report_output(body, str(root or "fedcli-runs"), always=True)
    assert path is not None  # always=True
    check_output(path, "report.output")
    if dry_run:
        console().print(f"study {body['study']}: would write {path}", highlight=False)
        return
    console().print(f"study {body['study']} ({body.get('description', '')}) ...", highlight=False)
    load_study(body["study"])(path, smoke=smoke)
    typer.echo(str(path))


def rerun_hint(ctx: typer.Context, spec: Path | None, recipe: str | None) -> str:
    """The command that continues this sweep (its spec and tracking options; a URL's password masked),
    with absolute paths, so that it works pasted in any folder."""
    from fedcli.cli.common import command_name
    from fedcli.tracking.urls import mask_url

    fedcli = command_name()
    parts = [fedcli, "sweep", str(spec)] if spec else [fedcli, "sweep", "--recipe", str(recipe)]
    for name in (
        "workers",
        "backend",
        "address",
        "cpus_per_trial",
        "gpus_per_trial",
        "root",
        "store",
        "tracking_uri",
    ):
        value = ctx.params.get(name)
        value = value.value if isinstance(value, Enum) else value
        value = value.resolve() if isinstance(value, Path) else value
        if (
            value is not None
            and not (name == "workers" and value == 1)
            and not (name == "backend" and value == "local")
        ):
            parts += [
                f"--{name.replace('_', '-')}",
                f"{value:g}" if isinstance(value, float) else mask_url(str(value)),
            ]
    return shlex.join(parts + (["--no-mlflow"] if ctx.params.get("no_mlflow") else []))
