"""The SQL results store: schema round trip, resume support, lookups, errors, concurrency."""

from __future__ import annotations

import hashlib
import math
import multiprocessing
import sqlite3
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from fedcli.errors import ConfigError, TrackingError
from fedcli.tracking.keys import NonFiniteMetricsError
from fedcli.tracking.store.common import canonical_json, config_hash, default_store_url
from fedcli.tracking.store.sql_store import SqlStore

CONFIG = {
    "seed": 1,
    "algorithm": {"name": "fedpa", "rho": 0.1},
    "partition": {"scheme": "dirichlet", "alpha": 0.5},
}


def _start(store: SqlStore, **overrides: Any) -> str:
    """Start a run with fixed defaults; keyword overrides replace them."""
    arguments: dict[str, Any] = {
        "experiment": "exp",
        "run_name": None,
        "config": CONFIG,
        "algo": "fedpa",
        "task": "femnist",
        "seed": 1,
        "tags": {"owner": "lab"},
        "fedcli_version": "0.1.0",
        "torch_version": "2.4.0",
        "git_commit": "abc123",
    }
    arguments.update(overrides)
    return store.start_run(**arguments)


def _round_values(round_idx: int) -> dict[str, float]:
    """Distinct values per round and key, so a row written to the wrong place shows."""
    return {
        "eval/accuracy": 0.5 + 0.1 * round_idx,
        "train/loss": 2.0 / (round_idx + 1),
        "comm/bytes_up": 1000.0 * round_idx,
    }


def test_helpers_canonical_json_hash_and_default_url(tmp_path: Path) -> None:
    """Canonical JSON ignores key order and has no spaces; the hash is sha256 of it; the default URL is absolute."""
    text = canonical_json({"b": [1, 2], "a": {"y": 1, "x": None}})

    assert text == '{"a":{"x":null,"y":1},"b":[1,2]}'
    assert config_hash({"a": {"x": None, "y": 1}, "b": [1, 2]}) == hashlib.sha256(text.encode()).hexdigest()
    assert default_store_url(tmp_path / "r") == f"sqlite:///{(tmp_path / 'r').resolve()}/fedcli.db"
    assert default_store_url().startswith("sqlite:////")


def test_round_trip_run_fields_metrics_and_listing(store: SqlStore) -> None:
    """A run started, logged for rounds 0..2 and finished reads back with every field, and
    metrics_frame returns exactly the logged (run, round, key, value) rows in (run, key, round) order."""
    run_id = _start(store)
    for round_idx in range(3):
        store.log_round(run_id, round_idx, _round_values(round_idx))
    store.end_run(run_id, "finished")
    other = _start(store, experiment="other", algo="fedavg", seed=2, config={**CONFIG, "seed": 2})

    record = store.get_run(run_id)
    frame = store.metrics_frame([run_id])

    assert (len(run_id), set(run_id) <= set("0123456789abcdef")) == (32, True)
    assert (record.experiment, record.algo, record.task, record.seed, record.status) == (
        "exp",
        "fedpa",
        "femnist",
        1,
        "finished",
    )
    assert record.run_name == f"fedpa-femnist-s1-{run_id[:6]}"
    assert record.config == CONFIG and record.config_json == canonical_json(CONFIG)
    assert record.config_hash == config_hash(CONFIG)
    assert record.tags == {"owner": "lab"} and record.git_commit == "abc123"
    assert record.ended_at is not None and record.ended_at >= record.created_at
    assert (record.failure_reason, record.diverged_at_round, record.mlflow_run_id) == (None, None, None)
    expected = pd.DataFrame(
        [(run_id, r, key, value) for r in range(3) for key, value in _round_values(r).items()],
        columns=["run_id", "round_idx", "key", "value"],
    ).sort_values(["run_id", "key", "round_idx"], ignore_index=True)
    pd.testing.assert_frame_equal(frame, expected.astype({"round_idx": "int64", "value": "float64"}))
    assert store.metrics_frame([run_id], keys=["train/loss"])["value"].tolist() == [2.0, 1.0, 2.0 / 3]
    assert [r.id for r in store.list_runs()] == [run_id, other]
    assert [r.id for r in store.list_runs(experiment="other")] == [other]
    assert [r.id for r in store.list_runs(where={"algo": "fedavg"})] == [other]
    assert [r.id for r in store.list_runs(where={"algorithm.rho": "0.10", "seed": "1"})] == [run_id]
    assert [r.id for r in store.list_runs(where={"owner": "lab", "status": "running"})] == [other]


