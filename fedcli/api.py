"""fedcli from Python: `fedcli.train(...) -> Run`, `fedcli.load_run(...)`, `fedcli.report(...)` (docs/python-api.md).

    import fedcli
    run = fedcli.train(algo="fedpa", task="femnist", rounds=20, hp={"rho": 0.1}, root="runs")
    run.metrics()            # pandas: one row per round, one column per metric key
    net = run.model()        # the trained global model as an nn.Module (eval mode)
    print(fedcli.report(runs=[run, other], root="runs"))

The same path as `fedcli train` (fedcli/runs/run.py: validation before anything is written, the SQL
store, the MLflow mirror, checkpoints, stop signals, `resume=`), with the CLI's option names as
keyword settings. Bad input raises `ConfigError` (or another `FedcliError`) whose message is the
line the CLI prints after `error: `; nothing is written then.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fedcli.tracking  # noqa: F401 - sets MLflow's defaults (no telemetry) before a run imports MLflow
from fedcli.errors import ConfigError, FedcliError
from fedcli.runs.arguments import (
    check_bool,
    check_report_arguments,
    check_train_arguments,
    kind_of,
    number_list,
    path_argument,
    split_settings,
    store_settings,
)
from fedcli.runs.objects import live_model, record_object_source, warn
from fedcli.runs.run import StoppedBeforeStart, preserved_state, resolve_config, run_config
from fedcli.runs.stores import open_store, tracking_config

if TYPE_CHECKING:
    import pandas as pd
    from torch import nn

    from fedcli.engine.train import RunResult
    from fedcli.tracking.store.records import RunRecord

__all__ = [
    "ConfigError",
    "FedcliError",
    "Run",
    "StoppedBeforeStart",
    "load_run",
    "preserved_state",
    "report",
    "run_config",
    "train",
]


@dataclasses.dataclass
class Run:
    """One run in a results store, as `fedcli.train` returned it or `fedcli.load_run` found it.

    Attributes:
        id: the run's full id (`fedcli list runs` shows a prefix; every command takes either).
        status: `finished`, `interrupted`, `failed` or `running` (when read).
        config: the resolved config the run trained with (every `auto` filled in), as a dict.
        store: the SQL store's URL (with its password, if any: never print it; `repr` masks it).
        result: the engine's summary (timings, executor) when this process trained it, else None.
    """

    id: str
    status: str
    config: dict[str, Any]
    store: str = dataclasses.field(repr=False)
    result: RunResult | None = dataclasses.field(default=None, repr=False)
    trust_code: bool = dataclasses.field(
        default=False, repr=False
    )  # `model()`'s default (`load_run(trust_code=)`)

    def record(self) -> RunRecord:
        """The run's row in the store, read now."""
        with closing(open_store(self.store, must_exist=True)) as db:
            return db.get_run(self.id)

    def metrics(self) -> pd.DataFrame:
        """The logged round metrics: index `round` (0 = the initial model), one column per metric key
        (`eval/accuracy`, `train/loss`, `time/round_s`, ...); NaN where a round did not log a key
        (e.g. between evaluations with `eval_every` > 1)."""
        with closing(open_store(self.store, must_exist=True)) as db:
            wide = db.metrics_frame([self.id]).pivot_table(
                index="round_idx", columns="key", values="value", aggfunc="last"
            )
        wide.index.name, wide.columns.name = "round", None
        return wide.sort_index()

    def model(self, *, trust_code: bool | None = None) -> nn.Module:
        """The final global model as a plain `nn.Module` in eval mode: `module(x)` on rows of the data
        set's stored inputs (e.g. uint8 images) gives the logits `fedcli evaluate` scores.

        Read with `torch.load(weights_only=True)` (no code runs from the file; tracking/served.py).
        A run of your own model or data function needs its code imported: that happens only with
        `trust_code=True` (default: `load_run`'s `trust_code`), the source's sha256 the one the
        run recorded, or when this process imported that code already (e.g. `fedcli.train` named
        it); docs/operations.md, "Security".

        Raises:
            ConfigError: the run has no final model (it did not finish), the file is unreadable, or
                it names user code not allowed to run (one line naming the code and the fix).
        """
        from fedcli.tracking.served import read_model_file, served_model

        if trust_code is not None:
            check_bool("trust_code", trust_code)  # trust_code="no" was truthy: the code ran
        record = self.record()
        if not record.model_path or not Path(record.model_path).exists():
            raise ConfigError(
                f"run {self.id[:8]} has no stored final model (status {record.status}); resume it to "
                f"its end first: fedcli.train(resume={self.id[:8]!r}, ...)."
            )
        try:
            saved = read_model_file(Path(record.model_path))
            data = (saved.get("config") or {}).get(
                "data"
            ) or {}  # what the MLflow model records (write_served)
            buffers = saved.get("buffers")
            stored = record.config["data"] if isinstance(record.config.get("data"), Mapping) else {}
            return served_model(
                saved["params"],
                saved["task"],
                saved["model"],
                data.get("file"),
                data.get("model_args"),
                data.get("model_sha256"),
                buffers if isinstance(buffers, Mapping) else None,
                data.get("augment"),
                trust=self.trust_code if trust_code is None else trust_code,
                data_sha256=stored.get("source_sha256"),
                source=f"the final model of run {self.id[:8]} ({record.model_path})",
                fix=f"pass trust_code=True (fedcli.load_run({self.id[:8]!r}, trust_code=True) or "
                "run.model(trust_code=True)) if you trust it",
            )
        except (ValueError, KeyError, RuntimeError) as err:  # RuntimeError: load_state_dict's shape mismatch
            raise ConfigError(f"the final model of run {self.id[:8]} cannot be rebuilt: {err}") from None

    def report(self, *others: Run | str, output: str | Path | None = None, **options: Any) -> str:
        """`fedcli.report(runs=[self, *others], ...)`: this run (and others) as the markdown report."""
        if "store" not in options and "root" not in options:
            options["store"] = self.store
        return report(runs=[self, *others], output=output, **options)


