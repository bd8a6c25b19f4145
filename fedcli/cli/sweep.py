"""`fedcli sweep`: run a grid of configurations x seeds; a rerun continues it (fedcli.sweep).

Over the 150-line budget of docs/style.md rule 1 by the live table and the end-of-sweep report:
both are output of this command only; planning, processes and signals are in fedcli.sweep,
the Ray backend (`--backend ray`, docs/scaling.md) in fedcli.sweep.ray_runner.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from fedcli.cli.common import DataStore, Panel
from fedcli.cli.errors import user_errors
from fedcli.errors import ConfigError
from fedcli.runs.outputs import check_output
from fedcli.runs.progress import console
from fedcli.runs.stores import open_store

PLAIN_EVERY_S = 10.0  # progress line period when stderr is not a terminal


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
            with cluster_of(
                backend, address, cpus_per_trial, gpus_per_trial, track
            ) as cluster:  # before anything is written
                if cluster is not None:
                    cluster.check(track)
                if dry_run:
                    return
                from fedcli.sweep.search import SearchSource

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
        aliases = short_keys()  # issue 24: degenerate trials and swept keys without effect, one line each
        swept = [k if k.startswith("hp.") or "." in k else aliases.get(k, k) for k in body.get("grid") or {}]
        for line in warn_degenerate([t.config for t in trials], swept):
            console().print(f"warning: {line}", markup=False, soft_wrap=True)
        check_output(report_path, "report.output")
        with cluster_of(
            backend, address, cpus_per_trial, gpus_per_trial, track
        ) as cluster:  # before anything is written
            if cluster is not None:
                from fedcli.sweep.ray_runner import absolute_root

                trials = absolute_root(trials)
                cluster.check(track)
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
    backend: Backend, address: str | None, cpus: int | None, gpus: float | None, track: Any = None
) -> AbstractContextManager[Any]:
    """The connected Ray cluster for --backend ray (fedcli.sweep.ray_runner.connect; `track`'s URLs with a password
    reach the workers through their environment), else None."""
    if backend is Backend.local:
        return nullcontext(None)
    from fedcli.sweep.ray_runner import connect

    return connect(address, cpus or 1, gpus or 0.0, track)


def run_study(body: Mapping[str, Any], root: Path | None, dry_run: bool, smoke: bool) -> None:
    """A `study:` recipe: compute and write its report (fedcli.studies); no runs, no store."""
    from fedcli.studies import load_study

    path = report_output(
        {**body, "report": body.get("report") or {}}, str(root or "fedcli-runs"), always=True
    )
    assert path is not None  # always=True
    check_output(path, "report.output")
    if dry_run:
        console().print(f"study {body['study']}: would write {path}", highlight=False)
        return
    console().print(f"study {body['study']} ({body.get('description', '')}) ...", highlight=False)
    load_study(body["study"])(path, smoke=smoke)
    typer.echo(str(path))


def run_plans(
    db: Any,
    body: Mapping[str, Any],
    plans: list,
    workers: int | None,
    hint: str,
    report_path: Path | None,
    cluster: Any = None,
    source: Any = None,
    track: Any = None,
) -> int:
    """Run what the plans say, showing the trials; print results and report; return the exit code.

    `cluster`: a fedcli.sweep.ray_runner.RayCluster to run the trials on, else local processes. `source`: a
    trial source (a search's fedcli.sweep.search.SearchSource) the scheduler asks instead of `plans`
    (then empty), with the trials' `track`ing config.
    """
    from fedcli.engine.machine import available_cores
    from fedcli.runs.stores import check_mlflow
    from fedcli.sweep.plan import NEW, RESUME, Plan, plan_trials
    from fedcli.sweep.rows import METRIC_KEYS, experiment_runs, trial_rows
    from fedcli.sweep.scheduler import TrialClaims
    from fedcli.tracking.report.model import resolve_metric

    track, todo = track or plans[0].trial.config.tracking, [p for p in plans if p.action in (NEW, RESUME)]
    todo = todo or ([True] if source is not None and not source.exhausted else [])
    if track.use_mlflow and todo:  # the sweep's MLflow parent run is the mirror's to open and end
        check_mlflow(track, optional=False)
    keys = (
        [resolve_metric(body["report"]["metric"])]
        if (body.get("report") or {}).get("metric")
        else list(METRIC_KEYS)
    )

    def recheck(plan: Plan) -> Plan:  # right before a trial starts: has another process taken it?
        return plan_trials([plan.trial], experiment_runs(db, track.experiment))[0]

    def read(stopped: bool = False) -> tuple[list[Any], str]:
        return trial_rows(db, track.experiment, scheduler.plans, scheduler.processes, keys, stopped)

    mirror = sweep_mirror(track, body) if todo else None  # one per sweep (docs/sweeps.md)
    if cluster is None:
        from fedcli.sweep.worker_pool import WorkerScheduler

        # each trial's share of the CPU: its intra-op threads and train.workers (docs/sweeps.md, "Workers")
        cores = max(1, available_cores() // (workers or 1))
        scheduler = WorkerScheduler(
            plans,
            workers=workers or 1,
            cores=cores,
            threads=cores,
            parent_run=None,
            recheck=recheck,
            claims=TrialClaims(db, track.experiment),
            mirror=mirror,
            source=source,
        )
    else:
        scheduler = cluster.scheduler(
            plans,
            workers=workers,
            parent_run=None,
            recheck=recheck,
            read_runs=lambda: experiment_runs(db, track.experiment),
            track=track,
            claims=TrialClaims(db, track.experiment),
            mirror=mirror,
            source=source,
        )
    status, quiet = (
        "failed",
        True,
    )  # what the sweep's MLflow run ends as; a failure's own line stays the only one
    try:
        try:
            with live_display(read) as tick:
                signum = scheduler.run(tick)
            rows, key = read(signum is not None)  # before cleanup: a failed trial's row quotes its stderr
        finally:
            scheduler.cleanup()
        failed = show_results(rows, key, signum)
        status, quiet = "interrupted" if signum else "failed" if failed else "finished", False
        if report_path is not None and any(r.status.startswith("finished") for r in rows):
            write_report(
                db,
                body,
                [r.run_id for r in rows if r.status.startswith("finished") and r.run_id],
                report_path,
            )
            typer.echo(str(report_path))
    finally:  # the store or the disk may have failed under the sweep (a full disk: its one line follows)
        if (
            mirror is not None
        ):  # the copies still to do (the trials never waited for them), then the parent run
            warning = mirror.finish(stopping=scheduler.signum is not None, status=status)
            if warning and not quiet:
                console().print(f"warning: {warning}", highlight=False, soft_wrap=True)
    return summary(rows, signum, hint, len(failed))


def sweep_mirror(track: Any, spec: Mapping[str, Any]) -> Any:
    """The sweep's one MLflow mirror (tracking/mlflow/sweep_mirror.py), or None with --no-mlflow.

    It opens (or reuses) the sweep's MLflow parent run found by `spec`'s tags (fedcli.sweep.rows.parent_tags), nests the
    trials under it and ends it as `SweepMirror.finish` says: the sweep process never imports MLflow
    (that import and MLflow's schema set-up held trial 1 back 2.3 s, issue 27).
    """
    if not track.use_mlflow:
        return None
    from fedcli.sweep.rows import parent_tags
    from fedcli.tracking.mlflow.sweep_mirror import SweepMirror

    return SweepMirror(
        tracking_uri=track.mlflow_uri,
        experiment=track.experiment,
        store_url=track.store_url,
        runs_root=Path(track.root).resolve() / "runs",
    ).spawn(spec, parent_tags(spec))


def show_results(rows: Sequence[Any], key: str, signum: int | None) -> list[Any]:
    """Print the results table and one line per trial that did not finish; return those rows."""
    console().print(rows_table(rows, key, "results"))
    bad = ("failed", "diverged (skip)") if signum else ("failed", "diverged (skip)", "interrupted")
    failed = [
        r for r in rows if r.status in bad
    ]  # interrupted without a stop of the sweep: killed from outside
    for row in failed:
        console().print(f"[red]{row.status}:[/] {row.name}: {row.note}", markup=True, highlight=False)
    return failed


def summary(rows: Sequence[Any], signum: int | None, hint: str, failed: int) -> int:
    """Print the one-line outcome; return 128 + signal when stopped, 1 when a trial did not finish, else 0.

    Trials running in another process are not this sweep's to finish: they do not fail it.
    """
    import signal

    counts: dict[str, int] = {}
    for row in rows:
        counts[row.status] = counts.get(row.status, 0) + 1
    text = ", ".join(f"{n} {status}" for status, n in counts.items())
    if signum is not None:
        console().print(
            f"sweep stopped by {signal.Signals(signum).name}: {text}. "
            f"Stopped trials are checkpointed; continue with: {hint}",
            highlight=False,
            soft_wrap=True,
        )
        return 128 + signum
    elsewhere = counts.get("running elsewhere", 0)
    later = f" Rerun when the {elsewhere} running elsewhere end to include them: {hint}" if elsewhere else ""
    console().print(f"sweep done: {text}.{later}", highlight=False, soft_wrap=True)
    return 1 if failed else 0


@contextmanager
def live_display(read: Callable[..., tuple[list, str]]) -> Iterator[Callable[[list], None]]:
    """A live table of the trials on a terminal (stderr); else a progress line every PLAIN_EVERY_S."""
    out = console()
    if not out.is_terminal:
        last, announced = [time.monotonic()], set()

        def plain(processes: list) -> None:
            for p in processes:
                if p.ended is not None and id(p) not in announced:
                    announced.add(id(p))
                    why = f": {p.last_error()}" if p.status == "failed" else ""
                    out.print(
                        f"trial {p.plan.trial.name} {p.status} after {p.elapsed_s:.0f}s{why}", highlight=False
                    )
            if time.monotonic() - last[0] >= PLAIN_EVERY_S:
                last[0] = time.monotonic()
                rows = read()[0]
                running = [r for r in rows if r.status == "running"]
                waiting = sum(r.status == "waiting" for r in rows)
                if running or waiting:
                    done = sum(
                        r.status.startswith(("finished", "failed", "diverged", "interrupted", "pruned"))
                        for r in rows
                    )
                    out.print(
                        f"sweep: {done}/{len(rows)} done; "
                        + "; ".join(f"{r.name} {r.round_idx or 0}/{r.rounds}" for r in running)
                        + f"; {waiting} waiting",
                        highlight=False,
                    )

        yield plain
        return
    from rich.live import Live

    with Live(console=out, auto_refresh=False, transient=True) as live:  # refreshed by the caller: no thread
        yield lambda processes: live.update(rows_table(*read(), "trials"), refresh=True)


def show_plan(plans: Sequence[Any]) -> None:
    table = Table("trial", "config hash", "plan", "why", title=f"{len(plans)} trials")
    for plan in plans:
        action = {
            "new": "to run",
            "resume": f"resume {(plan.run_id or '')[:8]}",
            "skip": "finished (skip)",
            "diverged": "diverged (skip)",
        }.get(plan.action, plan.action)
        table.add_row(plan.trial.name, plan.trial.config.config_hash[:10], action, plan.note)
    console().print(table)


def show_estimates(trials: Sequence[Any], body: Mapping[str, Any]) -> None:
    """Each trial's federation, estimated peak memory and time per round, from a measured probe."""
    from fedcli.sweep.estimate import PROBE_ROUNDS, estimate_trials, fmt_bytes, fmt_seconds

    source = (body.get("data") or {}).get("source")
    if source:
        console().print(f"data: {source}", highlight=False, soft_wrap=True, markup=False)
    console().print(
        f"probing {len(trials)} trial(s): {PROBE_ROUNDS} rounds each, nothing stored ...", highlight=False
    )
    table = Table(
        "trial",
        "clients",
        "examples (train/test)",
        "largest client",
        "params",
        "set-up",
        "s/round",
        "host peak (est.)",
        "device peak",
        "full run (est.)",
        title='estimates on this machine (docs/scaling.md, "paper scale")',
    )
    plain = not console().is_terminal  # a pipe or a log: one line per trial, never cut to a width
    for e in estimate_trials(trials):
        if e.error is not None:
            cells = [e.trial, "probe failed: " + e.error]
            table.add_row(*cells, *[""] * 8)
        else:
            cells = [
                e.trial,
                f"{e.clients:,}",
                f"{e.train_examples:,} / {e.test_examples:,}",
                f"{e.largest_client:,}",
                f"{e.params:,}",
                fmt_seconds(e.setup_s),
                f"{e.round_s:.2f}",
                fmt_bytes(e.host_peak_bytes),
                fmt_bytes(e.device_peak_bytes),
                fmt_seconds(e.full_run_s),
            ]
            table.add_row(*cells)
        if plain:
            names = [str(c.header) for c in table.columns]
            typer.echo(
                f"{cells[0]}: " + "; ".join(f"{n} {v}" for n, v in zip(names[1:], cells[1:], strict=False))
            )
    if not plain:
        console().print(table)


def rows_table(rows: Sequence[Any], key: str, title: str) -> Table:
    table = Table("trial", "status", "round", key, "elapsed", "run", title=title)
    for r in rows:
        table.add_row(
            r.name,
            r.status,
            f"{r.round_idx if r.round_idx is not None else '—'}/{r.rounds}",
            "—" if r.metric is None else f"{r.metric:.4g}",
            "—" if r.elapsed_s is None else f"{r.elapsed_s:.0f}s",
            (r.run_id or "—")[:8],
        )
    return table


def report_output(body: Mapping[str, Any], root: str, *, always: bool = False) -> Path | None:
    """Where the spec's `report:` block writes: its `output`, else <root>/reports/<experiment>.md."""
    block = body.get("report")
    if not block and not always:
        return None
    block = block or {}
    return Path(block.get("output") or Path(root) / "reports" / f"{body['experiment']}.md")


def write_report(db: Any, body: Mapping[str, Any], run_ids: list[str], path: Path) -> None:
    """Write the `fedcli report` markdown (and figures) of the sweep's finished runs."""
    from fedcli.runs.outputs import output_error, write_output
    from fedcli.tracking.report.build import build_report
    from fedcli.tracking.report.model import ReportSpec
    from fedcli.tracking.report.plots import report_figures
    from fedcli.tracking.report.render import render_markdown, shown_store

    block = body["report"]
    numbers = lambda key: tuple(block.get(key) or ())  # noqa: E731
    group_by = block.get("group_by")
    command = shlex.join(
        ["fedcli", "report", "--runs", ",".join(i[:8] for i in run_ids), "--store", shown_store(db.url)]
    )
    spec = ReportSpec(
        runs=tuple(run_ids),
        metric=block.get("metric"),
        thresholds=numbers("thresholds"),
        at=numbers("at"),
        window=block.get("window"),
        smooth=block.get("smooth"),
        group_by=tuple(group_by.split(",")) if isinstance(group_by, str) else group_by,
        command=command,
        columns=tuple(block.get("columns") or ()),
    )
    built = build_report(db, spec)
    try:
        drawn = report_figures(built, path, None, "")  # PNGs beside the markdown, as `fedcli report --output`
    except OSError as exc:
        raise output_error(path, "report.output", exc) from None
    write_output(path, recipe_preamble(body, render_markdown(built, drawn)), "report.output")


def recipe_preamble(body: Mapping[str, Any], markdown: str) -> str:
    """Put the sweep's description and the paper claim it reruns under the report's title."""
    lines = markdown.split("\n")
    extra = [
        f"**{body['description']}**" if body.get("description") else "",
        f"Reruns: {body['paper']}." if body.get("paper") else "",
    ]
    extra = [line for line in extra if line]
    return "\n".join([lines[0], "", "\n\n".join(extra), *lines[1:]]) if extra else markdown


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
