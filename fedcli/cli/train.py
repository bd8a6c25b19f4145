"""`fedcli train`: train one algorithm on one task, logging every round.

Longer than the 150-line budget of docs/style.md rule 1 because the option list is the
user-facing contract of docs/architecture.md §9 (every option with its help and default); the body
itself stays a few lines: build the config, open the tracker, call the engine, summarise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from fedcli.cli.common import (
    Panel,
    Scheme,
    check_mlflow,
    find_run,
    open_tracker,
    spawn_mirror,
    stdout_is_terminal,
    store_options,
    summarise_run,
    train_progress,
)
from fedcli.cli.errors import user_errors


class ServerOpt(str, Enum):
    sgd = "sgd"
    momentum = "momentum"
    adam = "adam"
    adagrad = "adagrad"
    yogi = "yogi"


class Executor(str, Enum):
    auto = "auto"
    loop = "loop"
    vmap = "vmap"
    fused = "fused"
    process = "process"
    distributed = "distributed"


class Precision(str, Enum):
    fp32 = "fp32"
    tf32 = "tf32"
    bf16 = "bf16"


def train(
    ctx: typer.Context,
    algo: Annotated[str | None, typer.Option(help="Algorithm (`fedcli list algos`). \\[default: fedavg]",
                                             rich_help_panel=Panel.ALGO)] = None,
    task: Annotated[str | None, typer.Option(help="Task (`fedcli list tasks`). \\[default: femnist]",
                                             rich_help_panel=Panel.DATA)] = None,
    model: Annotated[str | None, typer.Option(help="Model of the task. \\[default: the task's default]",
                                              rich_help_panel=Panel.DATA)] = None,
    data_dir: Annotated[Path | None, typer.Option(help="Folder with the task's data files. \\[default: bundled copy]",
                                                  rich_help_panel=Panel.DATA)] = None,
    data: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, resolve_path=True,
                                              help="Bring your own data: .npz (x, y[, client, x_test, y_test]) or "
                                                   ".csv/.parquet (column y, optional client and split, the rest "
                                                   "features); with --model linear|logreg|mlp|cnn.",
                                              rich_help_panel=Panel.DATA)] = None,
    download: Annotated[bool, typer.Option("--download", help="Download missing public data files (network).",
                                           rich_help_panel=Panel.DATA)] = False,
    max_clients: Annotated[int | None, typer.Option(min=1, help="Read only the first N natural clients of big "
                                                               "data sets (StackOverflow).",
                                                    rich_help_panel=Panel.DATA)] = None,
    config: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, resolve_path=True,
                                                help="Run config (YAML); CLI options override it.")] = None,
    partition: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, resolve_path=True,
                                                   help="Partition file from `fedcli partition`.",
                                                   rich_help_panel=Panel.DATA)] = None,
    scheme: Annotated[Scheme | None, typer.Option(help="Partition scheme. \\[default: natural]",
                                                  rich_help_panel=Panel.DATA)] = None,
    alpha: Annotated[float | None, typer.Option(help="Dirichlet concentration (smaller = more skew).",
                                                rich_help_panel=Panel.DATA)] = None,
    clients: Annotated[int | None, typer.Option(min=1, help="Number of clients. \\[default: all natural clients]",
                                                rich_help_panel=Panel.DATA)] = None,
    shards_per_client: Annotated[int | None, typer.Option(min=1, help="Shards per client (--scheme shards).",
                                                          rich_help_panel=Panel.DATA)] = None,
    labels_per_client: Annotated[int | None, typer.Option(min=1, help="Labels per client (--scheme labels).",
                                                          rich_help_panel=Panel.DATA)] = None,
    min_size: Annotated[int | None, typer.Option(min=1, help="Redraw until every client has this many examples "
                                                 "(dirichlet, quantity, two-level). \\[default: 10]",
                                                 rich_help_panel=Panel.DATA)] = None,
    balanced: Annotated[bool, typer.Option("--balanced", help="dirichlet: equal client sizes (FedLab's balanced "
                                           "variant).", rich_help_panel=Panel.DATA)] = False,
    sigma: Annotated[float | None, typer.Option(min=0.0, help="quantity: log-normal sigma of client sizes.",
                                                rich_help_panel=Panel.DATA)] = None,
    size_alpha: Annotated[float | None, typer.Option(help="two-level: Dirichlet concentration of client sizes. "
                                                     "\\[default: 1.0]", rich_help_panel=Panel.DATA)] = None,
    rounds: Annotated[int | None, typer.Option(min=1, help="Communication rounds R. \\[default: 50]",
                                               rich_help_panel=Panel.TRAIN)] = None,
    clients_per_round: Annotated[int | None, typer.Option(min=1, help="Clients sampled per round M. \\[default: 10]",
                                                          rich_help_panel=Panel.TRAIN)] = None,
    local_epochs: Annotated[int | None, typer.Option(min=1, help="Local epochs E per round. \\[default: 1]",
                                                     rich_help_panel=Panel.TRAIN)] = None,
    batch_size: Annotated[int | None, typer.Option(min=1, help="Local minibatch size B (examples). \\[default: 20]",
                                                   rich_help_panel=Panel.TRAIN)] = None,
    client_lr: Annotated[float | None, typer.Option(help="Client learning rate. \\[default: the task's, 0.1 on femnist "
                                                         "and mnist, 0.01 elsewhere; `fedcli list tasks` shows it]",
                                                    rich_help_panel=Panel.TRAIN)] = None,
    client_momentum: Annotated[float | None, typer.Option(help="Client SGD momentum. \\[default: 0.0]",
                                                          rich_help_panel=Panel.TRAIN)] = None,
    server_opt: Annotated[ServerOpt | None, typer.Option(help="Server optimiser on the mean delta. \\[default: sgd]",
                                                         rich_help_panel=Panel.TRAIN)] = None,
    server_lr: Annotated[float | None, typer.Option(help="Server learning rate. \\[default: 1.0]",
                                                    rich_help_panel=Panel.TRAIN)] = None,
    server_momentum: Annotated[float | None, typer.Option(help="Momentum of --server-opt momentum. \\[default: 0.9]",
                                                          rich_help_panel=Panel.TRAIN)] = None,
    hp: Annotated[list[str] | None, typer.Option("--hp", metavar="KEY=VALUE",
                                                 help="Algorithm hyperparameter (repeatable); see `fedcli list algos`.",
                                                 rich_help_panel=Panel.ALGO)] = None,
    seed: Annotated[int | None, typer.Option(min=0, help="Root seed of every random stream. \\[default: 0]")] = None,
    device: Annotated[str | None, typer.Option(help="auto | cpu | cuda | cuda:N | mps. \\[default: auto]",
                                               rich_help_panel=Panel.TRAIN)] = None,
    executor: Annotated[Executor | None, typer.Option(help="Client executor: loop | vmap | fused (hand-derived "
                                                           "cohort SGD for dense classifiers) | process (cohort "
                                                           "split over CPU processes) | distributed (one run over "
                                                           "torchrun's ranks: torchrun --nproc-per-node K -m fedcli "
                                                           "train ... --executor distributed); auto picks the "
                                                           "fastest and says which.", rich_help_panel=Panel.TRAIN)] = None,
    workers: Annotated[int | None, typer.Option(min=1, help="Processes training clients (--executor process), "
                                                            "this one included. \\[default: CPU cores]",
                                                rich_help_panel=Panel.TRAIN)] = None,
    threads: Annotated[int | None, typer.Option(min=1, help="Intra-op threads of the training process (recorded). "
                                                           "\\[default: the CPUs this process may use: affinity and "
                                                           "cgroup quota]", rich_help_panel=Panel.TRAIN)] = None,
    compile: Annotated[bool, typer.Option("--compile", help="torch.compile: with vmap the cohort's update (slow "
                                                           "first round), with loop/process each client's step "
                                                           "(seconds); time logged, cache reused.",
                                          rich_help_panel=Panel.TRAIN)] = False,
    graph: Annotated[bool, typer.Option("--graph", help="Build the vmapped cohort update once per shape into one "
                                                       "program replayed every round: a CUDA graph on a GPU, a traced "
                                                       "ATen graph on a CPU (first round slower; time logged).",
                                        rich_help_panel=Panel.TRAIN)] = False,
    precision: Annotated[Precision | None, typer.Option(help="fp32 | tf32 (CUDA) | bf16 (autocast); recorded in "
                                                             "the run config. \\[default: fp32]",
                                                        rich_help_panel=Panel.TRAIN)] = None,
    cohort_chunk: Annotated[int | None, typer.Option(min=1, help="vmap at most this many clients at once, grouped by length "
                                                      "(bounds memory; saves padding on uneven clients).",
                                                     rich_help_panel=Panel.TRAIN)] = None,
    eval_every: Annotated[int | None, typer.Option(min=1, help="Evaluate every K rounds (and the last). \\[default: 1]",
                                                   rich_help_panel=Panel.TRAIN)] = None,
    checkpoint_every: Annotated[int | None, typer.Option(min=0, help="Checkpoint every K rounds; 0 = only at the end "
                                                         "and when stopped. \\[default: auto: every round while that "
                                                         "costs <= 3 % of a round]",
                                                         rich_help_panel=Panel.TRAIN)] = None,
    keep_checkpoints: Annotated[int | None, typer.Option(min=1, help="Newest checkpoints kept per run. \\[default: 3]",
                                                         rich_help_panel=Panel.TRAIN)] = None,
    resume: Annotated[str | None, typer.Option(help="Continue run RUN_ID from its last checkpoint.",
                                               rich_help_panel=Panel.TRACK)] = None,
    experiment: Annotated[str | None, typer.Option(help="Experiment name. \\[default: default]",
                                                   rich_help_panel=Panel.TRACK)] = None,
    run_name: Annotated[str | None, typer.Option(help="Run name. \\[default: algo-task-seed-id]",
                                                 rich_help_panel=Panel.TRACK)] = None,
    root: Annotated[Path | None, typer.Option(help="Folder for stores, models, checkpoints. \\[default: ./fedcli-runs]",
                                              rich_help_panel=Panel.TRACK)] = None,
    store: Annotated[str | None, typer.Option(help="SQLAlchemy URL of the results store. \\[env: FEDCLI_STORE]",
                                              rich_help_panel=Panel.TRACK)] = None,
    tracking_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI. \\[env: MLFLOW_TRACKING_URI]",
                                                     rich_help_panel=Panel.TRACK)] = None,
    no_mlflow: Annotated[bool, typer.Option("--no-mlflow", help="Log to the SQL store only.",
                                            rich_help_panel=Panel.TRACK)] = False,
    mlflow_optional: Annotated[bool, typer.Option("--mlflow-optional", help="If MLflow cannot be reached, train with "
                                                  "the SQL store only (warns) instead of stopping.",
                                                  rich_help_panel=Panel.TRACK)] = False,
    parent_run: Annotated[str | None, typer.Option(hidden=True, help="MLflow parent run (set by fedcli sweep).")] = None,
) -> None:
    """Train one algorithm on one task, logging every round to MLflow and the SQL store.

    Example: fedcli train --algo fedpa --rounds 30 --local-epochs 5 --hp burn_in_rounds=10
    """
    import dataclasses

    from fedcli.engine.lifecycle import GracefulSignals

    signals = GracefulSignals(immediate=True)  # the set-up writes nothing: a signal there stops it at once
    signals.install()
    try:  # restored last, after the run id is printed: a signal once the run ended changes nothing
        debug = bool(ctx.obj and ctx.obj.get("debug"))
        with user_errors(debug), contextlib.ExitStack() as group, stops_in_set_up(signals) as set_up:
            from fedcli.cli.common import console
            from fedcli.config import build_config, parse_assignments, resume_config, warn_degenerate
            from fedcli.engine import distributed
            from fedcli.engine.setup import build
            from fedcli.engine.train import serve
            from fedcli.engine.train import train as run_training
            from fedcli.errors import ConfigError

            peers = group.enter_context(distributed.process_group()) if executor is Executor.distributed else None
            if peers is not None and not peers.is_leader:  # ranks 1..K-1 train slices of rank 0's run, write nothing
                signals.restore()  # serve sets what the ranks do with signals
                serve(peers)
                return
            overrides = {
                "algorithm.name": algo, "data.task": task, "data.model": model, "data.data_dir": data_dir and str(data_dir),
                "partition.file": partition and str(partition), "partition.scheme": scheme and scheme.value,
                "partition.alpha": alpha, "partition.num_clients": clients,
                "partition.shards_per_client": shards_per_client, "partition.labels_per_client": labels_per_client,
                "partition.min_size": min_size, "partition.balanced": balanced or None, "partition.sigma": sigma,
                "partition.size_alpha": size_alpha,
                "data.file": data and str(data), "data.download": download or None, "data.max_clients": max_clients, "train.rounds": rounds,
                "train.clients_per_round": clients_per_round, "train.local_epochs": local_epochs,
                "train.batch_size": batch_size, "train.client_lr": client_lr, "train.client_momentum": client_momentum,
                "train.server_opt": server_opt and server_opt.value, "train.server_lr": server_lr,
                "train.server_momentum": server_momentum, "train.device": device,
                "train.executor": executor and executor.value, "train.cohort_chunk": cohort_chunk,
                "train.workers": workers, "train.threads": threads, "train.compile": compile or None, "train.graph": graph or None, "train.precision": precision and precision.value,
                "train.eval_every": eval_every, "train.checkpoint_every": checkpoint_every,
                "train.keep_checkpoints": keep_checkpoints, "seed": seed,
                "tracking.experiment": experiment, "tracking.run_name": run_name, "tracking.root": root and str(root),
                "tracking.store": store, "tracking.tracking_uri": tracking_uri, "tracking.use_mlflow": False if no_mlflow else None,
            }
            resume_id = None
            if resume:
                record = find_run(resume, overrides)
                cfg, resume_id = resume_config(record.requested or record.config, overrides), record.id
            else:
                cfg = build_config(file=config, overrides=overrides, hp=parse_assignments(hp or [], "--hp"))
                for line in warn_degenerate([cfg]):  # issue 24: a config that makes the algorithm another one
                    console().print(f"warning: {line}", markup=False, soft_wrap=True)
            # everything is validated before anything is written: options, MLflow, then the data
            if cfg.train.executor == "distributed" and peers is None:  # from --config or the resumed run
                raise ConfigError(f"train.executor='distributed' needs `--executor distributed` on the command line. "
                                  f"{distributed.NOT_LAUNCHED}")
            cfg = dataclasses.replace(cfg, tracking=check_mlflow(cfg.tracking, mlflow_optional))
            set_up.mirror = mirror = spawn_mirror(cfg.tracking, parent_run)  # imports MLflow while the data loads
            if mirror is not None:  # a stop signal cuts the waits for MLflow short (its set-up, the last copy)
                mirror.stopping = lambda: signals.pending is not None
            setup = build(cfg, peers=peers)
            signals.defer()  # the store is written from here on: a signal stops the run at its next safe point
            set_up.done = True
            tracker = open_tracker(cfg.tracking, mirror)
            # the id on stdout as soon as the run exists (a script gets it even if the run is then stopped);
            # on a terminal at the end instead, where it would land on the live progress bar
            on_terminal = stdout_is_terminal()
            tracker.on_run = None if on_terminal else typer.echo
            quiet = bool(ctx.obj and ctx.obj.get("quiet"))
            try:
                with train_progress(cfg, quiet=quiet) as progress:
                    result = run_training(cfg, tracker=tracker, progress=progress, resume_run_id=resume_id, setup=setup,
                                          signals=signals)
            except KeyboardInterrupt as stop:
                stopped(cfg, tracker, stop)
            except distributed.RankLost as lost:
                raise distributed.lost_hint(lost, getattr(tracker, "_run_id", None), peers.world_size if peers else 1,
                                            store_options(cfg)) from None
            if not quiet:  # -q: warnings and errors only
                summarise_run(cfg, result)
            if on_terminal:
                typer.echo(result.run_id)
    finally:
        signals.restore()


class SetUp:
    """What `stops_in_set_up` needs to know: the spawned MLflow mirror, and whether the set-up ended."""

    mirror: object = None
    done = False


@contextlib.contextmanager
def stops_in_set_up(signals: object) -> Iterator[SetUp]:
    """A stop signal before the run is written (options, data, executor set-up) ends the command with
    one line and exit 128 + the signal, whatever exception it surfaced as; a failed set-up ends the
    spawned MLflow mirror (it has written nothing)."""
    from fedcli.cli.common import console

    state = SetUp()
    try:
        yield state
    except BaseException as exc:
        if state.done:
            raise
        if state.mirror is not None:
            state.mirror.abort()  # type: ignore[attr-defined]
        pending = getattr(signals, "pending", None)
        if pending is None or isinstance(exc, typer.Exit):
            raise
        import signal

        console().print(f"stopped by {signal.Signals(pending).name} before the run started; nothing was written.")
        raise typer.Exit(128 + pending) from None


def stopped(cfg: object, tracker: object, stop: KeyboardInterrupt) -> None:
    """Say how the run ended and how to continue it; exit 128 + the signal (130 for Ctrl-C)."""
    from fedcli.cli.common import console, resume_hint

    run_id = getattr(tracker, "_run_id", None)
    code = getattr(stop, "exit_code", 130)
    if run_id:
        console().print(f"run {run_id[:8]} interrupted; its last completed round is checkpointed. "
                        f"Continue it with: {resume_hint(cfg, run_id)}", soft_wrap=True)  # one pasteable line
    raise typer.Exit(code)