def train(
    algo: str | None = None,
    model: Any = None,
    data: Any = None,
    task: str | None = None,
    *,
    config: str | Path | Mapping[str, Any] | None = None,
    hp: Mapping[str, Any] | None = None,
    data_options: Mapping[str, Any] | None = None,
    resume: str | Run | None = None,
    mlflow_optional: bool = False,
    progress: bool | Callable[[int, dict[str, float]], None] = False,
    trust_code: bool = False,
    **settings: Any,
) -> Run:
    """Train one algorithm on one task in this process, like `fedcli train`, and return the run.

    Args:
        algo: algorithm name (`fedcli list algos`). Default: fedavg.
        model: the task's model name (`fedcli list tasks`), your model factory as `"pkg.mod:factory"`
            or `"path/to/file.py:Net"`, or the class/function itself (importable: not defined in a
            notebook cell). Default: the task's default model. Bring your own model and data:
            fedcli.datasets.yours.model.model_reference.
        data: your own data: a file (.npz/.csv/.parquet; `fedcli train --help`), a `"pkg.mod:fn"`
            function, a torch `Dataset`, a Hugging Face dataset or a flwr-datasets partitioner
            (fedcli.datasets.yours.data.data_ref; `data_options` are its keyword arguments:
            `client`, `partition`, `x`, `y`, `test`, `name`). Default: the task's data.
        task: task name. Default: femnist (the bundled writers).
        config: a YAML file, a config shipped with fedcli (`"demo"`), or the config as a mapping of
            sections (`{"train": {"rounds": 5}}`); settings override it.
        hp: algorithm hyperparameters, e.g. `{"rho": 0.1}` (the `--hp` options).
        resume: a run (id, prefix, name or `Run`) to continue from its newest checkpoint; only
            `rounds`, checkpointing, `device` and tracking settings may change. A run whose config
            names your model or data function resumes when you name the same `model=` / `data=`
            again, or pass `trust_code=True` (docs/operations.md, "Security").
        mlflow_optional: MLflow unreachable -> warn and train with the SQL store only.
        trust_code: `resume=` may import the user code the resumed run's stored config names (its
            source's sha256 must be the recorded one). Default: only code named here.
        progress: True shows the CLI's progress (a bar on a terminal, a line every 10 s otherwise);
            a callable gets `(round, metrics)` after every round. Default: nothing shown.
        **settings: `fedcli train`'s options by Python name (`rounds=20`, `client_lr=0.05`,
            `root="runs"`, `no_mlflow=True`, ...; docs/python-api.md, "Settings"), and the sections
            `train=`, `tracking=`, `partition=` as mappings of any of their config keys
            (`train={"server_beta1": 0.95}`). Units and defaults: `fedcli train --help`.

    Returns:
        The finished run.

    Raises:
        ConfigError: a bad setting, name or file (the CLI's one line); nothing was written.
        StoppedBeforeStart: SIGINT/SIGTERM/SIGHUP during the set-up; nothing was written.
        RunInterrupted: a stop signal during training; the run is `interrupted` and checkpointed
            (continue it with `resume=`).
        FedcliError: other user-facing failures (data, store, MLflow).
    """
    if isinstance(resume, Run):
        resume = resume.id
    check_train_arguments(
        algo=algo,
        task=task,
        config=config,
        hp=hp,
        data_options=data_options,
        resume=resume,
        mlflow_optional=mlflow_optional,
        progress=progress,
        trust_code=trust_code,
        settings=settings,
    )
    with preserved_state():  # around everything: the first imports of fedcli's modules may draw from `random`
        from fedcli.datasets.yours.data import data_ref
        from fedcli.datasets.yours.model import model_reference
        from fedcli.runs.outputs import check_path_value
        from fedcli.runs.request import TrainOptions

        for name in ("root", "data_dir", "partition"):  # "" (an unset variable) is the CLI's line, not "."
            check_path_value(name, settings.get(name))

        options, sections = split_settings(settings)
        if (
            isinstance(options.get("partition"), (str, Path))
            and Path(options["partition"]).expanduser().is_file()
        ):
            options["partition"] = (
                Path(options["partition"]).expanduser().resolve()
            )  # as the CLI's --partition
        if isinstance(data, (str, Path)) and Path(data).expanduser().is_file():
            data = (
                Path(data).expanduser().resolve()
            )  # as the CLI's --data: a resume from another folder finds it
        options.update(
            algo=algo,
            task=task,
            model=None if model is None else model_reference(live_model(model)),
            data=None if data is None and not data_options else data_ref(data, **dict(data_options or {})),
        )
        if options["data"] is not None and not isinstance(data, (str, Path)):
            record_object_source(options["data"], data)
        cfg, resume_id = resolve_config(
            TrainOptions.from_settings(options),  # an unknown name: one line naming the closest option
            config=config,
            hp=hp,
            sections=sections,
            resume=resume,
            warn=warn,
            trust_code=trust_code,
        )
        from fedcli.runs.progress import train_progress

        with train_progress(cfg, quiet=progress is not True) as shown:  # quiet: shows nothing
            result = run_config(
                cfg,
                resume_run_id=resume_id,
                mlflow_optional=mlflow_optional,
                progress=shown if progress is True else progress or None,
            )
    run = load_run(result.run_id, store=cfg.tracking.store_url)
    run.result = result
    return run


