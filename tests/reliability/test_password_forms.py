"""Every form of a password in a store URL stays secret, and a search sweep connects with it (issue 35).

`mask_url` (fedcli/tracking/urls.py) over every form a password takes; a `search:` sweep (TPE, median
pruner) on a real PostgreSQL role whose password holds `/`, `#`, `@` and `'` and whose name holds `@`,
given percent-encoded, raw and as `?password=`, by `--store` and by FEDCLI_STORE, killed (SIGKILL) and
resumed: nothing written, printed, dumped from the database or on a command line holds the password.
The server of tests/pg.py trusts every user; this test's role alone must give its password
(scram-sha-256 in pg_hba.conf), so a URL that lost its password fails. An unreachable store and a
wrong password: one line, exit 2. An older store's checkpoints and model files are masked on upgrade.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest
import torch
from sqlalchemy.engine import make_url

from fedcli.tracking.store.sql_store import SqlStore
from fedcli.tracking.urls import has_password, is_masked, mask_url

PASSWORD = "pwA1k9/pwB2m8#pwC3n7@pwD4q6'pwE5r5"
PIECES = ("pwA1k9", "pwB2m8", "pwC3n7", "pwD4q6", "pwE5r5")  # a password cut by a masker leaks one of these
NEEDLES = (PASSWORD, quote(PASSWORD, safe=""), quote_plus(PASSWORD), *PIECES)
ROLE = "fed@cli"
ENCODED = quote(PASSWORD, safe="")


def leaks(text: str | bytes) -> list[str]:
    data = text.encode("utf-8", "replace") if isinstance(text, str) else text
    return [n for n in NEEDLES if n.encode() in data]


# --------------------------------------------------------------------------- the masker

H = "127.0.0.1:5432"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (f"postgresql+psycopg://fed%40cli:{ENCODED}@{H}/db", f"postgresql+psycopg://fed%40cli:***@{H}/db"),
        (
            f"postgresql+psycopg://fed@cli:{PASSWORD.replace('@', '%40')}@{H}/db",
            f"postgresql+psycopg://fed%40cli:***@{H}/db",
        ),
        (
            f"postgresql+psycopg://me:{PASSWORD}@{H}/db",
            f"postgresql+psycopg://me:***@{H}/db",
        ),  # "@" not encoded
        ("postgresql://me:a/b@h/db", "postgresql://me:***@h/db"),
        ("postgresql://me:a#b@h/db", "postgresql://me:***@h/db"),
        ("postgresql://me:it's@h/db", "postgresql://me:***@h/db"),
        ("postgresql://me:a%2Fb@h/db?sslmode=require", "postgresql://me:***@h/db?sslmode=require"),
        (
            f"postgresql+psycopg://me@{H}/db?password={ENCODED}",
            f"postgresql+psycopg://me@{H}/db?password=***",
        ),
        (
            f"postgresql+psycopg://me@{H}/db?sslmode=disable&PassWord={ENCODED}",
            f"postgresql+psycopg://me@{H}/db?sslmode=disable&PassWord=***",
        ),
        (
            f"postgresql+psycopg://me@{H}/db?password={PASSWORD}",
            f"postgresql+psycopg://me@{H}/db?password=***",
        ),
        (
            "mysql://me@h/db?passwd=x&pwd=y&sslpassword=z",
            "mysql://me@h/db?passwd=***&pwd=***&sslpassword=***",
        ),
        ("http://u:p@ss@mlflow:5000/", "http://u:***@mlflow:5000/"),
        ("postgresql://user@host/db", "postgresql://user@host/db"),  # no password: unchanged
        ("http://host:5000", "http://host:5000"),
        ("sqlite:////tmp/a:b@c/fedcli.db", "sqlite:////tmp/a:b@c/fedcli.db"),  # a path, not a credential
        ("sqlite:///relative/fedcli.db", "sqlite:///relative/fedcli.db"),
        ("postgresql//me:a/b@host/db", "postgresql//me:***@host/db"),  # malformed: masked all the same
        ("postgresql://me:a/b@host:port/db", "postgresql://me:***@host:port/db"),
        (
            f"fedcli train --store 'postgresql+psycopg://fed%40cli:pwA1k9/pwB2m8#pwC3n7%40pwD4q6'\"'\"'pwE5r5@{H}/db' -q",
            f"fedcli train --store 'postgresql+psycopg://fed%40cli:***@{H}/db' -q",
        ),
        (
            f'store "postgresql://me:{PASSWORD.replace("@", "%40")}@h/db" cannot be opened; x=http://a:b@c',
            'store "postgresql://me:***@h/db" cannot be opened; x=http://a:***@c',
        ),
        (
            f"- command: `fedcli report --store postgresql://me@h/db?password={ENCODED}`",
            "- command: `fedcli report --store postgresql://me@h/db?password=***`",
        ),
    ],
)
def test_mask_url_hides_every_form_of_password_and_nothing_else(text: str, shown: str) -> None:
    assert mask_url(text) == shown
    assert leaks(shown) == [] and "a/b" not in shown and "a#b" not in shown and "it's" not in shown
    secret = shown != text
    assert has_password(text) is secret and has_password(shown) is False and mask_url(shown) == shown
    assert is_masked(shown) is secret


# --------------------------------------------------------------------------- a real server with a password


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")}
    return {**out, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}


class Watcher:
    """Samples `ps -eo pid,args` and the files under a folder while the commands run: lines and files that
    hold the password, except the command lines of the commands this test typed itself."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.typed, self.seen_worker = folder, set[int](), False
        self.hits: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            lines = subprocess.run(
                ["ps", "-eo", "pid,args"], capture_output=True, text=True
            ).stdout.splitlines()
            for line in lines[1:]:
                pid, _, args = line.strip().partition(" ")
                self.seen_worker |= "fedcli.sweep.worker" in args
                if leaks(args) and int(pid) not in self.typed and "pytest" not in args:
                    self.hits.add(f"ps: {args[:200]}")
            for path in self._files():  # temporary files (trial configs) live only a while
                try:
                    if path.is_file() and leaks(path.read_bytes()):
                        self.hits.add(str(path))
                except OSError:
                    pass
            time.sleep(0.2)

    def _files(self) -> list[Path]:
        """The files under the folder now (a folder removed while it is walked is left out)."""
        out = []
        for folder, _, names in os.walk(self.folder):
            out += [Path(folder) / name for name in names]
        return out

    def start(self, *args: str, extra_env: dict[str, str] | None = None, cwd: Path) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedcli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env(), **(extra_env or {})},
            cwd=cwd,
        )
        self.typed.add(proc.pid)
        return proc

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def password_role(pg_server):  # noqa: ANN001, ANN201
    """A role named `fed@cli` whose password is PASSWORD, the only role the server asks a password of
    (scram-sha-256 from 127.0.0.1), and a factory of databases it owns: (host:port, new_database)."""
    if not pg_server.owned or pg_server.workdir is None:
        pytest.skip(
            "needs the throwaway PostgreSQL cluster of tests/pg.py (to require a password of one role)"
        )
    import psycopg

    hba = pg_server.workdir / "data" / "pg_hba.conf"
    original = hba.read_text()
    literal = PASSWORD.replace("'", "''")
    pg_server._admin_execute(f"CREATE ROLE \"{ROLE}\" LOGIN PASSWORD '{literal}'")
    hba.write_text(f'host all "{ROLE}" 127.0.0.1/32 scram-sha-256\n' + original)
    pg_server._admin_execute("SELECT pg_reload_conf()")
    server = make_url(pg_server.url)
    address = f"{server.host}:{server.port}"
    names: list[str] = []

    def new_database() -> str:
        name = f"fedcli_pw_{len(names)}_{os.getpid()}"
        pg_server._admin_execute(f'CREATE DATABASE "{name}" OWNER "{ROLE}"')
        names.append(name)
        return name

    deadline = time.monotonic() + 10  # the reload is a signal: wait until the role's password is asked for
    while True:
        try:
            psycopg.connect(
                host=server.host,
                port=server.port,
                user=ROLE,
                dbname="postgres",
                password="wrong",
                connect_timeout=5,
            ).close()
        except psycopg.OperationalError as err:
            assert "password authentication failed" in str(err)
            break
        assert time.monotonic() < deadline, "pg_hba.conf reload did not take effect"
        time.sleep(0.2)
    try:
        yield address, new_database
    finally:
        hba.write_text(original)
        for name in names:
            pg_server._admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        pg_server._admin_execute(f'DROP ROLE IF EXISTS "{ROLE}"')
        pg_server._admin_execute("SELECT pg_reload_conf()")


