"""The MLflow sink and the Tracker fan-out against a real SQLite-backed MLflow store."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from fedcli.errors import TrackingError
from fedcli.tracking.keys import NonFiniteMetricsError, flatten_config
from fedcli.tracking.mlflow.handle import MirrorHandle
from fedcli.tracking.mlflow.sink import MlflowSink, default_tracking_uri
from fedcli.tracking.sinks import Tracker
from fedcli.tracking.store.common import config_hash, default_store_url
from fedcli.tracking.store.sql_store import SqlStore

# MLflow with a real backend store, mirror processes and a `fedcli train` (tests/tracking/logged_model.py): seconds a test
pytestmark = pytest.mark.slow

CONFIG = {
    "seed": 4,
    "algorithm": {"name": "fedpa", "rho": 0.01, "burn_in_rounds": 2},
    "partition": {"scheme": "dirichlet", "alpha": 0.3, "num_clients": 20},
    "train": {"num_rounds": 5, "client_lrs": [0.1, 0.05]},
}


def _values(round_idx: int) -> dict[str, float]:
    """Different per round and key, so a point stored at the wrong step shows."""
    return {
        "eval/accuracy": 0.1 * round_idx + 0.05,
        "train/loss": 3.0 - 0.25 * round_idx,
        "comm/bytes_up": 512.0 * round_idx,
    }


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _mirror(uri: str, store: SqlStore, tmp_path: Path) -> MirrorHandle:
    """The real MLflow mirror process of a run (fedcli.tracking.mlflow.mirror)."""
    return MirrorHandle(
        tracking_uri=uri,
        experiment="tracker",
        store_url=store.url.replace("***", ""),
        runs_root=tmp_path / "runs",
    )


def _start_tracker(tracker: Tracker, **overrides: Any) -> str:
    arguments: dict[str, Any] = {
        "experiment": "tracker",
        "run_name": None,
        "config": CONFIG,
        "algo": "fedpa",
        "task": "femnist",
        "seed": 4,
        "dataset": "femnist",
        "partitioner": "dirichlet",
        "fedcli_version": "0.1.0",
        "torch_version": "2.4.0",
        "git_commit": "0123abcd",
        "tags": {"owner": "lab"},
    }
    arguments.update(overrides)
    return tracker.start(**arguments)


def test_sink_logs_params_tags_and_one_point_per_step(mlflow_root: Path) -> None:
    """150 params (two batches of <= 100) and the tags are stored verbatim; after end_run every
    metric has exactly one point per round at step = round_idx with the logged value (rows as the
    mirror copies them from the store, `log_rows`)."""
    uri = default_tracking_uri(mlflow_root)
    params = {f"group.p{i:03d}": str(i * 0.5) for i in range(150)}
    sink = MlflowSink(uri, "sink-basic")

    run_id = sink.start_run(run_name="fedpa-femnist-s0", params=params, tags={"fedcli.algorithm": "fedpa"})
    sink.log_rows([(r, key, value, None) for r in range(4) for key, value in _values(r).items()])
    sink.end_run("finished")

    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.end_time is not None
    assert run.data.params == params
    assert run.data.tags["fedcli.algorithm"] == "fedpa"
    assert run.data.tags["mlflow.runName"] == "fedpa-femnist-s0"
    assert "mlflow.parentRunId" not in run.data.tags
    for key in _values(0):
        assert _history(client, run_id, key) == [(r, _values(r)[key]) for r in range(4)]
    assert run.info.artifact_uri.startswith((mlflow_root / "mlartifacts" / "sink-basic").resolve().as_uri())


def test_nested_run_gets_parent_tag_and_statuses_map(mlflow_root: Path) -> None:
    """A child started with parent_run_id carries mlflow.parentRunId = parent id; fedcli statuses
    failed and interrupted end as MLflow FAILED and KILLED."""
    uri = default_tracking_uri(mlflow_root)
    parent, child = MlflowSink(uri, "sweep"), MlflowSink(uri, "sweep")
    parent_id = parent.start_run(run_name="sweep", params={}, tags={})

    child_id = child.start_run(
        run_name="trial-0", params={"algorithm.rho": "0.1"}, tags={}, parent_run_id=parent_id
    )
    child.end_run("failed")
    parent.end_run("interrupted")

    client = MlflowClient(uri)
    assert client.get_run(child_id).data.tags["mlflow.parentRunId"] == parent_id
    assert client.get_run(child_id).info.status == "FAILED"
    assert client.get_run(parent_id).info.status == "KILLED"


def test_tracker_rejects_bad_keys_and_non_finite_values_before_logging(tmp_path: Path) -> None:
    """The metrics MLflow gets come from the store, which applies the key and finiteness rules and
    writes nothing of a rejected round (MLflow's copy: `log_rows` of the store's rows)."""
    with SqlStore(default_store_url(tmp_path)) as store:
        tracker = Tracker(store)
        run_id = _start_tracker(tracker)
        with pytest.raises(ValueError, match=r"must be made of"):
            tracker.log_round(0, {"eval|acc": 0.5})
        with pytest.raises(NonFiniteMetricsError, match=r"eval/loss=inf"):
            tracker.log_round(0, {"eval/accuracy": 0.5, "eval/loss": math.inf})
        tracker.finish("finished")
        assert store.last_round(run_id) is None


def test_unusable_tracking_uri_is_a_tracking_error(tmp_path: Path) -> None:
    """A SQLite tracking URI below a regular file fails with one line naming the URI and the fix."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")

    with pytest.raises(TrackingError, match=r"could not open: .*; pass --tracking-uri .* or use --no-mlflow"):
        MlflowSink(f"sqlite:///{blocker}/mlflow.db", "x")


