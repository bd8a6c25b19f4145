"""`fedcli train`: train one algorithm on one task, logging every round.

Longer than the 150-line budget of docs/style.md rule 1 because the option list is the
user-facing contract of docs/architecture.md §9 (every option with its help and default). The body
builds the typed request (`TrainOptions`, fedcli/runs/request.py) from the options that set a config
key and hands it to fedcli/cli/train_run.py, a thin layer over the Python API's run path
(fedcli/runs/run.py: `resolve_config`, `prepared_run`, shared with `fedcli.train`) that adds the
progress bar, the printed lines and the exit codes.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from fedcli.cli.common import DataStore, Panel, Scheme
from fedcli.cli.train_run import run_training
from fedcli.runs.request import TrainOptions


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
    algo: Annotated[
        str | None,
        typer.Option(help="Algorithm (`fedcli list algos`). \\[default: fedavg]", rich_help_panel=Panel.ALGO),
    ] = None,
    task: Annotated[
        str | None,
        typer.Option(help="Task (`fedcli list tasks`). \\[default: femnist]", rich_help_panel=Panel.DATA),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="Model: a name of the task's (`fedcli list tasks`) or of an installed plugin (`fedcli list models`), "
            "or your own nn.Module factory as path/to/file.py:factory or pkg.module:factory "
            "(docs/bring-your-own.md). \\[default: the task's default]",
            rich_help_panel=Panel.DATA,
        ),
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="Folder with the task's data files. \\[default: bundled copy]", rich_help_panel=Panel.DATA
        ),
    ] = None,
    data: Annotated[
        str | None,
        typer.Option(
            help="Bring your own data: .npz (x, y[, client, x_test, y_test]) or "
            ".csv/.parquet (column y, optional client and split, the rest "
            "features), or pkg.module:function / file.py:function returning a "
            "torch or Hugging Face dataset (docs/your-data.md).",
            rich_help_panel=Panel.DATA,
        ),
    ] = None,
    download: Annotated[
        bool,
        typer.Option(
            "--download", help="Download missing public data files (network).", rich_help_panel=Panel.DATA
        ),
    ] = False,
    max_clients: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Read only the first N natural clients of big data sets (StackOverflow).",
            rich_help_panel=Panel.DATA,
        ),
    ] = None,
    data_store: Annotated[
        DataStore | None,
        typer.Option(
            help="Where the examples live: memory (on the device), "
            "disk (a memory-mapped store, cohorts read per round) or "
            "auto (disk above 1 GiB; docs/scaling.md). "
            "\\[default: auto]",
            rich_help_panel=Panel.DATA,
        ),
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(
            metavar="FILE|NAME",
            help="Run config: a YAML file, or a config shipped with fedcli "
            "(demo: `make demo`'s run); options override it.",
        ),
    ] = None,
    partition: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            resolve_path=True,
            help="Partition file from `fedcli partition`.",
            rich_help_panel=Panel.DATA,
        ),
    ] = None,
    scheme: Annotated[
        Scheme | None, typer.Option(help="Partition scheme. \\[default: natural]", rich_help_panel=Panel.DATA)
    ] = None,
    alpha: Annotated[
        float | None,
        typer.Option(help="Dirichlet concentration (smaller = more skew).", rich_help_panel=Panel.DATA),
    ] = None,
    clients: Annotated[
        int | None,
        typer.Option(
            min=1, help="Number of clients. \\[default: all natural clients]", rich_help_panel=Panel.DATA
        ),
    ] = None,
    shards_per_client: Annotated[
        int | None,
        typer.Option(min=1, help="Shards per client (--scheme shards).", rich_help_panel=Panel.DATA),
    ] = None,
    labels_per_client: Annotated[
        int | None,
        typer.Option(min=1, help="Labels per client (--scheme labels).", rich_help_panel=Panel.DATA),
    ] = None,
    min_size: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Redraw until every client has this many examples "
            "(dirichlet, quantity, two-level). \\[default: 10]",
            rich_help_panel=Panel.DATA,
        ),
    ] = None,
    balanced: Annotated[
        bool,
        typer.Option(
            "--balanced",
            help="dirichlet: equal client sizes (FedLab's balanced variant).",
            rich_help_panel=Panel.DATA,
        ),
    ] = False,
    sigma: Annotated[
        float | None,
        typer.Option(min=0.0, help="quantity: log-normal sigma of client sizes.", rich_help_panel=Panel.DATA),
    ] = None,
    size_alpha: Annotated[
        float | None,
        typer.Option(
            help="two-level: Dirichlet concentration of client sizes. \\[default: 1.0]",
            rich_help_panel=Panel.DATA,
        ),
    ] = None,
    rounds: Annotated[
        int | None,
        typer.Option(min=1, help="Communication rounds R. \\[default: 50]", rich_help_panel=Panel.TRAIN),
    ] = None,
    clients_per_round: Annotated[
        int | None,
        typer.Option(min=1, help="Clients sampled per round M. \\[default: 10]", rich_help_panel=Panel.TRAIN),
    ] = None,
    local_epochs: Annotated[
        int | None,
        typer.Option(min=1, help="Local epochs E per round. \\[default: 1]", rich_help_panel=Panel.TRAIN),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            min=1, help="Local minibatch size B (examples). \\[default: 20]", rich_help_panel=Panel.TRAIN
        ),
    ] = None,
    client_lr: Annotated[
        float | None,
        typer.Option(
            help="Client learning rate. \\[default: the task's, 0.1 on femnist "
            "and mnist, 0.01 elsewhere; `fedcli list tasks` shows it]",
            rich_help_panel=Panel.TRAIN,
        ),
    ] = None,
    client_momentum: Annotated[
        float | None, typer.Option(help="Client SGD momentum. \\[default: 0.0]", rich_help_panel=Panel.TRAIN)
    ] = None,
    server_opt: Annotated[
        ServerOpt | None,
        typer.Option(
            help="Server optimiser on the mean delta. \\[default: sgd]", rich_help_panel=Panel.TRAIN
        ),
    ] = None,
    server_lr: Annotated[
        float | None, typer.Option(help="Server learning rate. \\[default: 1.0]", rich_help_panel=Panel.TRAIN)
    ] = None,
    server_momentum: Annotated[
        float | None,
        typer.Option(help="Momentum of --server-opt momentum. \\[default: 0.9]", rich_help_panel=Panel.TRAIN),
    ] = None,
    hp: Annotated[
        list[str] | None,
        typer.Option(
            "--hp",
            metavar="KEY=VALUE",
            help="Algorithm hyperparameter (repeatable); see `fedcli list algos`.",
            rich_help_panel=Panel.ALGO,
        ),
    ] = None,
    seed: Annotated[
        int | None, typer.Option(min=0, help="Root seed of every random stream. \\[default: 0]")
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(help="auto | cpu | cuda | cuda:N | mps. \\[default: auto]", rich_help_panel=Panel.TRAIN),
    ] = None,
    executor: Annotated[
        Executor | None,
        typer.Option(
            help="Client executor: loop | vmap | fused (hand-derived "
            "cohort SGD for dense classifiers) | process (cohort "
            "split over CPU processes) | distributed (one run over "
            "torchrun's ranks: torchrun --nproc-per-node K -m fedcli "
            "train ... --executor distributed); auto picks the "
            "fastest and says which.",
            rich_help_panel=Panel.TRAIN,
        ),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Processes training clients (--executor process), this one included. \\[default: CPU cores]",
            rich_help_panel=Panel.TRAIN,
        ),
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Intra-op threads of the training process (recorded). "
            "\\[default: the CPUs this process may use: affinity and "
            "cgroup quota]",
            rich_help_panel=Panel.TRAIN,
        ),
    ] = None,
    compile: Annotated[
        bool,
        typer.Option(
            "--compile",
            help="torch.compile: with vmap the cohort's update (slow "
            "first round), with loop/process each client's step "
            "(seconds); time logged, cache reused.",
            rich_help_panel=Panel.TRAIN,
        ),
    ] = False,
    graph: Annotated[
        bool,
        typer.Option(
            "--graph",
            help="Build the vmapped cohort update once per shape into one "
            "program replayed every round: a CUDA graph on a GPU, a traced "
            "ATen graph on a CPU (first round slower; time logged).",
            rich_help_panel=Panel.TRAIN,
        ),
    ] = False,
    precision: Annotated[
        Precision | None,
        typer.Option(
            help="fp32 | tf32 (CUDA) | bf16 (autocast); recorded in the run config. \\[default: fp32]",
            rich_help_panel=Panel.TRAIN,
        ),
    ] = None,
    cohort_chunk: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="vmap at most this many clients at once, grouped by length "
            "(bounds memory; saves padding on uneven clients).",
            rich_help_panel=Panel.TRAIN,
        ),
    ] = None,
    eval_every: Annotated[
        int | None,
        typer.Option(
            min=1, help="Evaluate every K rounds (and the last). \\[default: 1]", rich_help_panel=Panel.TRAIN
        ),
    ] = None,
    eval_sample: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Evaluate on a fixed sample of N test examples (the "
            "same every round and on resume; recorded); 0 = the whole test "
            "split. \\[default: the task's paper setting: 10,000 on "
            "stackoverflow-*, else 0]",
            rich_help_panel=Panel.TRAIN,
        ),
    ] = None,
    checkpoint_every: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Checkpoint every K rounds; 0 = only at the end "
            "and when stopped. \\[default: auto: every round while that "
            "costs <= 3 % of a round]",
            rich_help_panel=Panel.TRAIN,
        ),
    ] = None,
    keep_checkpoints: Annotated[
        int | None,
        typer.Option(
            min=1, help="Newest checkpoints kept per run. \\[default: 3]", rich_help_panel=Panel.TRAIN
        ),
    ] = None,
    state_store: Annotated[
        str | None,
        typer.Option(
            help="Per-client state (SCAFFOLD, FedDyn, ADMM duals): ram | "
            "disk (memory-bounded files under the run) | auto: disk when "
            "all clients' states exceed --state-cache-mb. \\[default: auto]",
            rich_help_panel=Panel.TRAIN,
        ),
    ] = None,
    state_cache_mb: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Disk state store: MiB of client states kept in "
            "RAM (LRU; the cohort's always). \\[default: 512]",
            rich_help_panel=Panel.TRAIN,
        ),
    ] = None,
    state_precision: Annotated[
        str | None,
        typer.Option(
            help="How client states are stored: state (their dtype) | "
            "bf16 | fp16 (half the bytes; recorded with the run). "
            "\\[default: state]",
            rich_help_panel=Panel.TRAIN,
        ),
    ] = None,
    bn_stats: Annotated[
        str | None,
        typer.Option(
            help="BatchNorm running statistics: aggregate (each client updates "
            "them as it trains; the server takes their example-weighted mean) "
            "| local (FedBN: each client keeps its own; evaluation uses their "
            "mean) | estimate (the server recomputes them from 1,024 training "
            "examples before each evaluation; what algorithms with their own "
            "client update get). \\[default: aggregate]",
            rich_help_panel=Panel.TRAIN,
        ),
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option(help="Continue run RUN_ID from its last checkpoint.", rich_help_panel=Panel.TRACK),
    ] = None,
    trust_code: Annotated[
        bool,
        typer.Option(
            "--trust-code",
            help="--resume may import the model / data function "
            "code the run recorded (its sha256 must match); else name it again "
            "with --model / --data.",
            rich_help_panel=Panel.TRACK,
        ),
    ] = False,
    experiment: Annotated[
        str | None, typer.Option(help="Experiment name. \\[default: default]", rich_help_panel=Panel.TRACK)
    ] = None,
    run_name: Annotated[
        str | None, typer.Option(help="Run name. \\[default: algo-task-seed-id]", rich_help_panel=Panel.TRACK)
    ] = None,
    root: Annotated[
        Path | None,
        typer.Option(
            help="Folder for stores, models, checkpoints. \\[default: ./fedcli-runs]",
            rich_help_panel=Panel.TRACK,
        ),
    ] = None,
    store: Annotated[
        str | None,
        typer.Option(
            help="SQLAlchemy URL of the results store. \\[env: FEDCLI_STORE]", rich_help_panel=Panel.TRACK
        ),
    ] = None,
    tracking_uri: Annotated[
        str | None,
        typer.Option(help="MLflow tracking URI. \\[env: MLFLOW_TRACKING_URI]", rich_help_panel=Panel.TRACK),
    ] = None,
    no_mlflow: Annotated[
        bool, typer.Option("--no-mlflow", help="Log to the SQL store only.", rich_help_panel=Panel.TRACK)
    ] = False,
    mlflow_optional: Annotated[
        bool,
        typer.Option(
            "--mlflow-optional",
            help="If MLflow cannot be reached, train with the SQL store only (warns) instead of stopping.",
            rich_help_panel=Panel.TRACK,
        ),
    ] = False,
    parent_run: Annotated[
        str | None, typer.Option(hidden=True, help="MLflow parent run (set by fedcli sweep).")
    ] = None,
) -> None:
    """Train one algorithm on one task, logging every round to MLflow and the SQL store.

    Example: fedcli train --algo fedpa --rounds 30 --local-epochs 5 --hp burn_in_rounds=10
    """
    if not no_mlflow and executor is not Executor.distributed:  # MLflow's import starts now, on an idle core
        from fedcli.tracking.mlflow.handle import spawn_early

        spawn_early()
    if data is not None:  # a file as an absolute path, a function reference as given (datasets/yours/data.py)
        from fedcli.datasets.yours.data import normalise

        data = normalise(data)
    options = TrainOptions(
        algo=algo,
        task=task,
        model=model,
        data_dir=data_dir,
        data=data,
        download=download,
        max_clients=max_clients,
        data_store=data_store,
        partition=partition,
        scheme=scheme,
        alpha=alpha,
        clients=clients,
        shards_per_client=shards_per_client,
        labels_per_client=labels_per_client,
        min_size=min_size,
        balanced=balanced,
        sigma=sigma,
        size_alpha=size_alpha,
        rounds=rounds,
        clients_per_round=clients_per_round,
        local_epochs=local_epochs,
        batch_size=batch_size,
        client_lr=client_lr,
        client_momentum=client_momentum,
        server_opt=server_opt,
        server_lr=server_lr,
        server_momentum=server_momentum,
        device=device,
        executor=executor,
        cohort_chunk=cohort_chunk,
        workers=workers,
        threads=threads,
        compile=compile,
        graph=graph,
        precision=precision,
        eval_every=eval_every,
        eval_sample=eval_sample,
        checkpoint_every=checkpoint_every,
        keep_checkpoints=keep_checkpoints,
        state_store=state_store,
        state_cache_mb=state_cache_mb,
        state_precision=state_precision,
        bn_stats=bn_stats,
        seed=seed,
        experiment=experiment,
        run_name=run_name,
        root=root,
        store=store,
        tracking_uri=tracking_uri,
        no_mlflow=no_mlflow,
    )  # the options that set a config key
    run_training(
        ctx,
        options,
        config=config,
        hp=hp,
        resume=resume,
        trust_code=trust_code,
        mlflow_optional=mlflow_optional,
        parent_run=parent_run,
        distributed_executor=executor is Executor.distributed,
    )
