"""`fedcli evaluate`: metrics, calibration and the per-client view of a run's stored global model.

A little over the 150-line budget of docs/style.md rule 1: the options are the contract of
docs/architecture.md §9 (plus --task, --seed, --device, --tracking-uri, --no-mlflow); the command body
stays short and the work is in `fedcli.engine.evaluation`.
"""

from __future__ import annotations

import json
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from fedcli.cli.common import DataStore, Panel
from fedcli.cli.errors import user_errors
from fedcli.errors import CheckpointError, ConfigError
from fedcli.runs.progress import console
from fedcli.runs.stores import open_store, tracking_config

SAMPLES = 16  # default K of --predictive ensemble


class Split(str, Enum):
    test = "test"
    train = "train"


class Predictive(str, Enum):
    mean = "mean"
    ensemble = "ensemble"


def evaluate(
    ctx: typer.Context,
    run: Annotated[str, typer.Argument(help="Run id, unique id prefix, run name or MLflow run id.")],
    checkpoint: Annotated[
        int | None,
        typer.Option(min=0, help="Evaluate the checkpoint of this round. \\[default: final model]"),
    ] = None,
    task: Annotated[
        str | None,
        typer.Option(
            help="Evaluate on this task's data (same model). \\[default: the run's]",
            rich_help_panel=Panel.DATA,
        ),
    ] = None,
    split: Annotated[
        Split, typer.Option(help="test split, or the clients' training examples.", rich_help_panel=Panel.DATA)
    ] = Split.test,
    per_client: Annotated[
        bool, typer.Option("--per-client", help="Distribution over clients: mean, std, worst 10%.")
    ] = False,
    eval_sample: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="The split's metrics on a fixed sample of N examples "
            "(--per-client: every client's, streamed); 0 = the whole split. "
            "\\[default: the run's train.eval_sample]",
            rich_help_panel=Panel.DATA,
        ),
    ] = None,
    predictive: Annotated[
        Predictive,
        typer.Option(
            help="mean = the global model; ensemble = Monte Carlo posterior "
            "predictive (Bayesian algorithms).",
            rich_help_panel=Panel.ALGO,
        ),
    ] = Predictive.mean,
    samples: Annotated[
        int,
        typer.Option(min=1, help="Posterior samples K of --predictive ensemble.", rich_help_panel=Panel.ALGO),
    ] = SAMPLES,
    seed: Annotated[
        int, typer.Option(min=0, help="Seed of the posterior samples.", rich_help_panel=Panel.ALGO)
    ] = 0,
    device: Annotated[
        str | None, typer.Option(help="auto | cpu | cuda[:N] | mps. \\[default: the run's]")
    ] = None,
    data_store: Annotated[
        DataStore | None,
        typer.Option(
            help="Where the examples live: memory, disk (a memory-mapped "
            "store) or auto (docs/scaling.md). \\[default: the run's]",
            rich_help_panel=Panel.DATA,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
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
    tracking_uri: Annotated[
        str | None,
        typer.Option(help="MLflow URI of the run. \\[default: the run's]", rich_help_panel=Panel.TRACK),
    ] = None,
    no_mlflow: Annotated[
        bool,
        typer.Option(
            "--no-mlflow", help="Store the result in the SQL store only.", rich_help_panel=Panel.TRACK
        ),
    ] = False,
    model: Annotated[
        str | None,
        typer.Option(
            help="The run's own model reference (module:factory, file.py:factory), "
            "named to allow its code to run (a changed source: a warning).",
            rich_help_panel=Panel.DATA,
        ),
    ] = None,
    data: Annotated[
        str | None,
        typer.Option(
            help="The run's own data function (pkg.mod:fn, file.py:fn), named to allow its code to run.",
            rich_help_panel=Panel.DATA,
        ),
    ] = None,
    trust_code: Annotated[
        bool,
        typer.Option(
            "--trust-code",
            help="Import the model / data function code the run recorded (its sha256 must match).",
            rich_help_panel=Panel.DATA,
        ),
    ] = False,
) -> None:
    """Evaluate a run's global model: task metrics, calibration (NLL, Brier, ECE-15), per-client view.

    The result is printed, stored in the SQL store against the run and logged to its MLflow run.

    Example: fedcli evaluate 3f2a9c --per-client --predictive ensemble --samples 32
    """
    from fedcli.config.checks import require_store
    from fedcli.engine.evaluation import evaluate_split, resolve_eval_sample

    with user_errors(bool(ctx.obj and ctx.obj.get("debug"))):
        if predictive is not Predictive.ensemble and (samples != SAMPLES or seed != 0):
            flag = "--samples" if samples != SAMPLES else "--seed"
            raise ConfigError(
                f"{flag} applies to --predictive ensemble only; got {flag} "
                f"{samples if flag == '--samples' else seed} with --predictive {predictive.value}. "
                f"Add --predictive ensemble, or drop {flag}."
            )
        url = tracking_config({"tracking.store": store, "tracking.root": root and str(root)}).store_url
        require_store(url)  # a missing store holds no run; opening it would create it
        db = open_store(url)
        record = db.get_run(run)
        setup, state, params, round_idx = load_model(
            record,
            db,
            checkpoint,
            task,
            device,
            named=(model, data),
            trust=trust_code,
            data_store=data_store and data_store.value,
        )
        ensemble = predictive is Predictive.ensemble
        predict = make_predictor(setup, state, params, samples if ensemble else None, seed)
        sample = resolve_eval_sample(
            setup.cfg.train.eval_sample if eval_sample is None else eval_sample, setup.task.name
        )
        result = evaluate_split(
            setup,
            predict,
            split=split.value,
            per_client=per_client,
            params=None if ensemble else params,
            sample=sample,
        )
        worse = ensemble_note(setup, state, params, result.metrics, split.value) if ensemble else None
        prefix = split.value + ("/ensemble" if ensemble else "")
        metrics = {
            **{f"{prefix}/{k.split('/', 1)[1]}": v for k, v in result.metrics.items()},
            **{f"{result.client_split}/clients/{k.split('/', 1)[1]}": v for k, v in result.clients.items()},
        }
        options = {
            "checkpoint": checkpoint,
            "task": setup.task.name,
            "predictive": predictive.value,
            "samples": samples if ensemble else None,
            "seed": seed if ensemble else None,
            "per_client": per_client,
            "client_split": result.client_split,
            "eval_sample": sample,
        }
        db.add_evaluation(record.id, split=split.value, metrics=metrics, round_idx=round_idx, options=options)
    if not no_mlflow and record.mlflow_run_id:
        log_to_mlflow(record, tracking_uri, metrics, round_idx)
    if worse:
        console().print(f"warning: {worse}", markup=False, soft_wrap=True)
    if not as_json:
        print_table(record, round_idx, split.value, options, metrics)
    else:
        typer.echo(
            json.dumps(
                {
                    "id": record.id,
                    "name": record.run_name,
                    "algo": record.algo,
                    "round_idx": round_idx,
                    "split": split.value,
                    **options,
                    "metrics": metrics,
                },
                indent=2,
                sort_keys=True,
            )
        )


def load_model(
    record: Any,
    db: Any,
    checkpoint: int | None,
    task: str | None,
    device: str | None,
    *,
    named: tuple[str | None, ...] = (),
    trust: bool = False,
    data_store: str | None = None,
) -> tuple[Any, Any, dict[str, Any], int | None]:
    """Build the run's setup (optionally on another task or device) and load its global model.

    The file is read without running code and checked against the run's row and state
    (fedcli.engine.checkpoint); one that does not fit is refused with one line (exit 2). User code
    the run's row names (its model, its data function) is imported only when `named` (--model,
    --data) names it again or with `trust` (--trust-code; datasets/yours/trust.py).
    """
    from fedcli.config.build import resume_config
    from fedcli.datasets.yours.trust import allow_code, recorded_code, same_reference
    from fedcli.engine import checkpoint as ckpt
    from fedcli.engine.setup import build

    doc = {k: dict(v) if isinstance(v, dict) else v for k, v in (record.requested or record.config).items()}
    if task is not None:  # another task's data: its own natural clients, no cohort-size check against them
        model = doc["data"].get("model") or record.tags.get("fedcli.model")
        doc["data"] = {**doc["data"], "task": task, "data_dir": None, "model": model}
        doc["partition"] = {**doc["partition"], "num_clients": None}
        doc["train"] = {**doc["train"], "clients_per_round": 1}
    resolved = record.config.get("data") if isinstance(record.config.get("data"), dict) else {}
    code = recorded_code(doc.get("data"), data_sha256=resolved.get("source_sha256"))
    for given, kind in zip(named, ("model", "data function"), strict=False):
        if given is not None and not any(c.what == kind and same_reference(c, given) for c in code):
            flag = "--model" if kind == "model" else "--data"
            own = next((c.ref for c in code if c.what == kind), None)
            raise ConfigError(
                f"{flag} {given} does not name run {record.id[:8]}'s {kind} ("
                f"{f'it is {own}' if own else 'it has none of its own'}); {flag} only names the run's "
                f"own code to allow it to run: {f'pass {flag} {own}' if own else 'drop it'}."
            )
    flags = " ".join(f"--{'model' if c.what == 'model' else 'data'} {c.ref}" for c in code)
    allow_code(
        code,
        source=f"run {record.id[:8]}'s stored config",
        named=named,
        trust=trust,
        fix=f"name it again ({flags}) or pass --trust-code if you trust it",
    )
    setup = build(
        resume_config(doc, {"train.device": device, "data.data_store": data_store}), model_change="warn"
    )  # your model's code changed: warn
    misfit = ConfigError(
        f"the model of run {record.id} does not fit task {setup.task.name!r} (its model "
        f"{setup.cfg.data.model or setup.task.default_model!r} has other parameter shapes there); "
        "pick a task with the same inputs and classes."
    )
    template = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    try:
        if checkpoint is None:
            if not record.model_path or not Path(record.model_path).exists():
                raise ConfigError(
                    f"run {record.id} has no stored final model (status {record.status}); "
                    "evaluate one of its checkpoints with --checkpoint ROUND."
                )
            source = f"the final model of run {record.id[:8]}"
            saved = ckpt.load_model(
                Path(record.model_path), f"{source} ({record.model_path})", server_template=template
            )
            ckpt.check_identity(
                saved,
                f"{source} ({record.model_path})",
                ckpt.MODEL_KEYS,
                run_id=record.id,
                config_hash=record.config_hash,
                requested=record.requested,
            )
            server_state, round_idx, buffers = (
                saved["server_state"],
                db.last_round(record.id),
                saved.get("buffers"),
            )
        else:
            points = dict(db.checkpoints(record.id))
            if checkpoint not in points:
                raise ConfigError(
                    f"run {record.id} has no checkpoint of round {checkpoint}; it has rounds "
                    f"{sorted(points) or 'none'} (train with --checkpoint-every K to keep them)."
                )
            extras: dict[str, Any] = {}
            server_state, _ = ckpt.load_checkpoint(
                Path(points[checkpoint]),
                f"checkpoint of round {checkpoint} ({points[checkpoint]})",
                server_template=template,
                client_template=None
                if setup.alg.init_client_state is None
                else setup.alg.init_client_state(setup.init_params, setup.hp),
                run_id=record.id,
                config_hash=record.config_hash,
                requested=record.requested,
                round_idx=checkpoint,
                extras=extras,
            )
            round_idx, buffers, source = (
                checkpoint,
                extras.get("buffers"),
                f"checkpoint of round {checkpoint}",
            )
    except CheckpointError as err:
        raise (misfit if task is not None and "does not fit" in str(err) else err) from None
    if (
        setup.fns.client_stats is not None
    ):  # the BatchNorm statistics evaluation uses (train.bn_stats aggregate)
        if buffers:
            setup.fns.client_stats.load(dict(buffers), source)
        elif (
            setup.model is not None
        ):  # written before the clients carried them: the server's estimate, as then
            from dataclasses import replace

            from fedcli.engine.model import model_functions, with_precision

            estimate = with_precision(
                model_functions(setup.task, setup.model, setup.fed, "estimate"),
                setup.cfg.train.precision,
                setup.device,
            )
            setup.fns = replace(setup.fns, apply_fn=estimate.apply_fn, client_stats=None)
    state = ckpt.to_device(server_state, setup.device)
    params = setup.alg.global_params(state)
    if {k: tuple(v.shape) for k, v in setup.init_params.items()} != {
        k: tuple(v.shape) for k, v in params.items()
    }:
        raise misfit
    return setup, state, params, round_idx


def make_predictor(setup: Any, state: Any, params: dict[str, Any], samples: int | None, seed: int) -> Any:
    """The global model's outputs, or (with `samples`) the Monte Carlo posterior predictive."""
    import torch

    from fedcli.engine.evaluation import ensemble_predict, sample_posterior

    if samples is None:
        return lambda xb: setup.fns.apply_fn(params, xb)
    if setup.alg.posterior is None:
        raise ConfigError(
            f"--predictive ensemble needs a posterior, and algorithm {setup.alg.name!r} keeps none "
            "(fola, fola-offline and the bayesadmm variants do); use --predictive mean."
        )
    mean, var = setup.alg.posterior(state)
    members = sample_posterior(mean, var, samples, torch.Generator().manual_seed(seed))
    return ensemble_predict(setup.task, setup.fns.apply_fn, members)


def ensemble_note(
    setup: Any, state: Any, params: dict[str, Any], ensemble: dict[str, float], split: str
) -> str | None:
    """One line when the posterior ensemble is worse than the mean model on accuracy or loss, and why:
    the share of weights whose posterior standard deviation exceeds their mean (docs/out-of-the-box.md)."""
    from fedcli.engine.evaluation import evaluate_split

    mean = evaluate_split(
        setup, lambda xb: setup.fns.apply_fn(params, xb), split=split, per_client=False, params=params
    ).metrics
    worse = [
        k
        for k in ("eval/accuracy", "eval/loss")
        if k in mean
        and k in ensemble
        and (ensemble[k] < mean[k] if k == "eval/accuracy" else ensemble[k] > mean[k])
    ]
    if not worse:
        return None
    centre, var = setup.alg.posterior(state)
    wide = sum(int((v.sqrt() > centre[k].abs()).sum()) for k, v in var.items()) / sum(
        v.numel() for v in var.values()
    )
    shown = ", ".join(f"{k.split('/')[1]} {ensemble[k]:.4g} vs {mean[k]:.4g}" for k in worse)
    return (
        f"the posterior ensemble is worse than the run's mean model ({shown}): {100 * wide:.0f} % of the weights "
        f"have a posterior std larger than their mean, so the samples leave the mean model "
        f"({setup.alg.name}'s posterior: `fedcli list algos {setup.alg.name}`); use --predictive mean."
    )


def log_to_mlflow(
    record: Any, tracking_uri: str | None, metrics: dict[str, float], round_idx: int | None
) -> None:
    """Log `evaluate/<key>` metrics with step = the evaluated round to the run's MLflow run."""
    from fedcli.tracking.urls import mask_url

    stored = record.config.get("tracking", {})
    uri = tracking_uri or stored.get("tracking_uri") or "the run's MLflow store"
    try:  # a stored URI's password is masked: given_url takes MLFLOW_TRACKING_URI or says to pass --tracking-uri
        uri = (
            tracking_uri
            or tracking_config(
                {"tracking.root": stored.get("root"), "tracking.tracking_uri": stored.get("tracking_uri")}
            ).mlflow_uri
        )
        from mlflow import MlflowClient
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(f"evaluate/{k}", v, now, round_idx or 0) for k, v in sorted(metrics.items())]
        for start in range(0, len(batch), 1000):
            MlflowClient(tracking_uri=uri).log_batch(
                record.mlflow_run_id, metrics=batch[start : start + 1000]
            )
    except Exception as err:  # the SQL store already holds the result; MLflow is a mirror
        console().print(
            mask_url(f"[yellow]warning:[/] not logged to MLflow {uri}: {str(err).splitlines()[0]}")
        )


