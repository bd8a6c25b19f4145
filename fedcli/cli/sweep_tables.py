"""What `fedcli sweep` shows: the plan table, the --dry-run estimates, the live trial table (or a progress
line every PLAIN_EVERY_S when stderr is not a terminal) and the results table.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import typer
from rich.table import Table

from fedcli.runs.progress import console

PLAIN_EVERY_S = 10.0  # progress line period when stderr is not a terminal


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
        table.add_row(*cells, *[""] * (len(table.columns) - len(cells)))
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