def test_list_runs_rejects_unknown_filter_key_and_experiment(store: SqlStore) -> None:
    """A misspelt filter key or experiment is a ConfigError suggesting the nearest name."""
    _start(store)

    with pytest.raises(
        ConfigError, match=r"unknown run filter key 'algorithm.rhoo' \(did you mean 'algorithm.rho'\?\)"
    ):
        store.list_runs(where={"algorithm.rhoo": "0.1"})
    with pytest.raises(ConfigError, match=r"unknown experiment 'exq' \(did you mean 'exp'\?\)"):
        store.list_runs(experiment="exq")


def test_relogging_a_round_overwrites_its_values(store: SqlStore) -> None:
    """Logging (run, round, key) twice keeps one row holding the second value; other keys stay."""
    run_id = _start(store)
    store.log_round(run_id, 1, {"eval/accuracy": 0.3, "train/loss": 1.5})

    store.log_round(run_id, 1, {"eval/accuracy": 0.7})

    frame = store.metrics_frame([run_id])
    assert frame[["round_idx", "key", "value"]].values.tolist() == [
        [1, "eval/accuracy", 0.7],
        [1, "train/loss", 1.5],
    ]


def test_non_finite_or_bad_key_round_writes_nothing(store: SqlStore) -> None:
    """A round with a NaN value or a malformed key raises and leaves no row of that round."""
    run_id = _start(store)

    with pytest.raises(NonFiniteMetricsError, match=r"train/loss=nan"):
        store.log_round(run_id, 0, {"eval/accuracy": 0.5, "train/loss": math.nan})
    with pytest.raises(ValueError, match=r"must not contain '//'"):
        store.log_round(run_id, 0, {"eval//accuracy": 0.5})

    assert store.last_round(run_id) is None


def test_delete_rounds_after_drops_later_rounds_clients_and_checkpoints(
    store: SqlStore, tmp_path: Path
) -> None:
    """Resume from the round-2 checkpoint: rows of rounds 3..5 go, rounds 0..2 stay untouched."""
    run_id = _start(store)
    for round_idx in range(6):
        clients = [(7, "client/loss", round_idx + 0.5), (3, "client/loss", 1.0)]
        store.log_round(run_id, round_idx, _round_values(round_idx), clients)
    for round_idx in (2, 4):
        store.add_checkpoint(run_id, round_idx, tmp_path / f"ckpt-{round_idx}.pt")

    deleted = store.delete_rounds_after(run_id, 2)

    assert deleted == 3 * len(_round_values(0))
    assert store.last_round(run_id) == 2
    assert store.checkpoints(run_id) == [(2, str(tmp_path / "ckpt-2.pt"))]
    assert sorted(store.metrics_frame([run_id])["round_idx"].unique().tolist()) == [0, 1, 2]
    assert sorted(store.client_metrics_frame([run_id])["round_idx"].unique().tolist()) == [0, 1, 2]


def test_end_run_records_failure_and_reopen_clears_it(store: SqlStore) -> None:
    """end_run stores status, reason and divergence round; mark_running resets them; bad status is rejected."""
    run_id = _start(store)

    store.end_run(run_id, "failed", reason="non-finite metric values at round 4", diverged_at_round=4)
    failed = store.get_run(run_id)
    store.mark_running(run_id)
    reopened = store.get_run(run_id)

    assert (failed.status, failed.diverged_at_round, failed.failure_reason) == (
        "failed",
        4,
        "non-finite metric values at round 4",
    )
    assert (reopened.status, reopened.ended_at, reopened.diverged_at_round) == ("running", None, None)
    with pytest.raises(
        ValueError, match=r"status must be one of finished, failed, interrupted, pruned; got 'done'"
    ):
        store.end_run(run_id, "done")


