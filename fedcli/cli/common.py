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
    from fedcli.config.sections import RunConfig, TrackingConfig
    from fedcli.engine.train import RunResult
    from fedcli.tracking.mlflow.handle import MirrorHandle
    from fedcli.tracking.sinks import Tracker
    from fedcli.tracking.store.records import RunRecord
    from fedcli.tracking.store.sql_store import SqlStore


class Scheme(str, Enum):
    """Partition schemes (fedcli.config.sections.SCHEMES) as a CLI choice."""

    natural = "natural"
    iid = "iid"
    dirichlet = "dirichlet"
    shards = "shards"
    labels = "labels"
    quantity = "quantity"
    two_level = "two-level"


class DataStore(str, Enum):
    """--data-store (fedcli.datasets.federated.STORES) as a CLI choice."""

    auto = "auto"
    memory = "memory"
    disk = "disk"


class Panel:
    """Help panels of docs/style.md rule 12."""

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
    from fedcli.tracking.mlflow.checks import sqlite_path
    from fedcli.tracking.store.sql_store import SqlStore

    path = sqlite_path(url)
    if must_exist and path is not None and not path.exists():
        raise ConfigError(f"no results store at {path}; pass --root or --store of the folder your runs are in "
                          "(`fedcli train` creates it).")
    return SqlStore(url)


def tracking_config(overrides: Mapping[str, Any]) -> TrackingConfig:
    """Build only the tracking section from dotted overrides (for commands that read the store)."""
    from fedcli.config.checks import build_section, check_blank_tracking
    from fedcli.config.sections import TrackingConfig

    values = {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("tracking.") and v is not None}
    track: TrackingConfig = build_section("tracking", TrackingConfig, values)
    check_blank_tracking(track)  # `--store ""` read the default store
    return track


def spawn_mirror(cfg: TrackingConfig, parent_run_id: str | None = None) -> MirrorHandle | None:
    """Start the run's MLflow mirror process now (it imports MLflow, writes nothing), unless --no-mlflow."""
    from fedcli.tracking.mlflow.handle import MirrorHandle

    if not cfg.use_mlflow:
        from fedcli.tracking.mlflow.handle import discard_early

        discard_early()  # `fedcli train` started one before it knew (tracking.use_mlflow: false in a config)
        return None
    return MirrorHandle(tracking_uri=cfg.mlflow_uri, experiment=cfg.experiment, store_url=cfg.store_url,
                        runs_root=Path(cfg.root).resolve() / "runs", parent_run_id=parent_run_id).spawn()


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

    from fedcli.errors import ConfigError
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


def command_name() -> str:
    """How to call fedcli again: `fedcli` when that is this program on PATH, else its full path.

    After `make demo`, `.venv/bin` is usually not on PATH, so a bare `fedcli …` hint would fail.
    """
    import shutil

    on_path = shutil.which("fedcli")
    here = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0].endswith("fedcli") else None
    if here is None:
        here = Path(sys.executable).with_name("fedcli")
    if on_path and Path(on_path).resolve() == here.resolve():
        return "fedcli"
    return str(here) if here.exists() else "fedcli"


def store_options(cfg: Any) -> str:
    """The options that point another command at this run's stores: `--store URL`, the SQL
    store's URL with an absolute path, also for the default root (`./fedcli-runs` is another
    folder wherever the hint is pasted), so every printed hint works pasted in any folder.

    A password in the URL is shown masked (`user:***@host`, docs/architecture.md, "Security"):
    the hint then works as it is where FEDCLI_STORE holds the full URL, else the user puts the
    password back in.
    """
    from fedcli.tracking.urls import mask_url

    url = cfg.tracking.store_url
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////") and url != "sqlite:///:memory:":
        url = f"sqlite:///{Path(url.removeprefix('sqlite:///')).resolve()}"  # `--store sqlite:///runs.db`
    return f" --store {shlex.quote(mask_url(url))}"  # every command that reads runs takes --store


def resume_hint(cfg: Any, run_id: str) -> str:
    """The command that continues `run_id`, with the store options it needs (a distributed run:
    under torchrun again, or in one process with another executor)."""
    resume = f"train --resume {run_id[:8]}{store_options(cfg)}"
    import shlex

    from fedcli.datasets.yours.trust import recorded_code

    for code in recorded_code({"model": cfg.data.model, "file": cfg.data.file}):  # named again: allowed to run
        resume += f" --{'model' if code.what == 'model' else 'data'} {shlex.quote(code.ref)}"
    if cfg.train.executor == "distributed":
        from fedcli.engine.distributed import launch_env

        world = (launch_env() or (0, 2))[1]
        return (f"torchrun --nproc-per-node {world} -m fedcli {resume} --executor distributed "
                f"(or in one process: {command_name()} {resume} --executor auto)")
    return f"{command_name()} {resume}"


ProgressFn = Callable[[int, dict[str, float]], None]


@contextmanager
def train_progress(cfg: RunConfig, quiet: bool = False) -> Iterator[ProgressFn | None]:
    """Show training progress on stderr: a live bar on a terminal, a plain line every 10 s otherwise.

    The bar leads with the round count and the ETA, so a narrow terminal keeps them, and
    metrics are dropped before those; without a terminal (nohup, a cluster job, `2> log`) a
    plain line `round 12/40 (30 %)  acc 0.61  0.31 s/round  ETA 8 s` goes out every 10 s and
    at the last round. While it is shown the engine's per-round INFO lines are held back (it
    shows the same numbers); `-v` still prints them.
    """
    if quiet:
        yield None
        return
    import logging

    engine_log = logging.getLogger("fedcli.engine.rounds")
    previous = engine_log.level
    if logging.getLogger().level > logging.DEBUG:
        engine_log.setLevel(logging.WARNING)
    out = console()
    try:
        if out.is_terminal:
            with _bar(cfg, out) as update:
                yield update
        else:
            yield _plain_lines(cfg, out)
    finally:
        engine_log.setLevel(previous)


