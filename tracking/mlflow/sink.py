"""MLflow sink: one MLflow run per fedcli run, through the explicit `MlflowClient` API.

docs/style.md rule 15: explicit run ids only (no fluent `mlflow.log_*`, no active run);
params are the flattened config, logged once at start in batches of at most 100; metrics
are logged with `step = round_idx` in batches of at most 1000.

Metrics reach it from the mirror process (tracking/mlflow/mirror.py) as the SQL store's rows
(`log_rows`, synchronous), each stamped with the time the store logged its round, so a row
copied twice is the same point twice (docs/architecture.md §6).

Importing this module imports MLflow (slow); import it only when MLflow is enabled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from sqlalchemy.exc import SQLAlchemyError

from fedcli.errors import TrackingError
from fedcli.tracking.mlflow.checks import first_cause_line
from fedcli.tracking.urls import mask_url, sqlite_path

__all__ = ["MlflowSink", "default_tracking_uri"]

log = logging.getLogger(__name__)

MAX_PARAMS_TAGS_PER_BATCH = 100  # MLflow per-request limits (mlflow.utils.validation)
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
KIND_TAG = "mlflow.experimentKind"  # MLflow 3's UI opens "custom_model_development" on the runs table
EXPERIMENT_TAGS = {
    KIND_TAG: "custom_model_development",
    "mlflow.note.content": "Federated-learning runs logged by fedcli: one run per `fedcli train`, metrics by "
    "communication round (step = round; round 0 is the initial model), params = the run's "
    "resolved config with the algorithm's hyperparameters as `hp.*`. The SQL results store "
    "is the source of truth; `fedcli report` turns it into tables.",
}
RUN_NAME_TAG = "mlflow.runName"
DEFAULT_EXPERIMENT_ID = "0"  # MLflow's "Default", created with every new store
PARENT_RUN_TAG = "mlflow.parentRunId"
# pruned (a search trial its pruner stopped, docs/sweeps.md): MLflow has no such state; KILLED (stopped before
# its last round, not by an error), with the tag fedcli.status = pruned saying which
MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED", "pruned": "KILLED"}
_MLFLOW_FIX = "pass --tracking-uri with a reachable MLflow store or use --no-mlflow"

T = TypeVar("T")


def default_tracking_uri(root: Path = Path("fedcli-runs")) -> str:
    """Return the default MLflow tracking URI, `sqlite:///<root>/mlflow.db`, `root` made absolute."""
    path = Path(root).expanduser().resolve() / "mlflow.db"
    return f"sqlite:///{path.as_posix()}"


def _local_root(tracking_uri: str) -> Path | None:
    """The local directory holding a `sqlite:` or `file:` tracking store, else None (a server)."""
    if tracking_uri.startswith("sqlite:"):
        database = sqlite_path(tracking_uri)
        return None if database is None else database.resolve().parent
    if tracking_uri.startswith("file:"):
        return Path(tracking_uri.removeprefix("file://").removeprefix("file:")).expanduser().resolve().parent
    if "://" not in tracking_uri:  # a bare path is MLflow's file store
        return Path(tracking_uri).expanduser().resolve().parent
    return None


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _fit(kind: str, key: str, value: object, limit: int) -> str:
    """`str(value)`, cut to MLflow's length limit with a warning (the full value is in config.json)."""
    text = str(value)
    if len(text) > limit:
        log.warning(
            "MLflow %s %r is %d characters; logging its first %d (config.json has it all)",
            kind,
            key,
            len(text),
            limit,
        )
        text = text[:limit]
    return text


