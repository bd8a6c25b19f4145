"""The run part of `fedcli train` (fedcli/cli/train.py parses the options into a `TrainOptions`): the
stop signals, the torchrun ranks, the config (`resolve_config`), the prepared run, the progress bar,
the printed lines and the exit codes (128 + the signal of a stop).
"""

from __future__ import annotations

import contextlib
import sys

import typer

from fedcli.cli.common import resume_hint, store_options, summarise_run
from fedcli.cli.errors import user_errors
from fedcli.errors import ConfigError
from fedcli.runs.progress import console, train_progress
from fedcli.runs.request import TrainOptions
from fedcli.runs.run import StoppedBeforeStart, prepared_run, resolve_config


def run_training(
    ctx: typer.Context,
    options: TrainOptions,
    *,
    config: str | None,
    hp: list[str] | None,
    resume: str | None,
    trust_code: bool,
    mlflow_optional: bool,
    parent_run: str | None,
    distributed_executor: bool,
) -> None:
    """Train the run `fedcli train`'s options describe (`--executor distributed`: `distributed_executor`).

    Raises:
        typer.Exit: 2 on bad input (one line), 128 + the signal when stopped.
    """
    from fedcli.engine.lifecycle import GracefulSignals

    signals = GracefulSignals(immediate=True)  # the set-up writes nothing: a signal there stops it at once
    signals.install()
    try:  # restored last, after the run id is printed: a signal once the run ended changes nothing
        with user_errors(bool(ctx.obj and ctx.obj.get("debug"))), contextlib.ExitStack() as group:
            try:  # the imports too: a signal while they load (the first second) is a stop in the set-up
                from fedcli.config.checks import parse_assignments
                from fedcli.engine import distributed
                from fedcli.engine.train import serve

                peers = group.enter_context(distributed.process_group()) if distributed_executor else None
                if (
                    peers is not None and not peers.is_leader
                ):  # ranks 1..K-1 train slices of rank 0's run, write nothing
                    signals.restore()  # serve sets what the ranks do with signals
                    serve(peers)
                    return
                cfg, resume_id = resolve_config(
                    options,
                    config=config,
                    hp=parse_assignments(hp or [], "--hp"),
                    resume=resume,
                    warn=lambda line: console().print(f"warning: {line}", markup=False, soft_wrap=True),
                    trust_code=trust_code,
                )
                if cfg.train.executor == "distributed" and peers is None:  # from --config or the resumed run
                    raise ConfigError(
                        f"train.executor='distributed' needs `--executor distributed` on the command "
                        f"line. {distributed.NOT_LAUNCHED}"
                    )
                # the id on stdout as soon as the run exists (a script gets it even if the run is then stopped);
                # on a terminal at the end instead, where it would land on the live progress bar
                on_terminal = sys.stdout.isatty()
                prepared = group.enter_context(
                    prepared_run(
                        cfg,
                        resume_run_id=resume_id,
                        parent_run=parent_run,
                        mlflow_optional=mlflow_optional,
                        signals=signals,
                        peers=peers,
                        on_run=None if on_terminal else typer.echo,
                    )
                )
            except (
                BaseException
            ) as exc:  # a stop signal in the set-up (options, data, executor): nothing written
                if signals.pending is None or isinstance(exc, typer.Exit):
                    raise
                console().print(str(StoppedBeforeStart(signals.pending)))
                raise typer.Exit(128 + signals.pending) from None
            quiet = bool(ctx.obj and ctx.obj.get("quiet"))
            try:
                with train_progress(cfg, quiet=quiet) as progress:
                    result = prepared.run(progress)
            except KeyboardInterrupt as stop:
                stopped(cfg, prepared.run_id, stop)
            except distributed.RankLost as lost:
                raise distributed.lost_hint(
                    lost, prepared.run_id, peers.world_size if peers else 1, store_options(cfg)
                ) from None
            if not quiet:  # -q: warnings and errors only
                summarise_run(cfg, result)
            if on_terminal:
                typer.echo(result.run_id)
    finally:
        signals.restore()


def stopped(cfg: object, run_id: str | None, stop: KeyboardInterrupt) -> None:
    """Say how the run ended and how to continue it; exit 128 + the signal (130 for Ctrl-C). A stop
    after the set-up but before the run was created in the store (the engine's first safe point)
    says so, like a stop in the set-up: before, it exited 143 without a line."""
    code = getattr(stop, "exit_code", 130)
    if run_id:
        console().print(
            f"run {run_id[:8]} interrupted; its last completed round is checkpointed. "
            f"Continue it with: {resume_hint(cfg, run_id)}",
            soft_wrap=True,
        )  # one pasteable line
    else:
        console().print(str(StoppedBeforeStart(code - 128)))
    raise typer.Exit(code)