def pg_dump(pg_server, database: str) -> str:  # noqa: ANN001
    from tests.pg import find_bindir

    server = make_url(pg_server.url)  # the trusted superuser: the dump itself needs no password
    done = subprocess.run(
        [
            str(find_bindir() / "pg_dump"),
            "-h",
            str(server.host),
            "-p",
            str(server.port),
            "-U",
            str(server.username),
            database,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


SPEC = (
    "experiment: secret-search\n"
    "base: {task: lsq, rounds: 16, clients_per_round: 3, local_epochs: 3, batch_size: 5, eval_every: 1}\n"
    "seeds: [0]\n"
    "search: {sampler: tpe, trials: 4, metric: loss, direction: min, seed: 0,\n"
    "         space: {client_lr: {log_uniform: [0.001, 0.05]}, server_opt: [sgd, adam]}}\n"
    "pruner: {type: median, warmup: 1, startup_trials: 2}\n"
    "report: {metric: loss}\n"
)


def test_a_search_sweep_on_postgresql_with_a_password_runs_resumes_and_writes_it_nowhere(
    tmp_path: Path, pg_server, password_role
) -> None:  # noqa: ANN001
    """The search runs with the raw form (`/`, `#`, `'` as typed, `@` as %40, the user name's `@` as typed)
    by --store, is SIGKILLed while a trial trains, and resumes with the `?password=` form by FEDCLI_STORE;
    a train and a report use the percent-encoded form. Every Optuna trial ends as its own run; no output,
    no file under the test's folder (runs/, checkpoints, model.pt, the MLflow store, the report), no row of
    the database (pg_dump: fedcli's tables and Optuna's study) and no command line holds the password."""
    address, new_database = password_role
    database = new_database()
    raw = f"postgresql+psycopg://{ROLE}:{PASSWORD.replace('@', '%40')}@{address}/{database}"
    query = f"postgresql+psycopg://fed%40cli@{address}/{database}?password={ENCODED}"
    encoded = f"postgresql+psycopg://fed%40cli:{ENCODED}@{address}/{database}"
    shown = f"postgresql+psycopg://fed%40cli:***@{address}/{database}"
    root, work, temp = tmp_path / "root", tmp_path / "work", tmp_path / "tmp"
    for folder in (work, temp):
        folder.mkdir()
    spec = work / "search.yaml"
    spec.write_text(SPEC)
    watcher, outputs = Watcher(tmp_path), []
    extra = {"TMPDIR": str(temp)}
    try:
        first = watcher.start(
            "sweep", str(spec), "--store", raw, "--root", str(root), extra_env=extra, cwd=work
        )
        # One reader, opened once the schema exists, polled every 0.1 s: a fast machine trains a
        # trial in about a second, and a reader opened per poll (an inspector round trip) missed it.
        deadline, live, reader = time.monotonic() + 300, None, None
        while time.monotonic() < deadline and live is None and first.poll() is None:
            time.sleep(0.1)
            reader = reader or SqlStore.reader(encoded)
            if reader is None:
                continue
            runs = reader.list_runs()
            done = [r for r in runs if r.status in ("finished", "pruned")]
            live = next(
                (r for r in runs if r.is_alive and (reader.last_round(r.id) or 0) >= 2 and done), None
            )
        if reader is not None:
            reader.close()
        first.send_signal(signal.SIGKILL)
        out, err = first.communicate(timeout=60)
        outputs.append(out + err)
        assert live is not None, f"no trial reached round 2 after another ended: {err[-2000:]}"
        db = SqlStore(encoded)
        deadline = time.monotonic() + 60  # the worker dies with the sweep: it checkpoints and stops
        while db.get_run(live.id).status == "running" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert db.get_run(live.id).status == "interrupted"

        second = watcher.start(
            "sweep", str(spec), "--root", str(root), extra_env={**extra, "FEDCLI_STORE": query}, cwd=work
        )
        out, err = second.communicate(timeout=600)
        outputs.append(out + err)
        assert second.returncode == 0, err
        assert db.get_run(live.id).status in ("finished", "pruned")  # resumed, not started again
        from tests.sweeps.test_search import check_trials_are_runs

        check_trials_are_runs(db, encoded, "secret-search", 4)

        trained = watcher.start(
            "train",
            "--task",
            "lsq",
            "--rounds",
            "3",
            "--clients-per-round",
            "3",
            "--store",
            encoded,
            "--root",
            str(root),
            "--experiment",
            "one",
            extra_env=extra,
            cwd=work,
        )
        out, err = trained.communicate(timeout=300)
        outputs.append(out + err)
        assert trained.returncode == 0, err
        assert f"store:   {shown}" in err
        report = work / "r.md"
        reported = watcher.start(
            "report",
            "--experiment",
            "secret-search",
            "--store",
            query,
            "--output",
            str(report),
            extra_env=extra,
            cwd=work,
        )
        out, err = reported.communicate(timeout=300)
        outputs.append(out + err)
        assert reported.returncode == 0, err
        text = report.read_text()
        assert "## Search" in text and "password=***" in text  # the command: and store: lines, masked
    finally:
        watcher.stop()
    assert watcher.seen_worker, "no sweep worker was seen: the ps check saw nothing"
    assert watcher.hits == set()
    assert [line for text in outputs for line in text.splitlines() if leaks(line)] == []
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "model.pt" for p in written) and any(p.parent.name == "checkpoints" for p in written)
    assert any(p.name == "mlflow.db" for p in written)
    assert [str(p) for p in written if leaks(p.read_bytes())] == []
    dump = pg_dump(pg_server, database)
    assert "COPY public.runs" in dump and "COPY public.trials" in dump and "COPY public.studies" in dump
    assert leaks(dump) == []
    run = db.get_run(live.id)
    assert run.config["tracking"]["store"] == shown  # the --store it was started with, masked
    stored = {r.config["tracking"]["store"] for r in db.list_runs(experiment="secret-search")}
    assert stored <= {shown, None}, stored


def test_a_search_sweep_on_an_unreachable_store_or_with_a_wrong_password_is_one_line(
    tmp_path: Path, password_role
) -> None:  # noqa: ANN001
    """Exit 2, one line naming the store masked, nothing written; for a refused password and for a port
    nobody listens on."""
    from tests.pg import _free_port

    address, new_database = password_role
    database = new_database()
    spec = tmp_path / "search.yaml"
    spec.write_text(SPEC)
    wrong = f"postgresql+psycopg://fed%40cli:{quote('pwA1k9/wrong', safe='')}@{address}/{database}"
    down = f"postgresql+psycopg://fed%40cli:{ENCODED}@127.0.0.1:{_free_port()}/{database}"
    for url, named in ((wrong, f"fed%40cli:***@{address}"), (down, "fed%40cli:***@127.0.0.1:")):
        for how in ("flag", "env"):
            args = ["--store", url] if how == "flag" else []
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "fedcli",
                    "sweep",
                    str(spec),
                    "--root",
                    str(tmp_path / "r"),
                    "--no-mlflow",
                    *args,
                ],
                capture_output=True,
                text=True,
                timeout=300,
                env={**env(), **({"FEDCLI_STORE": url} if how == "env" else {})},
                cwd=tmp_path,
            )
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            assert done.returncode == 2 and len(lines) == 1, (how, done.stderr[-3000:])
            assert (
                named in lines[0]
                and "Traceback" not in done.stderr
                and leaks(done.stdout + done.stderr) == []
            )
            assert not (tmp_path / "r").exists()


