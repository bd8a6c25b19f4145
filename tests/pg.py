"""A real PostgreSQL server for the test suite (the `pg_url` / `pg_database` fixtures).

`PgServer.start()` starts one throwaway cluster per test session: `initdb` into a fresh
temporary directory (trust authentication, no fsync), `postgres` listening on 127.0.0.1
at a free port with its unix socket in that directory, stopped and removed at the end.
As root (CI), the cluster runs as the unprivileged `postgres` system user that Debian's
`postgresql` package creates, since PostgreSQL refuses to run as root.

`FEDCLI_TEST_PG_URL` points the suite at an existing server instead, e.g.
`postgresql://me@db.example:5432/postgres`: its user must be allowed to CREATE DATABASE;
the databases the tests create there are dropped at the end of the session.

`PgUnavailable` is raised (and turned into a pytest skip by the fixtures) when the server
binaries, the psycopg driver or an unprivileged user to run the server as are missing;
its message names what is missing and how to get it. See docs/testing.md.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import itertools
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_URL = "FEDCLI_TEST_PG_URL"
DRIVER = "postgresql+psycopg"
SUPERUSER = "fedcli"  # the cluster's bootstrap superuser (trust auth, no password)
START_TIMEOUT_S = 30
INSTALL_SERVER = "apt-get install postgresql (Debian/Ubuntu), or set FEDCLI_TEST_PG_URL to an existing server"
INSTALL_DRIVER = "pip install 'psycopg[binary]>=3.1' (part of the dev extra: pip install -e '.[dev]')"

# Settings for a disposable cluster: durability off, small footprint, quick shutdown.
_SERVER_SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "100",
    "shared_buffers": "32MB",
    "max_wal_size": "256MB",
    "log_min_messages": "warning",
    "logging_collector": "off",
}


class PgUnavailable(RuntimeError):
    """No PostgreSQL server can be had; the message says what is missing and the fix."""


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", path)) or (0,)


def find_bindir() -> Path:
    """Directory holding `initdb`, `pg_ctl` and `postgres`: PATH first, then /usr/lib/postgresql/*/bin
    (newest version first).

    Raises:
        PgUnavailable: No directory has all three.
    """
    candidates: list[Path] = []
    initdb = shutil.which("initdb")
    if initdb is not None:
        candidates.append(Path(os.path.realpath(initdb)).parent)
    candidates += [
        Path(d) for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version_key, reverse=True)
    ]
    for bindir in candidates:
        if all(os.access(bindir / tool, os.X_OK) for tool in ("initdb", "pg_ctl", "postgres")):
            return bindir
    raise PgUnavailable(
        "PostgreSQL server not installed (no initdb/pg_ctl/postgres on PATH or in "
        f"/usr/lib/postgresql/*/bin): {INSTALL_SERVER}"
    )


