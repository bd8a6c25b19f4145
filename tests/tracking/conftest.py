"""Fixtures of the tracking tests: a fresh SQL store per test, one MLflow store per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fedcli.tracking.store.common import default_store_url
from fedcli.tracking.store.sql_store import SqlStore


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    """A SQLite-backed store in this test's temporary directory."""
    sql_store = SqlStore(default_store_url(tmp_path / "runs"))
    yield sql_store
    sql_store.close()


@pytest.fixture(scope="session")
def mlflow_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of one real SQLite-backed MLflow store shared by every MLflow test.

    Creating an MLflow SQLite store runs its schema migrations (seconds), so it is done
    once here; tests isolate themselves with their own experiment names.
    """
    from fedcli.tracking.mlflow.sink import MlflowSink, default_tracking_uri

    root = tmp_path_factory.mktemp("mlflow-root")
    MlflowSink(default_tracking_uri(root), "warm-up")  # runs the migrations once
    return root