def test_tracker_writes_identical_metrics_and_linked_metadata_to_both_stores(
    mlflow_root: Path, store: SqlStore, tmp_path: Path
) -> None:
    """Every (round, key, value) in the SQL store appears once in MLflow's history at step = round
    and vice versa; the two runs point at each other; tags, params and config.json match the config."""
    uri = default_tracking_uri(mlflow_root)
    tracker = Tracker(store, _mirror(uri, store, tmp_path))

    run_id = _start_tracker(tracker)
    for round_idx in range(5):
        tracker.log_round(round_idx, _values(round_idx))
    tracker.finish("finished")

    client = MlflowClient(uri)
    record = store.get_run(run_id)
    mlflow_run = client.get_run(record.mlflow_run_id)
    frame = store.metrics_frame([run_id])
    sql_points = {(row.key, row.round_idx, row.value) for row in frame.itertuples()}
    mlflow_points = {
        (key, step, value)
        for key in mlflow_run.data.metrics
        for step, value in _history(client, mlflow_run.info.run_id, key)
    }
    assert sql_points == mlflow_points and len(frame) == 15
    assert (record.status, mlflow_run.info.status) == ("finished", "FINISHED")
    tags = mlflow_run.data.tags
    assert tags["fedcli.run_id"] == run_id and tags[
        "fedcli.config_hash"
    ] == record.config_hash == config_hash(CONFIG)
    assert (tags["fedcli.algorithm"], tags["fedcli.dataset"], tags["fedcli.partitioner"]) == (
        "fedpa",
        "femnist",
        "dirichlet",
    )
    assert (tags["fedcli.version"], tags["mlflow.source.git.commit"], tags["owner"]) == (
        "0.1.0",
        "0123abcd",
        "lab",
    )
    assert tags["mlflow.runName"] == record.run_name
    assert mlflow_run.data.params == flatten_config(CONFIG)
    config_file = client.download_artifacts(mlflow_run.info.run_id, "config.json", str(tmp_path))
    assert Path(config_file).read_text() == record.config_json and json.loads(record.config_json) == CONFIG