def require_driver() -> None:
    """Raises PgUnavailable when psycopg (the driver behind `postgresql+psycopg://`) cannot be imported."""
    try:
        import psycopg  # noqa: F401
    except ImportError as err:
        raise PgUnavailable(f"PostgreSQL driver psycopg not installed ({err}): {INSTALL_DRIVER}") from err


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _server_user() -> pwd.struct_passwd | None:
    """The account to run the server as: None (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise PgUnavailable(
        "running as root and no unprivileged 'postgres' user to run the PostgreSQL server as: "
        f"{INSTALL_SERVER} (the package creates the user)"
    )


def _workdir_parent(user: pwd.struct_passwd | None) -> str:
    """Where to make the cluster's directory: the temp dir (not pytest's tmp_path, private to
    us), unless the server's user could not reach it or the unix socket path would be too long
    (about 107 bytes), then /tmp."""
    parent = tempfile.gettempdir()
    if len(parent) > 60:
        return "/tmp"
    if user is not None:
        path = Path(parent).resolve()
        for folder in (path, *path.parents):
            if not os.stat(folder).st_mode & 0o001:  # others may not traverse it
                return "/tmp"
    return parent


@dataclass
class PgServer:
    """One PostgreSQL server the tests may create databases on.

    `url` is the SQLAlchemy URL of its maintenance database (`postgres`) as a superuser /
    CREATEDB user; `new_database()` returns the URL of a fresh empty database.
    """

    url: str
    owned: bool  # True: our throwaway cluster (stopped and removed by stop())
    workdir: Path | None = None
    bindir: Path | None = None
    startup_s: float = 0.0
    _options: str = ""  # the server options it was started with (port, socket folder): `restart` reuses them
    _user: Any = None
    _created: list[str] = field(default_factory=list)
    _counter: Any = field(default_factory=itertools.count)

    # ----------------------------------------------------------------- start / stop

    @classmethod
    def from_env_or_start(cls) -> PgServer:
        """The server named by FEDCLI_TEST_PG_URL when set, else a throwaway local cluster."""
        require_driver()
        external = os.environ.get(ENV_URL, "").strip()
        if external:
            return cls.external(external)
        return cls.start()

    @classmethod
    def external(cls, url: str) -> PgServer:
        """An existing server; checks the connection now so that a bad URL fails once, clearly."""
        from sqlalchemy.engine import make_url

        parsed = make_url(url).set(drivername=DRIVER)
        if not parsed.database:
            parsed = parsed.set(database="postgres")
        server = cls(url=parsed.render_as_string(hide_password=False), owned=False)
        try:
            server._admin_execute("SELECT 1")
        except Exception as err:
            raise RuntimeError(
                f"{ENV_URL}={parsed.render_as_string(hide_password=True)!r}: cannot connect: {err}"
            ) from err
        return server

    @classmethod
    def start(cls) -> PgServer:
        """initdb + start a cluster in a new temporary directory; waits until it accepts connections.

        Raises:
            PgUnavailable: Binaries or an unprivileged user are missing.
            RuntimeError: initdb or the server failed (with the tail of the server log).
        """
        began = time.monotonic()
        bindir = find_bindir()
        user = _server_user()
        workdir = Path(tempfile.mkdtemp(prefix="fedcli-pg-", dir=_workdir_parent(user)))
        server = cls(url="", owned=True, workdir=workdir, bindir=bindir, _user=user)
        try:
            data, sockets = workdir / "data", workdir / "sock"
            sockets.mkdir()
            if user is not None:
                for path in (workdir, sockets):
                    os.chown(path, user.pw_uid, user.pw_gid)
            server._run(
                "initdb",
                ["-D", str(data), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8", "--no-locale", "--no-sync"],
            )
            for attempt in range(3):  # the free port may be taken between probing and binding
                port = _free_port()
                options = " ".join(f"-c {key}={value}" for key, value in _SERVER_SETTINGS.items())
                options += f" -p {port} -k {sockets}"
                try:
                    server._run(
                        "pg_ctl",
                        [
                            "-D",
                            str(data),
                            "-l",
                            str(workdir / "server.log"),
                            "-w",
                            "-t",
                            str(START_TIMEOUT_S),
                            "-o",
                            options,
                            "start",
                        ],
                    )
                except RuntimeError:
                    if attempt == 2:
                        raise
                    continue
                server._options = options
                break
            server.url = f"{DRIVER}://{SUPERUSER}@127.0.0.1:{port}/postgres"
            server._admin_execute("SELECT 1")
        except BaseException:
            server.stop()
            raise
        server.startup_s = time.monotonic() - began
        atexit.register(server.stop)  # also when the session ends without running its finalizers
        return server

    def stop(self) -> None:
        """Stop and remove a throwaway cluster; drop the databases made on an external server."""
        if not self.owned:
            for name in self._created:
                with contextlib.suppress(Exception):
                    self._admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            self._created.clear()
            return
        if self.workdir is None:
            return
        data = self.workdir / "data"
        if (data / "postmaster.pid").exists():
            with contextlib.suppress(Exception):
                self._run("pg_ctl", ["-D", str(data), "-m", "immediate", "-w", "-t", "10", "stop"])
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir = None

    def restart(self, down_s: float) -> None:
        """Stop the server (fast shutdown: clients are disconnected, as in a real restart), keep it
        down `down_s` seconds, then start it again on the same port and socket folder.

        Only for a throwaway cluster (`owned`): an external server is never restarted.
        """
        if not self.owned or self.workdir is None:
            raise RuntimeError(
                "restart() needs the throwaway cluster of PgServer.start(), not an external server"
            )
        data = str(self.workdir / "data")
        self._run("pg_ctl", ["-D", data, "-m", "fast", "-w", "-t", str(START_TIMEOUT_S), "stop"])
        time.sleep(down_s)
        self._run(
            "pg_ctl",
            [
                "-D",
                data,
                "-l",
                str(self.workdir / "server.log"),
                "-w",
                "-t",
                str(START_TIMEOUT_S),
                "-o",
                self._options,
                "start",
            ],
        )

    # ----------------------------------------------------------------- databases

    def new_database(self, prefix: str = "fedcli_test") -> str:
        """CREATE DATABASE with a unique name; returns its SQLAlchemy URL."""
        from sqlalchemy.engine import make_url

        name = f"{prefix}_{next(self._counter)}_{uuid.uuid4().hex[:8]}"
        self._admin_execute(f'CREATE DATABASE "{name}"')
        self._created.append(name)
        return make_url(self.url).set(database=name).render_as_string(hide_password=False)

    def _admin_execute(self, sql: str) -> None:
        """Run one statement outside a transaction (CREATE/DROP DATABASE) on the maintenance database."""
        import psycopg
        from sqlalchemy.engine import make_url

        parsed = make_url(self.url)
        with psycopg.connect(
            host=parsed.host or "127.0.0.1",
            port=parsed.port or 5432,
            user=parsed.username,
            password=parsed.password,
            dbname=parsed.database or "postgres",
            autocommit=True,
            connect_timeout=10,
        ) as conn:
            conn.execute(sql)  # type: ignore[arg-type]

    # ----------------------------------------------------------------- helpers

    def _run(self, tool: str, args: list[str]) -> None:
        """Run a server tool (as the unprivileged user when we are root); RuntimeError with its output."""
        assert self.bindir is not None and self.workdir is not None
        kwargs: dict[str, Any] = {}
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "LANG": "C"}
        if self._user is not None:
            kwargs = {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}
            env["HOME"] = str(self.workdir)
        done = subprocess.run(
            [str(self.bindir / tool), *args],
            cwd=self.workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=START_TIMEOUT_S + 30,
            check=False,
            **kwargs,
        )
        if done.returncode != 0:
            log_file = self.workdir / "server.log"
            log_tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
            raise RuntimeError(
                f"{tool} failed (exit {done.returncode}): {done.stdout.strip()[-2000:]}"
                + (f"\nserver log:\n{log_tail}" if log_tail else "")
            )
