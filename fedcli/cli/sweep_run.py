"""`fedcli sweep`'s run of the planned trials: the scheduler (local worker processes or a Ray cluster), the
sweep's one MLflow mirror, the results and the one-line outcome with its exit code (fedcli/cli/sweep.py parses
the command and plans; the tables are in fedcli/cli/sweep_tables.py, the report in fedcli/cli/sweep_report.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import typer

from fedcli.cli.sweep_report import write_report
from fedcli.cli.sweep_tables import live_display, show_results
from fedcli.runs.progress import console


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
    trial source (a search's fedcli.sweep.search_source.SearchSource) the scheduler asks instead of `plans`
    (then empty), with the trials' `track`ing config.
    """
    from fedcli.engine.machine import available_cores
    from fedcli.runs.stores import check_mlflow
    from fedcli.sweep.plan import NEW, RESUME, Plan, plan_trials
    from fedcli.sweep.rows import METRIC_KEYS, experiment_runs, trial_rows
    from fedcli.sweep.scheduler import TrialClaims, TrialRunner
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
    scheduler: TrialRunner
    if cluster is None:
        from fedcli.sweep.worker_pool import WorkerScheduler

        # each trial's share of the CPU: its intra-op threads and train.workers (docs/sweeps.md, "Workers")
        cores = max(1, available_cores() // (workers or 1))
        scheduler = WorkerScheduler(
            plans,
            workers=workers or 1,
            cores=cores,
            threads=cores,
            recheck=recheck,
            claims=TrialClaims(db, track.experiment),
            mirror=mirror,
            source=source,
        )
    else:
        from fedcli.sweep.ray_runner import RayScheduler

        scheduler = RayScheduler(
            plans,
            cluster=cluster,
            workers=workers,
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
    (that import and MLflow's schema set-up held trial 1 back 2.3 s; docs/benchmarks.md).
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


def summary(rows: Sequence[Any], signum: int | None, hint: str, failed: int) -> int:
    """Print the one-line outcome; return 128 + signal when stopped, 1 when a trial did not finish, else 0.

    Trials running in another process are not this sweep's to finish: they do not fail it.
    """
    import signal

    counts = Counter(row.status for row in rows)  # in the rows' order
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