class MlflowSink:
    """Writes one fedcli run to MLflow; one instance per run.

    Args:
        tracking_uri: An MLflow tracking URI (`default_tracking_uri(root)`, another
            `sqlite:///…` file, or `http://host:5000`).
        experiment: MLflow experiment name; created if missing. On a local (`sqlite:` or
            `file:`) store its artifacts go to `<root>/mlartifacts/<experiment>` so that
            they work without a server.

    Raises:
        TrackingError: If the tracking store cannot be opened or written.
    """

    def __init__(self, tracking_uri: str, experiment: str) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self._root = _local_root(tracking_uri)
        self._run_id: str | None = None
        with self._errors("open"):
            if self._root is not None:
                self._root.mkdir(parents=True, exist_ok=True)
            self._client = MlflowClient(tracking_uri=tracking_uri)
            self.experiment_id = self._experiment_id(experiment)

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """Turn MLflow, database and file-system failures into one-line `TrackingError`s."""
        try:
            yield
        except (MlflowException, SQLAlchemyError, OSError) as err:
            reason = first_cause_line(err)
            raise TrackingError(
                mask_url(f"MLflow store {self.tracking_uri!r} could not {what}: {reason}; {_MLFLOW_FIX}")
            ) from err

    def _experiment_id(self, name: str) -> str:
        found = self._client.get_experiment_by_name(name)
        if found is None:
            location = None
            if self._root is not None:
                slug = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
                location = (self._root / "mlartifacts" / slug).as_uri()
                self._hide_empty_default()
            try:
                return self._client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_TAGS)
            except MlflowException:  # another process created it in between
                found = self._client.get_experiment_by_name(name)
                if found is None:
                    raise
        if found.lifecycle_stage != "deleted" and found.tags.get(KIND_TAG) is None:  # made by an older fedcli
            for key, value in EXPERIMENT_TAGS.items():
                self._client.set_experiment_tag(found.experiment_id, key, value)
        if found.lifecycle_stage == "deleted":
            raise TrackingError(
                f"MLflow experiment {name!r} is deleted in {mask_url(self.tracking_uri)!r}; restore it "
                "(`mlflow experiments restore`) or pass another --experiment"
            )
        return found.experiment_id

    def _hide_empty_default(self) -> None:
        """Delete (soft, restorable) the empty "Default" experiment MLflow makes in a new local store.

        The UI lists it first and it never holds a fedcli run. A Default with runs is kept.
        """
        default = self._client.get_experiment(DEFAULT_EXPERIMENT_ID)
        if default is None or default.lifecycle_stage == "deleted":
            return
        if not self._client.search_runs([DEFAULT_EXPERIMENT_ID], max_results=1, run_view_type=3):
            with contextlib.suppress(MlflowException):
                self._client.delete_experiment(DEFAULT_EXPERIMENT_ID)

    @property
    def run_id(self) -> str:
        """The MLflow run id of this sink's run."""
        if self._run_id is None:
            raise RuntimeError("MlflowSink has no run; call start_run or attach first")
        return self._run_id

    def start_run(
        self,
        *,
        run_name: str,
        params: Mapping[str, object],
        tags: Mapping[str, str],
        parent_run_id: str | None = None,
        start_ms: int | None = None,
    ) -> str:
        """Create the MLflow run and log its params and tags (synchronously, once).

        Args:
            run_name: Display name (`mlflow.runName`).
            params: Flattened config (`flatten_config`), logged in batches of ≤ 100;
                values longer than 6000 characters are cut with a warning.
            tags: String tags, logged in batches of ≤ 100.
            parent_run_id: MLflow run id of a sweep's parent run; sets `mlflow.parentRunId`.

        Returns:
            The MLflow run id.
        """
        if self._run_id is not None:
            raise RuntimeError(f"MlflowSink already holds run {self._run_id}; use one sink per run")
        run_tags = {RUN_NAME_TAG: run_name}
        if parent_run_id is not None:
            run_tags[PARENT_RUN_TAG] = parent_run_id
        param_list = [
            Param(key, _fit("param", key, value, MAX_PARAM_VAL_LENGTH)) for key, value in params.items()
        ]
        with self._errors(f"start run {run_name!r}"):
            run = self._client.create_run(
                self.experiment_id,
                start_time=start_ms or int(time.time() * 1000),
                tags=run_tags,
                run_name=run_name,
            )
            self._run_id = run.info.run_id
            for chunk in _chunks(param_list, MAX_PARAMS_TAGS_PER_BATCH):
                self._client.log_batch(self._run_id, params=chunk, synchronous=True)
        self.set_tags(tags)
        log.debug("mlflow: started run %s (%s) in experiment %s", self._run_id, run_name, self.experiment_id)
        return self._run_id

    def find_run(self, fedcli_run_id: str) -> str | None:
        """The MLflow run of this experiment tagged with this fedcli run id, if any."""
        with self._errors(f"search runs of {self.experiment!r}"):
            found = self._client.search_runs(
                [self.experiment_id], filter_string=f"tags.`fedcli.run_id` = '{fedcli_run_id}'", max_results=1
            )
        return found[0].info.run_id if found else None

    def exists(self, run_id: str) -> bool:
        """True when the tracking store has a run with this id."""
        return self.run_state(run_id) is not None

    def log_rows(self, rows: Sequence[tuple[int, str, float, int | None]]) -> None:
        """Write `(round_idx, key, value, logged_ms)` rows synchronously (the mirror's copy of the store).

        The timestamp is the time the store logged the round, so writing the same rows twice
        gives identical points, which MLflow's SQL store keeps once.
        """
        now = int(time.time() * 1000)
        batch = [Metric(key, value, logged_ms or now, round_idx) for round_idx, key, value, logged_ms in rows]
        with self._errors(f"log rounds of run {self.run_id}"):
            for chunk in _chunks(batch, MAX_METRICS_PER_BATCH):
                self._client.log_batch(self.run_id, metrics=chunk, synchronous=True)

    def logged_steps(self) -> dict[str, int]:
        """Metric key -> the highest step this run holds in MLflow (its latest metric's step).

        The mirror copies rounds in order, so MLflow holds every step up to that one (what
        `Mirror.open_run` skips on reattaching).
        """
        with self._errors(f"read run {self.run_id}"):
            data = self._client.get_run(self.run_id).data
        return {metric.key: int(metric.step) for metric in data.to_proto().metrics}

    def attach(self, run_id: str, running: bool = True) -> None:
        """Reattach to an existing MLflow run (for `--resume`), set back to RUNNING unless `running` is False."""
        if self._run_id is not None:
            raise RuntimeError(f"MlflowSink already holds run {self._run_id}; use one sink per run")
        if running:
            with self._errors(f"reopen run {run_id}"):
                self._client.update_run(run_id, status="RUNNING")
        self._run_id = run_id

    def run_state(self, run_id: str) -> tuple[str, int | None] | None:
        """(MLflow status, end time in ms) of a run; None when the store has no such run."""
        try:
            info = self._client.get_run(run_id).info
        except MlflowException:
            return None
        return info.status, info.end_time

    def artifact_sizes(self) -> dict[str, int | None]:
        """Name -> size of the files at the top of this run's artifacts (what an upload would replace)."""
        with self._errors(f"list the artifacts of run {self.run_id}"):
            return {
                Path(f.path).name: f.file_size
                for f in self._client.list_artifacts(self.run_id)
                if not f.is_dir
            }

    def model_steps(self, run_id: str | None = None) -> set[int]:
        """The steps at which models were logged as outputs of `run_id` (default: this sink's run)."""
        run_id = run_id or self.run_id
        with self._errors(f"read run {run_id}"):
            outputs = self._client.get_run(run_id).outputs
        return {int(out.step) for out in (outputs.model_outputs if outputs else [])}

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set string tags on the run, synchronously, in batches of ≤ 100."""
        tag_list = [RunTag(key, _fit("tag", key, value, MAX_TAG_VAL_LENGTH)) for key, value in tags.items()]
        with self._errors(f"tag run {self.run_id}"):
            for chunk in _chunks(tag_list, MAX_PARAMS_TAGS_PER_BATCH):
                self._client.log_batch(self.run_id, tags=chunk, synchronous=True)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a local file or directory to the run's artifacts."""
        with self._errors(f"log artifact {str(path)!r}"):
            self._client.log_artifact(self.run_id, str(path), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        """Write `text` as the artifact `artifact_file` (e.g. `config.json`)."""
        with self._errors(f"log artifact {artifact_file!r}"):
            self._client.log_text(self.run_id, text, artifact_file)

    def log_model(
        self,
        weights: Path,
        *,
        example: object | None,
        output: object | None,
        step: int,
        requirements: Sequence[str],
    ) -> str:
        """Log the run's MLflow model `model`: a pyfunc model from code, nothing pickled.

        The code is tracking/mlflow/model.py (MLflow copies it and runs it on load); its one
        artifact is `weights` (`served.pt`, tracking/served.py). Explicit run id
        (`Model.log(run_id=...)`); the signature is inferred from `example` (rows of the data
        set, also the model's input example) and `output` (the module's output on it);
        `requirements` are given, so MLflow does not infer them (that imports the module in a
        subprocess: seconds). Returns the MLflow model id (`models:/<id>` loads it).
        """
        import mlflow.pyfunc
        from mlflow.models import Model, infer_signature

        code = str(
            Path(__file__).with_name("model.py")
        )  # fedcli.tracking.mlflow.model, installed beside this file
        with self._errors("log the model"), global_tracking_uri(self.tracking_uri), _given_requirements():
            rows = None if example is None else example.numpy()  # type: ignore[attr-defined]
            signature = None if rows is None else infer_signature(rows, output.numpy())  # type: ignore[union-attr]
            # created here, in the run's experiment: Model.log alone would put it in the active
            # (Default) experiment under ./mlruns
            logged = self._client.create_logged_model(
                experiment_id=self.experiment_id, name="model", source_run_id=self.run_id
            )
            Model.log(
                None,
                name="model",
                flavor=mlflow.pyfunc,
                run_id=self.run_id,
                python_model=code,
                artifacts={"weights": str(weights)},
                signature=signature,
                input_example=rows,
                pip_requirements=list(requirements),
                step=step,
                model_id=logged.model_id,
                # the loader's opt-in to import user code served.pt names: `mlflow.pyfunc.load_model(uri,
                # model_config={"trust_code": True})` (MLflow accepts only keys logged here; datasets/yours/trust.py)
                model_config={"trust_code": False},
            )
            return str(logged.model_id)

    def end_run(self, status: str, end_ms: int | None = None) -> None:
        """Terminate the run.

        Args:
            status: A status of the store's (`RUN_STATUSES` but `running`; the callers pass the
                store's or the sweep's), MLflow's per MLFLOW_STATUS.
            end_ms: The run's end (ms since the epoch), as the SQL store says; default now.
        """
        with self._errors(f"end run {self.run_id}"):
            self._client.set_terminated(
                self.run_id, status=MLFLOW_STATUS[status], end_time=end_ms or int(time.time() * 1000)
            )
        log.debug("mlflow: ended run %s as %s", self.run_id, MLFLOW_STATUS[status])


@contextlib.contextmanager
def _given_requirements() -> Iterator[None]:
    """Skip MLflow's check that the installed packages satisfy the model's requirements.

    `log_model` passes them (`torch==` and `fedcli==` the versions this process runs), so they
    hold by construction; the check maps every installed distribution to its modules, 1.4 of
    the 2.3 s the mirror spent ending a run, while `fedcli train` waited, and it runs
    twice (saving the model, and loading it back to check the input example). The name is
    MLflow's private helper: where a module lacks it, the check runs there as before.
    """
    import mlflow.pyfunc
    import mlflow.utils.environment

    name = "warn_dependency_requirement_mismatches"  # where saving, and loading back, look it up
    held = [
        (module, getattr(module, name))
        for module in (mlflow.utils.environment, mlflow.pyfunc)
        if hasattr(module, name)
    ]
    for module, _ in held:
        setattr(module, name, lambda *_args, **_kwargs: None)
    try:
        yield
    finally:
        for module, check in held:
            setattr(module, name, check)


@contextlib.contextmanager
def global_tracking_uri(uri: str) -> Iterator[None]:
    """`mlflow.set_tracking_uri(uri)` for the block only. MLflow also writes the URI to the
    MLFLOW_TRACKING_URI environment variable, which every later child of this process would
    inherit: after an in-process `fedcli sync`, the `fedcli train` runs a test or a sweep starts
    then logged to that store instead of their own (tests/reliability failed so)."""
    import mlflow

    saved = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved)  # type: ignore[arg-type]  # None unsets the variable again