# --------------------------------------------------------------------------- an older store's files


def test_an_older_stores_rows_checkpoints_and_model_files_are_masked_on_upgrade(tmp_path: Path) -> None:
    """A store whose rows, checkpoints and model.pt hold passwords in the forms the first masker missed
    (a `/` in the password, `?password=`), marked masked by that masker: opening it masks rows and files
    once (the files rewritten in place, still read with weights_only=True, tensors unchanged)."""
    root = tmp_path / "root"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            "--task",
            "lsq",
            "--rounds",
            "4",
            "--clients-per-round",
            "3",
            "--checkpoint-every",
            "2",
            "--root",
            str(root),
            "--no-mlflow",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env(),
    )
    assert done.returncode == 0, done.stderr
    run_id = done.stdout.strip().splitlines()[-1]
    old_store = f"postgresql+psycopg://me:{PASSWORD.replace('@', '%40')}@db.example/runs"
    old_mlflow = f"postgresql://me@db.example/mlflow?password={ENCODED}"
    files = sorted((root / "runs" / run_id).rglob("*.pt"))
    assert len(files) >= 2 and any(f.name == "model.pt" for f in files)
    before = {}
    for path in files:  # what a fedcli before issue 35 wrote: the URLs in clear in the file's config
        payload = torch.load(path, weights_only=True)
        payload["config"]["tracking"].update(store=old_store, tracking_uri=old_mlflow)
        torch.save(payload, path)
        before[path] = payload
    db_file = root / "fedcli.db"
    conn = sqlite3.connect(db_file)
    config = json.loads(conn.execute("SELECT config_json FROM runs WHERE id = ?", (run_id,)).fetchone()[0])
    config["tracking"].update(store=old_store, tracking_uri=old_mlflow)
    conn.execute(
        "UPDATE runs SET config_json = ?, requested_json = ? WHERE id = ?",
        (json.dumps(config), json.dumps(config), run_id),
    )
    conn.execute("DELETE FROM store_meta")
    conn.execute("INSERT INTO store_meta (key, value) VALUES ('secrets_masked', '2026-01-01')")
    conn.commit()
    conn.close()  # the last connection: its write-ahead log is written into the file
    assert leaks(db_file.read_bytes()) and all(leaks(p.read_bytes()) for p in files)

    SqlStore(f"sqlite:///{db_file}").close()  # the upgrade

    assert leaks(db_file.read_bytes()) == []
    record = SqlStore(f"sqlite:///{db_file}").get_run(run_id)
    masked_store, masked_mlflow = (
        "postgresql+psycopg://me:***@db.example/runs",
        "postgresql://me@db.example/mlflow?password=***",
    )
    assert record.config["tracking"]["store"] == masked_store
    assert record.config["tracking"]["tracking_uri"] == masked_mlflow
    for path in files:
        assert leaks(path.read_bytes()) == []
        payload = torch.load(path, weights_only=True)
        assert payload["config"]["tracking"]["store"] == masked_store
        assert payload["config"]["tracking"]["tracking_uri"] == masked_mlflow
        old = before[path]
        assert payload.keys() == old.keys()
        for key in ("params", "server_state"):
            if key in old:
                assert torch.equal(
                    torch.cat([t.flatten() for t in tensors(payload[key])]),
                    torch.cat([t.flatten() for t in tensors(old[key])]),
                )
    assert list(tmp_path.rglob(".*.pt.*")) == []  # no temporary file left
    stamp = {p: p.stat().st_mtime_ns for p in files}
    SqlStore(f"sqlite:///{db_file}").close()  # done once: nothing rewritten again
    assert {p: p.stat().st_mtime_ns for p in files} == stamp


def tensors(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree) for t in tensors(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in tensors(item)]
    return []