def load_run(
    ref: str, *, store: str | None = None, root: str | Path | None = None, trust_code: bool = False
) -> Run:
    """Find a run by id, unique id prefix, run name or MLflow run id.

    Args:
        ref: what `fedcli list runs` shows.
        store: the SQL store's URL. Default: FEDCLI_STORE, else `<root>/fedcli.db`.
        root: the folder of the default store. Default: ./fedcli-runs.
        trust_code: `Run.model()` may import the user code (your model, a data function) the run
            recorded, if its source's sha256 is the recorded one (docs/operations.md, "Security").

    Raises:
        ConfigError: no store there, or no such run (the CLI's message).
    """
    if not isinstance(ref, str) or not ref.strip():  # None found some run; an int was an AttributeError
        raise ConfigError(
            f"ref must be a run id, id prefix or name (str); got {kind_of(ref)}. `fedcli list runs` shows them."
        )
    check_bool("trust_code", trust_code)
    url = tracking_config(store_settings(store, root)).store_url
    with closing(open_store(url, must_exist=True)) as db:
        record = db.get_run(ref)
    return Run(
        id=record.id, status=record.status, config=dict(record.config), store=url, trust_code=trust_code
    )


def report(
    *,
    runs: Sequence[Run | str] | None = None,
    experiment: str | Sequence[str] | None = None,
    where: Mapping[str, Any] | None = None,
    group_by: str | Sequence[str] | None = None,
    metric: str | None = None,
    thresholds: Sequence[float] = (),
    at: Sequence[int] = (),
    window: int | None = None,
    smooth: int | None = None,
    columns: Sequence[str] = (),
    include_unfinished: bool = False,
    format: str = "md",
    output: str | Path | None = None,
    partition_heatmap: bool = False,
    store: str | None = None,
    root: str | Path | None = None,
) -> str:
    """`fedcli report` from Python: the report's text (markdown, CSV or JSON); with `output`, also
    written there (the markdown's PNG figures beside it), all or nothing.

    The arguments are `fedcli report`'s options (`fedcli report --help` for their defaults): runs
    as `Run`s or references, `where` as `{"algo": "fedpa"}`, `group_by` as `"algo,hp.rho"` or a list.
    The store is the runs' own (`Run.store`) unless `store`/`root` say otherwise.

    Raises:
        ConfigError: bad options, no store, no matching run (the CLI's message); nothing is written.
    """
    from fedcli.config.checks import require_store
    from fedcli.runs.outputs import check_output
    from fedcli.runs.reports import Format, parse_list, parse_metric, parse_where, write_report
    from fedcli.tracking.report.build import build_report
    from fedcli.tracking.report.model import ReportSpec
    from fedcli.tracking.report.render import render_markdown

    if format not in {f.value for f in Format}:
        raise ConfigError(f"format must be one of md, csv, json; got {format!r}.")
    check_report_arguments(
        experiment=experiment,
        where=where,
        group_by=group_by,
        metric=metric,
        columns=columns,
        include_unfinished=include_unfinished,
        partition_heatmap=partition_heatmap,
    )
    output = path_argument("output", output)
    settings = store_settings(store, root)
    if isinstance(runs, str):  # one reference, not its characters as references
        runs = [runs]
    bad = next((r for r in runs or () if not isinstance(r, (Run, str))), None)
    if bad is not None:
        raise ConfigError(f"runs must be a list of runs (Run) or run references (str); got {kind_of(bad)}.")
    if isinstance(columns, str):  # "a,b" as the CLI's --columns, not one column per character
        columns = parse_list("columns", [columns], "metric key")
    for name, value in (("window", window), ("smooth", smooth)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name} must be an integer number of rounds >= 1; got {kind_of(value)}.")
    refs = [r.id if isinstance(r, Run) else str(r) for r in runs or ()]
    if store is None and root is None:
        settings["tracking.store"] = next((r.store for r in runs or () if isinstance(r, Run)), None)
    spec = ReportSpec(
        experiments=(experiment,) if isinstance(experiment, str) else tuple(experiment or ()),
        runs=tuple(refs),
        where=parse_where([f"{k}={v}" for k, v in (where or {}).items()]),
        group_by=None
        if group_by is None
        else tuple(
            p.strip() for p in (group_by.split(",") if isinstance(group_by, str) else group_by) if p.strip()
        ),
        metric=parse_metric(metric),
        thresholds=number_list("thresholds", thresholds, float),
        at=number_list("at", at, int),
        window=window,
        smooth=smooth,
        include_unfinished=include_unfinished,
        columns=tuple(columns),
        command=f"fedcli.report(runs={refs!r})" if refs else "fedcli.report(...)",
    )
    path = None if output is None else Path(output)
    check_output(path, "output")  # before any work: a rejected report writes nothing
    url = tracking_config(settings).store_url
    require_store(url)
    with closing(open_store(url)) as db:
        built = build_report(db, spec)
    if path is None and format == "md":  # the CLI's note about figures names --output: not said here
        return render_markdown(built, [])
    return write_report(built, path, Format(format), partition_heatmap)