def test_run_fields_tags_and_evaluations(store: SqlStore) -> None:
    """set_run_fields/set_tags update one run; evaluations are stored one row per metric with options."""
    run_id = _start(store)

    store.set_run_fields(run_id, model_path="/m/final.pt", mlflow_run_id="f" * 32)
    store.set_tags(run_id, {"note": "baseline"})
    store.add_evaluation(
        run_id,
        split="test",
        metrics={"eval/accuracy": 0.9, "eval/loss": 0.3},
        round_idx=5,
        options={"predictive": "ensemble", "samples": 4},
    )

    record = store.get_run(run_id)
    evaluations = store.evaluations_frame([run_id])
    assert (record.model_path, record.mlflow_run_id) == ("/m/final.pt", "f" * 32)
    assert record.tags == {"owner": "lab", "note": "baseline"}
    assert evaluations[["round_idx", "split", "key", "value"]].values.tolist() == [
        [5, "test", "eval/accuracy", 0.9],
        [5, "test", "eval/loss", 0.3],
    ]
    assert set(evaluations["options_json"]) == {'{"predictive":"ensemble","samples":4}'}
    with pytest.raises(ValueError, match=r"set_run_fields accepts"):
        store.set_run_fields(run_id, status="finished")


def test_get_run_by_prefix_name_and_errors(store: SqlStore) -> None:
    """A unique id prefix or an exact run name finds a run; an ambiguous prefix and an unknown
    reference are ConfigErrors with the fix in the message."""
    first = _start(store, run_id="abcd" + "0" * 28, run_name="baseline")
    _start(store, run_id="abcd" + "1" * 28)

    assert store.get_run("abcd0").id == first
    assert store.get_run("ABCD0").id == first
    assert store.get_run("baseline").id == first
    with pytest.raises(ConfigError, match=r"run id prefix 'abcd' matches several runs"):
        store.get_run("abcd")
    with pytest.raises(ConfigError, match=r"unknown run 'abc9'; `fedcli list runs` shows the ids"):
        store.get_run("abc9")
    with pytest.raises(TrackingError, match=r"could not start a run: .*UNIQUE"):
        _start(store, run_id=first)


def test_sqlite_store_uses_wal_journal(store: SqlStore, tmp_path: Path) -> None:
    """The database file is in WAL mode (persistent), so readers never block writers."""
    with sqlite3.connect(tmp_path / "runs" / "fedcli.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_unwritable_or_malformed_store_url_is_a_tracking_error(tmp_path: Path) -> None:
    """A SQLite path below a regular file cannot be created; a malformed URL or unknown
    dialect is refused. Each error is one line naming the URL and how to fix it."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    url = f"sqlite:///{blocker}/sub/fedcli.db"

    with pytest.raises(TrackingError, match=r"pass --store with a writable path or set FEDCLI_STORE") as info:
        SqlStore(url)
    with pytest.raises(TrackingError, match=r"store 'not a url' is not a valid SQLAlchemy URL"):
        SqlStore("not a url")
    with pytest.raises(TrackingError, match=r"store 'nosuchdb://h/x' cannot be used"):
        SqlStore("nosuchdb://h/x")

    assert str(info.value).startswith(f"store {url!r} is not writable: ")
    assert "\n" not in str(info.value)


def _write_rounds(url: str, worker: int, barrier: Any) -> None:
    """Child process: open the (possibly fresh) store together with the others, log 50 rounds x 5 keys."""
    barrier.wait()
    store = SqlStore(url)
    run_id = _start(store, run_name=f"worker-{worker}", seed=worker)
    for round_idx in range(50):
        store.log_round(run_id, round_idx, {f"m/k{k}": worker * 1000 + round_idx * 10 + k for k in range(5)})
    store.end_run(run_id, "finished")
    store.close()


def test_four_processes_write_one_sqlite_file_without_losing_rows(tmp_path: Path) -> None:
    """Four processes open a not-yet-existing file at the same moment and each log 50 rounds x 5 keys.
    Every one of the 4*50*5 = 1000 rows must be present with value worker*1000 + round*10 + k."""
    url = default_store_url(tmp_path / "shared")
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(4)
    processes = [context.Process(target=_write_rounds, args=(url, worker, barrier)) for worker in range(4)]

    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=60)

    assert [process.exitcode for process in processes] == [0, 0, 0, 0]
    with SqlStore(url) as store:
        runs = store.list_runs()
        frame = store.metrics_frame([run.id for run in runs])
    assert sorted(run.run_name for run in runs) == [f"worker-{w}" for w in range(4)]
    assert {run.status for run in runs} == {"finished"}
    assert len(frame) == 1000
    seed_of = {run.id: run.seed for run in runs}
    expected = [
        seed_of[row.run_id] * 1000 + row.round_idx * 10 + int(row.key[-1]) for row in frame.itertuples()
    ]
    assert frame["value"].tolist() == expected
