"""Pieces shared by the commands: option choices, help panels, hints with the command line, the run summary."""

from __future__ import annotations

import shlex
import sys
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedcli.runs.progress import console
from fedcli.tracking.urls import mask_url

if TYPE_CHECKING:
    from fedcli.config.sections import RunConfig
    from fedcli.engine.train import RunResult


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


def command_name() -> str:
    """How to call fedcli again: `fedcli` when that is this program on PATH, else its full path.

    After `make demo`, `.venv/bin` is usually not on PATH, so a bare `fedcli …` hint would fail.
    """
    import shutil

    on_path = shutil.which("fedcli")
    here = (
        Path(sys.argv[0]).resolve()
        if sys.argv and sys.argv[0].endswith("fedcli")
        else Path(sys.executable).with_name("fedcli")
    )
    if on_path and Path(on_path).resolve() == here.resolve():
        return "fedcli"
    return str(here) if here.exists() else "fedcli"


def store_options(cfg: Any) -> str:
    """The options that point another command at this run's stores: `--store URL`, the SQL
    store's URL with an absolute path, also for the default root (`./fedcli-runs` is another
    folder wherever the hint is pasted), so every printed hint works pasted in any folder.

    A password in the URL is shown masked (`user:***@host`, docs/operations.md, "Security"):
    the hint then works as it is where FEDCLI_STORE holds the full URL, else the user puts the
    password back in.
    """

    url = cfg.tracking.store_url
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////") and url != "sqlite:///:memory:":
        url = f"sqlite:///{Path(url.removeprefix('sqlite:///')).resolve()}"  # `--store sqlite:///runs.db`
    return f" --store {shlex.quote(mask_url(url))}"  # every command that reads runs takes --store


def resume_hint(cfg: Any, run_id: str) -> str:
    """The command that continues `run_id`, with the store options it needs (a distributed run:
    under torchrun again, or in one process with another executor)."""
    resume = f"train --resume {run_id[:8]}{store_options(cfg)}"
    from fedcli.datasets.yours.trust import recorded_code

    for code in recorded_code(
        {"model": cfg.data.model, "file": cfg.data.file}
    ):  # named again: allowed to run
        resume += f" --{'model' if code.what == 'model' else 'data'} {shlex.quote(code.ref)}"
    if cfg.train.executor == "distributed":
        from fedcli.engine.distributed import launch_env

        return (
            f"torchrun --nproc-per-node {(launch_env() or (0, 2))[1]} -m fedcli {resume} --executor distributed "
            f"(or in one process: {command_name()} {resume} --executor auto)"
        )
    return f"{command_name()} {resume}"


def summarise_run(cfg: RunConfig, result: RunResult) -> None:
    """Print the end-of-run summary: final metrics, where the run is stored, what to run next."""

    out = console()
    metrics = result.final_metrics
    shown = [
        f"{k}={metrics[k]:.4f}" for k in ("eval/accuracy", "eval/loss", "eval/dist_to_opt") if k in metrics
    ]
    # the training time: the rounds' own seconds (time/cum_train_s, resumed runs included), not
    # the process's set-up or its MLflow mirror's waits, which the second figure adds
    trained = metrics.get("time/cum_train_s")
    took = (
        f"in {result.wall_s:.1f}s"
        if trained is None
        else f"in {trained:.1f}s of training ({result.wall_s:.1f}s with set-up and tracking)"
    )
    out.print(
        f"[bold green]run {result.run_id[:8]} finished[/] after {result.rounds_completed} rounds "
        f"{took} ({result.executor} executor): " + "  ".join(shown)
    )
    out.print(
        "per round: " + "  ".join(f"{k} {v * 1000:.0f} ms" for k, v in result.timing.per_round().items())
    )
    out.print(f"store:   {mask_url(cfg.tracking.store_url)}", soft_wrap=True)
    if result.model_path:
        out.print(f"model:   {Path(result.model_path).resolve()}", soft_wrap=True)
    fedcli, where = command_name(), store_options(cfg)
    if cfg.tracking.use_mlflow:
        out.print(f"browse:  {fedcli} ui{where}", soft_wrap=True)
    out.print(
        f"report:  {fedcli} report --runs {result.run_id[:8]}{where} --output report.md", soft_wrap=True
    )
    if fedcli != "fedcli":
        out.print(
            f'(or put {Path(fedcli).parent} on PATH: export PATH="{Path(fedcli).parent}:$PATH")',
            soft_wrap=True,
        )