def test_tracker_divergence_writes_nothing_and_marks_both_runs_failed(
    mlflow_root: Path, store: SqlStore, tmp_path: Path
) -> None:
    """A NaN at round 2 raises NonFiniteMetricsError (a ValueError) listing the key; round 2 is
    absent from both stores; finish(failed, diverged_at_round=2) records it in SQL and as MLflow tag;
    MLflow gets the failed run's curve up to the failure."""
    uri = default_tracking_uri(mlflow_root)
    tracker = Tracker(store, _mirror(uri, store, tmp_path))
    run_id = _start_tracker(tracker)
    tracker.log_round(0, _values(0))
    tracker.log_round(1, _values(1))

    with pytest.raises(NonFiniteMetricsError, match=r"at round 2: train/loss=nan") as info:
        tracker.log_round(2, {**_values(2), "train/loss": math.nan})
    tracker.finish("failed", reason=str(info.value), diverged_at_round=info.value.round_idx)

    record = store.get_run(run_id)
    mlflow_run = MlflowClient(uri).get_run(record.mlflow_run_id)
    assert store.last_round(run_id) == 1
    assert _history(MlflowClient(uri), record.mlflow_run_id, "eval/accuracy") == [
        (r, _values(r)["eval/accuracy"]) for r in range(2)
    ]
    assert (record.status, record.diverged_at_round) == ("failed", 2)
    assert mlflow_run.info.status == "FAILED"
    assert mlflow_run.data.tags["fedcli.diverged_at_round"] == "2"


def test_tracker_resume_reopens_both_runs_and_drops_rounds_after_checkpoint(
    mlflow_root: Path, store: SqlStore, tmp_path: Path
) -> None:
    """A run killed after round 4 with a checkpoint at round 2 is resumed from 2 through an id
    prefix: SQL keeps rounds 0..2, both runs are running again; MLflow had only rounds 0..2 (the
    mirror copies an unfinished run up to its newest checkpoint), so after rounds 3..4 are logged
    again it holds exactly one point per round, with the new values."""
    uri = default_tracking_uri(mlflow_root)
    first = Tracker(store, _mirror(uri, store, tmp_path))
    run_id = _start_tracker(first)
    for round_idx in range(5):
        first.log_round(round_idx, _values(round_idx))
        if round_idx == 2:
            first.checkpoint(2, tmp_path / "ckpt-2.pt")
    first.finish("interrupted", reason="SIGKILL")
    client = MlflowClient(uri)
    mlflow_id = store.get_run(run_id).mlflow_run_id
    assert [s for s, _ in _history(client, mlflow_id, "eval/accuracy")] == [0, 1, 2]
    assert client.get_run(mlflow_id).info.status == "KILLED"

    second = Tracker(store, _mirror(uri, store, tmp_path))
    record = second.resume(run_id[:8], from_round=2)
    assert (record.id, record.status, store.last_round(run_id)) == (run_id, "running", 2)
    for round_idx in (3, 4):
        second.log_round(round_idx, {"eval/accuracy": 0.9})
    second.finish("finished")
    accuracy = store.metrics_frame([run_id], keys=["eval/accuracy"])["value"].tolist()
    expected = [_values(r)["eval/accuracy"] for r in range(3)] + [0.9, 0.9]
    assert accuracy == expected
    assert store.get_run(run_id).mlflow_run_id == mlflow_id
    assert client.get_run(mlflow_id).info.status == "FINISHED"
    assert _history(client, mlflow_id, "eval/accuracy") == list(enumerate(expected))


def test_tracker_without_mlflow_writes_the_store_only(tmp_path: Path) -> None:
    """With mlflow=None the tracker logs to SQL, records no MLflow id (files in the run's folder reach MLflow only through the mirror)."""
    with SqlStore(default_store_url(tmp_path)) as store:
        tracker = Tracker(store)
        run_id = _start_tracker(tracker)
        tracker.log_round(0, _values(0))
        tracker.finish("finished")

        record = store.get_run(run_id)
        assert (record.status, record.mlflow_run_id, store.last_round(run_id)) == ("finished", None, 0)
        assert record.tags == {"owner": "lab", "fedcli.dataset": "femnist", "fedcli.partitioner": "dirichlet"}


