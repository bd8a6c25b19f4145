"""Test-wide settings: one intra-op thread (small tensors run faster, and the 2-core CI box
is not oversubscribed when a test spawns worker processes), and the real-service fixtures
(`pg_url`, `pg_database`: PostgreSQL through tests/pg.py; see docs/testing.md)."""

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.pg import PgServer, PgUnavailable

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """One PostgreSQL server for the session, started on first use: FEDCLI_TEST_PG_URL's server
    if set, else a throwaway local cluster. Skips (once, with the reason) when PostgreSQL or
    the psycopg driver is not installed."""
    try:
        server = PgServer.from_env_or_start()
    except PgUnavailable as err:
        pytest.skip(str(err))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_database(pg_server: PgServer) -> Callable[[], str]:
    """Factory: each call creates a new empty database and returns its SQLAlchemy URL
    (`postgresql+psycopg://user@127.0.0.1:port/name`)."""
    return pg_server.new_database


@pytest.fixture
def pg_url(pg_database: Callable[[], str]) -> str:
    """SQLAlchemy URL of a new empty PostgreSQL database for this test."""
    return pg_database()


# ----------------------------------------------------------------------------- devices


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cuda: needs a CUDA device; `--device auto` is not pinned to the CPU in it"
    )


# ----------------------------------------------------------------------------- tiers

# A module that starts processes (a CLI run, workers, a PostgreSQL server, a Ray head, torchrun):
# every test in it is `slow`, so `make test-fast` (-m "not slow") leaves it out. In-process tests
# that take seconds carry `@pytest.mark.slow` themselves (docs/testing.md "Tiers").
STARTS_PROCESSES = re.compile(
    r"^\s*(?:import|from)\s+(?:subprocess|multiprocessing|tests\.pg|tests\.ray_head|ray)\b|\bpg_(?:url|database|server)\b",
    re.M,
)


# `make test` runs the suite on several workers (pytest-xdist, `--dist loadgroup`). A group runs on one
# worker in collection order: the Ray tests (each starts a head; test_ray_secrets.py finds its head's
# session folder among /tmp/rt*), and each task's cells of the short matrix (fedavg first: the other
# algorithms compare with its curve, kept per worker).
USES_RAY = re.compile(
    r"^\s*(?:import|from)\s+(?:tests\.ray_head|tests\.sweeps\.test_ray_backend|ray)\b", re.M
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    starts: dict[Path, tuple[bool, bool]] = {}
    for item in items:
        path = item.path
        if path not in starts:
            text = path.read_text()
            starts[path] = (bool(STARTS_PROCESSES.search(text)), bool(USES_RAY.search(text)))
        processes, ray = starts[path]
        if processes:
            item.add_marker(pytest.mark.slow)
        if ray:
            item.add_marker(pytest.mark.xdist_group("ray"))
        params = getattr(item, "callspec", None)
        if path.name == "test_out_of_the_box.py" and params is not None and "task" in params.params:
            item.add_marker(pytest.mark.xdist_group(f"matrix-{params.params['task']}"))


def pin_auto_device_to_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make train.device='auto' (every config's default) resolve to the CPU.

    The tests check numbers, executors and worker processes as they are on a CPU; with a GPU
    visible, `auto` would move them to CUDA (31 tests failed so under `make test` on an H100).
    Explicit devices ('cpu', 'cuda') are untouched, so tests about devices say which they want.
    """
    import fedcli.engine.setup as setup

    resolve = setup.resolve_device
    monkeypatch.setattr(setup, "resolve_device", lambda name: resolve("cpu" if name == "auto" else name))


@pytest.fixture(autouse=True)
def _auto_device_is_the_cpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test not marked `cuda` runs `--device auto` on the CPU, GPU or not (a no-op without CUDA)."""
    if torch.cuda.is_available() and request.node.get_closest_marker("cuda") is None:
        pin_auto_device_to_cpu(monkeypatch)