@contextmanager
def _bar(cfg: RunConfig, out: Console) -> Iterator[ProgressFn]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (MofNCompleteColumn(), TimeRemainingColumn(compact=True, elapsed_when_finished=True),
               BarColumn(bar_width=None if out.width >= 120 else 12),
               TextColumn("[bold]{task.description}"), TextColumn("{task.fields[metrics]}"))
    with Progress(*columns, console=out, transient=False, expand=False) as progress, _logs_through(out):
        bar = progress.add_task(f"{cfg.algorithm.name}/{cfg.data.task}", total=cfg.train.rounds, metrics="")
        shown: dict[str, float] = {}

        def update(round_idx: int, metrics: dict[str, float]) -> None:
            shown.update({k: v for k, v in metrics.items() if k in LIVE_KEYS})
            progress.update(bar, completed=round_idx, metrics=_metrics_text(shown, out.width - 45))

        yield update


@contextmanager
def _logs_through(out: Console) -> Iterator[None]:
    """Print log records through `out`, the live bar's console, while the bar is shown.

    The log handler's own console writes to the real stderr (rich unwraps the bar's stderr
    proxy), so a record logged under a live bar landed at the end of the bar's line
    ("... s/round 0.06383[15:40:50] INFO") and the bar was drawn again below it. Through the
    bar's console the record goes above the bar and the bar stays one line.
    """
    import logging

    from rich.logging import RichHandler

    handlers = [h for h in logging.getLogger().handlers if isinstance(h, RichHandler)]
    previous = [h.console for h in handlers]
    for handler in handlers:
        handler.console = out
    try:
        yield
    finally:
        for handler, own in zip(handlers, previous, strict=True):
            handler.console = own


def _plain_lines(cfg: RunConfig, out: Console, every_s: float = 10.0) -> ProgressFn:
    import time

    start = time.monotonic()
    last = [start]
    shown: dict[str, float] = {}
    total = cfg.train.rounds

    def update(round_idx: int, metrics: dict[str, float]) -> None:
        shown.update({k: v for k, v in metrics.items() if k in LIVE_KEYS})
        now = time.monotonic()
        if round_idx < total and now - last[0] < every_s:
            return
        last[0] = now
        done = max(round_idx, 1)
        eta = (now - start) / done * (total - round_idx)
        out.print(f"round {round_idx}/{total} ({100 * round_idx // total} %)  {_metrics_text(shown, 200)}"
                  f"  ETA {eta:.0f} s", soft_wrap=True, highlight=False)

    return update


def _metrics_text(shown: Mapping[str, float], width: int) -> str:
    """The live metrics, most important first, cut to whole items that fit `width` characters."""
    parts: list[str] = []
    used = 0
    for key, label in LIVE_KEYS.items():
        if key in shown:
            item = f"{label} {shown[key]:.4g}"
            if used + len(item) + 2 > max(width, 12) and parts:
                break
            parts.append(item)
            used += len(item) + 2
    return "  ".join(parts)


LIVE_KEYS = {"eval/accuracy": "acc", "eval/dist_to_opt": "dist", "time/round_s": "s/round", "eval/loss": "eval_loss",
             "train/loss": "train_loss"}


def summarise_run(cfg: RunConfig, result: RunResult) -> None:
    """Print the end-of-run summary: final metrics, where the run is stored, what to run next."""
    from fedcli.tracking.urls import mask_url

    out = console()
    metrics = result.final_metrics
    shown = [f"{k}={metrics[k]:.4f}" for k in ("eval/accuracy", "eval/loss", "eval/dist_to_opt") if k in metrics]
    split = result.timing.per_round()
    # the training time (issue 27): the rounds' own seconds (time/cum_train_s, resumed runs included), not
    # the process's set-up or its MLflow mirror's waits, which the second figure adds
    trained = metrics.get("time/cum_train_s")
    took = f"in {result.wall_s:.1f}s" if trained is None else \
        f"in {trained:.1f}s of training ({result.wall_s:.1f}s with set-up and tracking)"
    out.print(f"[bold green]run {result.run_id[:8]} finished[/] after {result.rounds_completed} rounds "
              f"{took} ({result.executor} executor): " + "  ".join(shown))
    out.print("per round: " + "  ".join(f"{k} {v * 1000:.0f} ms" for k, v in split.items()))
    out.print(f"store:   {mask_url(cfg.tracking.store_url)}", soft_wrap=True)
    if result.model_path:
        out.print(f"model:   {Path(result.model_path).resolve()}", soft_wrap=True)
    fedcli, where = command_name(), store_options(cfg)
    if cfg.tracking.use_mlflow:
        out.print(f"browse:  {fedcli} ui{where}", soft_wrap=True)
    out.print(f"report:  {fedcli} report --runs {result.run_id[:8]}{where} --output report.md", soft_wrap=True)
    if fedcli != "fedcli":
        out.print(f"(or put {Path(fedcli).parent} on PATH: export PATH=\"{Path(fedcli).parent}:$PATH\")",
                  soft_wrap=True)


def stdout_is_terminal() -> bool:
    return sys.stdout.isatty()


def resolve(path: Path | None) -> str | None:
    return None if path is None else str(path.resolve())
