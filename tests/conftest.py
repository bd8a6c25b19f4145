"""Test-wide settings: one intra-op thread (small tensors run faster, and the 2-core CI box
is not oversubscribed when a test spawns worker processes), and the real-service fixtures
(`pg_url`, `pg_database`: PostgreSQL through tests/pg.py; see docs/testing.md)."""

from collections.abc import Callable, Iterator

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