@pytest.mark.timeout(180)
def test_train_logs_the_final_model_as_an_mlflow_model_in_the_runs_experiment(tmp_path: Path) -> None:
    """A real `fedcli train` (mnist, 1 round, MLflow on): the run's experiment holds one READY
    logged model whose source is the run, linked as the run's output at the last round; it is a
    pyfunc model from code with no pickled file (docs/operations.md, "Security"); loaded with
    `mlflow.pyfunc.load_model` it maps stored rows (uint8 pixels) to the same logits as the task's
    module with model.pt's parameters on prepared inputs (computed here with torch.func, not with
    fedcli's served wrapper), and `unwrap_python_model().module` is that module; its signature is
    uint8 (-1, 28, 28) -> float32 (-1, 10); the empty "Default" experiment of the new store is deleted."""
    import mlflow
    import torch

    from fedcli.datasets.registry import resolve_task
    from tests.tracking.logged_model import train_and_log

    client, run, logged, fedcli_id = train_and_log(tmp_path)
    saved = torch.load(tmp_path / "runs" / fedcli_id / "model.pt", map_location="cpu", weights_only=True)
    task = resolve_task("mnist", None, None)
    rows = saved["example"]
    expected = torch.func.functional_call(
        task.models[saved["model"]]().eval(), saved["params"], (task.prepare(rows),)
    )

    from fedcli.tracking.mlflow.sink import global_tracking_uri

    with global_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}"):  # not left in os.environ for later tests
        loaded = mlflow.pyfunc.load_model(logged.model_uri)
        info = mlflow.models.get_model_info(logged.model_uri)
    files = [p.name for p in tmp_path.joinpath("mlartifacts").rglob("*") if p.is_file()]

    assert logged.source_run_id == run.info.run_id and logged.status.name == "READY"
    assert [(out.model_id, out.step) for out in run.outputs.model_outputs] == [(logged.model_id, 1)]
    assert rows.dtype == torch.uint8 and rows.shape == (2, 28, 28)
    assert torch.allclose(torch.as_tensor(loaded.predict(rows.numpy())), expected, atol=1e-6)
    assert torch.allclose(loaded.unwrap_python_model().module(rows), expected, atol=1e-6)
    assert "served.pt" in files and not [name for name in files if name.endswith((".pkl", ".pickle"))]
    assert info.signature.inputs.to_dict()[0]["tensor-spec"] == {"dtype": "uint8", "shape": (-1, 28, 28)}
    assert info.signature.outputs.to_dict()[0]["tensor-spec"] == {"dtype": "float32", "shape": (-1, 10)}
    assert client.get_experiment("0").lifecycle_stage == "deleted"


def test_logging_a_model_leaves_the_environment_as_it_was(
    mlflow_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Model.log needs MLflow's global tracking URI, which mlflow.set_tracking_uri also writes to
    os.environ: an in-process log_model (`fedcli sync`) must not leave MLFLOW_TRACKING_URI behind
    for the processes started after it, nor drop a user's own."""
    import os

    import torch

    uri = default_tracking_uri(mlflow_root)
    sink = MlflowSink(uri, "model-env")
    sink.start_run(run_name="m", params={}, tags={})
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    weights = mlflow_root / "served-env.pt"
    torch.save(
        {
            "format": 1,
            "params": {"linear.weight": torch.zeros(1, 11)},
            "task": "lsq",
            "model": "linear",
            "data_file": None,
        },
        weights,
    )
    rows = torch.zeros(2, 11)
    sink.log_model(weights, example=rows, output=torch.zeros(2, 1), step=1, requirements=["torch"])
    assert "MLFLOW_TRACKING_URI" not in os.environ
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://users-own:5000")
    sink.log_model(weights, example=rows, output=torch.zeros(2, 1), step=2, requirements=["torch"])
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://users-own:5000"
    sink.end_run("finished")