def print_table(
    record: Any, round_idx: int | None, split: str, options: dict[str, Any], metrics: dict[str, float]
) -> None:
    """The result as a rich table on stdout."""
    model = "final model" if options["checkpoint"] is None else f"checkpoint {options['checkpoint']}"
    how = "" if options["predictive"] == "mean" else f", ensemble of {options['samples']} posterior samples"
    how += f", a fixed sample of {options['eval_sample']:,} examples" if options.get("eval_sample") else ""
    title = f"run {record.id[:8]} ({record.algo}, {options['task']}): {model} (round {round_idx}), {split} split{how}"
    notes = [
        "ECE: 15 equal-width confidence bins." if any(k.endswith("/ece") for k in metrics) else "",
        "Per-client: unweighted over clients; worst10 = mean of the worst 10% of clients."
        if options["per_client"]
        else "",
        "F1 of a label with no positives and no predictions counts 0."
        if any(k.endswith("macro_f1") for k in metrics)
        else "",
        "The task has no per-client test data: the per-client view uses each client's training examples."
        if options["client_split"] == "train" and split == "test"
        else "",
    ]
    table = Table("metric", "value", caption=" ".join(n for n in notes if n) or None, caption_justify="left")
    for key in sorted(metrics):
        table.add_row(key, f"{metrics[key]:.0f}" if key.endswith("/clients") else f"{metrics[key]:.4f}")
    out = Console(highlight=False)
    out.print(title, markup=False)
    out.print(table)
