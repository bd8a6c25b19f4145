"""Files that cannot run code, checkpoints that must be the run's, passwords that stay secret (issue 23).

Real processes on fresh roots, as a user runs them: `fedcli train`, `--resume`, `evaluate`,
`evaluate --checkpoint`, `sync`, `report`, `sweep`; the password test uses the real
PostgreSQL server of tests/pg.py (trust authentication: the planted password in the URL is
accepted and ignored, so every command works and any copy of it shows).
docs/operations.md, "Security" and "Checkpoints" say what these check.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from sqlalchemy.engine import make_url

from fedcli.engine.client_files import StoredClientStates
from fedcli.engine.plain import from_plain
from fedcli.tracking.store.sql_store import SqlStore

TINY = ["--task", "lsq", "--clients-per-round", "4"]  # 20 clients, 11 parameters: rounds take milliseconds


class Payload:
    """Unpickling it runs `touch MARKER` (os.system): the marker file appears if any reader runs it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")}
    return {**out, "OMP_NUM_THREADS": "1"}


def fedcli(
    *args: str, extra_env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedcli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**env(), **(extra_env or {})},
        cwd=cwd,
    )


def train(root: Path, *args: str) -> str:
    done = fedcli("-q", "train", "--root", str(root), *TINY, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def store(root: Path) -> SqlStore:
    return SqlStore(f"sqlite:///{root / 'fedcli.db'}")


def params(root: Path, run_id: str) -> dict[str, torch.Tensor]:
    return torch.load(root / "runs" / run_id / "model.pt", weights_only=True)["params"]


def plant(path: Path, marker: Path, kind: str, round_idx: int = 0, run_id: str = "") -> None:
    """Replace `path` with a torch file whose unpickling creates `marker` (pickling it here runs nothing)."""
    body = (
        {
            "format_version": 2,
            "round_idx": round_idx,
            "seed": 0,
            "run_id": run_id,
            "config": {},
            "server_state": Payload(marker),
            "client_states": {},
        }
        if kind == "checkpoint"
        else {
            "params": Payload(marker),
            "server_state": Payload(marker),
            "config": {},
            "task": "lsq",
            "algorithm": "fedavg",
            "model": "linear",
            "example": None,
        }
    )
    torch.save(body, path)


def squash(text: str) -> str:
    """`text` without whitespace: rich wraps a long log line anywhere, even inside a path."""
    return re.sub(r"\s+", "", text)


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_files_that_need_code_are_refused_by_every_reader(tmp_path: Path) -> None:
    """A checkpoint and a model.pt carrying a pickle payload (os.system touching a marker file), given
    to every command that reads them: `evaluate` and `evaluate --checkpoint` refuse in one line (exit
    2), `sync` logs the run without the model and warns, `train --resume` skips every such checkpoint
    with a warning and restarts from round 0. The marker file is never created."""
    root, marker = tmp_path / "root", tmp_path / "marker"
    run_id = train(root, "--rounds", "3", "--checkpoint-every", "1", "--no-mlflow")
    run_dir = root / "runs" / run_id
    rounds = [r for r, _ in store(root).checkpoints(run_id)]
    for round_idx in rounds:
        plant(run_dir / "checkpoints" / f"round-{round_idx:06d}.pt", marker, "checkpoint", round_idx, run_id)
    plant(run_dir / "model.pt", marker, "model")
    with pytest.raises(Exception, match="system"):  # the planted file is what it claims: torch refuses it
        torch.load(run_dir / "model.pt", weights_only=True)
    assert not marker.exists()

    evaluated = fedcli("evaluate", run_id[:8], "--root", str(root), "--no-mlflow")
    assert evaluated.returncode == 2 and "needs code to load" in one_line(evaluated.stderr)
    assert f"--trust {run_dir / 'model.pt'}" in evaluated.stderr  # how to convert a file one trusts
    at_checkpoint = fedcli(
        "evaluate", run_id[:8], "--checkpoint", str(rounds[-1]), "--root", str(root), "--no-mlflow"
    )
    assert at_checkpoint.returncode == 2 and "needs code to load" in one_line(at_checkpoint.stderr)
    synced = fedcli("sync", "--root", str(root))
    assert synced.returncode == 0 and "needscodetoload" in squash(synced.stderr), synced.stderr
    resumed = fedcli("-q", "train", "--resume", run_id[:8], "--root", str(root), "--no-mlflow")
    assert resumed.returncode == 0, resumed.stderr
    assert squash(resumed.stderr).count("needscodetoload") == len(rounds)
    assert "Traceback" not in evaluated.stderr + at_checkpoint.stderr + synced.stderr + resumed.stderr
    assert not marker.exists()
    assert store(root).get_run(run_id).status == "finished"  # retrained from round 0 under its id


def test_checkpoints_that_are_not_the_runs_are_skipped_and_the_resume_is_bit_exact(tmp_path: Path) -> None:
    """Four checkpoints (rounds 3-6) of a 6-round run, three of them wrong: round 6 is another run's
    round-6 file (the reference run's), round 5 holds round 3 (a file saved under the wrong name),
    round 4 is a valid torch file without the states. `--resume --rounds 8` skips the three with
    one warning each and resumes from round 3: the result equals an uninterrupted 8-round run bit
    for bit. `evaluate --checkpoint 5` refuses the swapped file in one line (exit 2)."""
    full = train(tmp_path / "full", "--rounds", "8", "--no-mlflow", "--checkpoint-every", "1")
    root = tmp_path / "root"
    run_id = train(root, "--rounds", "6", "--no-mlflow", "--checkpoint-every", "1", "--keep-checkpoints", "4")
    folder = root / "runs" / run_id / "checkpoints"
    assert [r for r, _ in store(root).checkpoints(run_id)] == [3, 4, 5, 6]
    (folder / "round-000006.pt").write_bytes(
        (tmp_path / "full" / "runs" / full / "checkpoints" / "round-000006.pt").read_bytes()
    )
    (folder / "round-000005.pt").write_bytes((folder / "round-000003.pt").read_bytes())
    torch.save({"format_version": 2, "round_idx": 4, "seed": 0, "run_id": run_id}, folder / "round-000004.pt")

    evaluated = fedcli("evaluate", run_id[:8], "--checkpoint", "5", "--root", str(root), "--no-mlflow")
    assert evaluated.returncode == 2 and "holds round 3, not 5" in one_line(evaluated.stderr)
    resumed = fedcli(
        "-q", "train", "--resume", run_id[:8], "--rounds", "8", "--root", str(root), "--no-mlflow"
    )
    assert resumed.returncode == 0, resumed.stderr
    said = squash(resumed.stderr)
    assert squash(f"belongs to run {full[:8]}, not {run_id[:8]}") in said
    assert squash("holds round 3, not 5") in said
    assert squash("lacks 'config', 'server_state', 'client_states'") in said
    assert said.count("tryinganolderone") == 3 and "Traceback" not in said
    for name, tensor in params(tmp_path / "full", full).items():
        assert torch.equal(params(root, run_id)[name], tensor), name


def test_checkpoints_of_the_previous_format_still_load_and_resume_bit_exact(tmp_path: Path) -> None:
    """Format 1 (fedcli before checkpoint format 2) pickled the algorithm's NamedTuple states and had
    no run id or config hash. Such a checkpoint, laid out here from a format-2 one exactly as the
    old writer did, is read with weights_only=True (the run's own state types allowed) and the
    resume equals an uninterrupted run. A format-1 model.pt is refused by the MLflow copy (`fedcli
    sync`), whose warning names the conversion command; after `python -m fedcli.engine.checkpoint
    --trust FILE` the next sync logs the model."""
    from fedcli.algorithms import ALGORITHMS
    from fedcli.algorithms.base import OptimConfig

    full = train(tmp_path / "full", "--rounds", "6", "--no-mlflow", "--algo", "scaffold")
    root = tmp_path / "root"
    run_id = train(root, "--rounds", "4", "--no-mlflow", "--algo", "scaffold", "--checkpoint-every", "1")
    alg, path = ALGORITHMS["scaffold"], root / "runs" / run_id / "checkpoints" / "round-000004.pt"
    shapes = {"linear.weight": torch.zeros(1, 11)}
    template = alg.server_init(shapes, alg.config_cls(), OptimConfig(client_lr=0.01))
    client_template = alg.init_client_state(shapes, alg.config_cls())
    new = torch.load(path, weights_only=True)
    old = {
        "format_version": 1,
        "round_idx": 4,
        "seed": new["seed"],
        "config": new["config"],
        "server_state": from_plain(new["server_state"], template, "test"),
        "client_states": StoredClientStates.of(
            path.parent, new["client_index"], client_template, "test"
        ).to_dict(),
    }  # format 3: the .clients.npy files
    assert old["client_states"], "scaffold keeps client states"
    torch.save(old, path)

    resumed = fedcli(
        "-q", "train", "--resume", run_id[:8], "--rounds", "6", "--root", str(root), "--no-mlflow"
    )
    assert resumed.returncode == 0 and "tryinganolderone" not in squash(resumed.stderr), resumed.stderr
    for name, tensor in params(tmp_path / "full", full).items():
        assert torch.equal(params(root, run_id)[name], tensor), name

    model = root / "runs" / run_id / "model.pt"
    saved = torch.load(model, weights_only=True)
    torch.save(
        {k: v for k, v in saved.items() if k not in ("format_version", "run_id", "config_hash")}
        | {"server_state": from_plain(saved["server_state"], template, "test")},
        model,
    )
    first = fedcli("sync", "--root", str(root))
    assert first.returncode == 0, first.stderr
    assert squash(f"convert it: python -m fedcli.engine.checkpoint --trust {model}") in squash(first.stderr)
    converted = subprocess.run(
        [sys.executable, "-m", "fedcli.engine.checkpoint", "--trust", str(model)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert converted.returncode == 0 and "format 2" in converted.stdout, converted.stderr
    assert torch.load(model, weights_only=True)["run_id"] == run_id
    again = fedcli("sync", "--root", str(root))
    assert again.returncode == 0 and "WARNING" not in again.stderr, again.stderr
    with sqlite3.connect(root / "mlflow.db") as conn:
        assert conn.execute("SELECT count(*) FROM logged_models").fetchone() == (1,)


# --------------------------------------------------------------------------- passwords

PASSWORD = "Pl4nted-S3cret"


class Watcher:
    """Samples `ps -eo pid,args` and the files of a folder while the commands run: lines and files
    that hold the password, except the command lines of the commands this test typed itself."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.typed, self.seen_mirror = folder, set[int](), False
        self.ps_hits: set[str] = set()
        self.file_hits: set[str] = set()
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
                self.seen_mirror |= "fedcli.tracking.mlflow." in args
                if PASSWORD in args and int(pid) not in self.typed and "pytest" not in args:
                    self.ps_hits.add(args[:200])
            for path in self.folder.rglob(
                "*"
            ):  # temporary files (the sweep's trial configs) live only a while
                try:
                    if path.is_file() and PASSWORD.encode() in path.read_bytes():
                        self.file_hits.add(str(path))
                except OSError:
                    pass
            time.sleep(0.1)

    def run(
        self, *args: str, extra_env: dict[str, str] | None = None, cwd: Path
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedcli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env(), **(extra_env or {})},
            cwd=cwd,
        )
        self.typed.add(proc.pid)
        out, err = proc.communicate(timeout=400)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def secret(url: str) -> str:
    """`url` with the planted password."""
    return make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)


def assert_nothing_holds_the_password(
    tmp_path: Path, watcher: Watcher, outputs: list[str], urls: list[str]
) -> None:
    """No output line, no file under `tmp_path`, no row of the databases (pg_dump) and no command
    line of a process fedcli started holds the password; the ps check saw the MLflow mirror."""
    from tests.pg import find_bindir

    assert watcher.seen_mirror, "no MLflow mirror process was seen: the ps check saw nothing"
    assert [line for text in outputs for line in text.splitlines() if PASSWORD in line] == []
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert [str(p) for p in written if PASSWORD.encode() in p.read_bytes()] == []
    assert watcher.file_hits == set() and watcher.ps_hits == set()
    for url in urls:
        parsed = make_url(url)
        dump = subprocess.run(
            [
                str(find_bindir() / "pg_dump"),
                "--data-only",
                "-h",
                str(parsed.host),
                "-p",
                str(parsed.port),
                "-U",
                str(parsed.username),
                str(parsed.database),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert dump.returncode == 0 and "COPY" in dump.stdout, dump.stderr
        assert PASSWORD not in dump.stdout


def test_no_password_is_written_anywhere_or_shown(tmp_path: Path, pg_database) -> None:  # noqa: ANN001
    """A PostgreSQL store and MLflow store whose URLs carry a planted password, through train (its
    MLflow mirror process seen in `ps`), a resume with the full URLs given again by environment
    and the masked `--store` the summary printed, a resume refused for want of the MLflow
    password (exit 2, one line), evaluate, report (markdown and JSON), sync, and an unreachable
    MLflow URI: no output line, no file under the test's folder (SQLite files, runs/, checkpoints,
    model.pt, MLflow artifacts, reports), no row of either database (pg_dump) and no command line
    of a process fedcli started holds the password; URLs are shown as `user:***@host` and the
    run's stored config holds the masked one. (`test_sweep_keeps_passwords_secret_soak` adds a sweep.)"""
    from typer.testing import CliRunner

    from fedcli.cli.main import app

    store_url, mlflow_uri = secret(pg_database()), secret(pg_database())
    root, work, temp = tmp_path / "root", tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    temp.mkdir()
    track = ["--store", store_url, "--tracking-uri", mlflow_uri, "--root", str(root)]
    watcher, outputs = Watcher(temp), []

    def run(
        *args: str, expect: int = 0, extra_env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        done = watcher.run(*args, extra_env={"TMPDIR": str(temp), **(extra_env or {})}, cwd=work)
        outputs.append(done.stdout + done.stderr)
        assert done.returncode == expect, (args[:2], done.stderr)
        return done

    try:
        trained = run("train", *TINY, "--rounds", "30", *track)
        run_id = trained.stdout.strip().splitlines()[-1]
        shown = re.search(r"--store '?(\S+?)'? ", trained.stderr)
        assert shown and ":***@" in shown[1] and "store:   postgresql+psycopg://fedcli:***@" in trained.stderr
        run(
            "train",
            "--resume",
            run_id[:8],
            "--rounds",
            "32",
            "--store",
            shown[1],
            "--root",
            str(root),
            extra_env={"FEDCLI_STORE": store_url, "MLFLOW_TRACKING_URI": mlflow_uri},
        )
        refused = run(
            "train",
            "--resume",
            run_id[:8],
            "--rounds",
            "34",
            "--store",
            store_url,
            "--root",
            str(root),
            expect=2,
        )  # the run's MLflow URI is stored masked: it must be given again
        assert "tracking.tracking_uri must carry its password" in one_line(refused.stderr)
        run("evaluate", run_id[:8], "--store", store_url, "--tracking-uri", mlflow_uri)
        listed = run("list", "runs", "--json", "--store", store_url)
        assert run_id in listed.stdout  # its output joins `outputs`, grepped for the password below
        run("sync", *track)
        bad = run(
            "train",
            *TINY,
            "--rounds",
            "2",
            "--store",
            store_url,
            "--tracking-uri",
            f"http://fedcli:{PASSWORD}@127.0.0.1:9/",
            "--root",
            str(root),
            expect=2,
        )
        assert "fedcli:***@127.0.0.1:9" in one_line(bad.stderr)
    finally:
        watcher.stop()
    for fmt in ("md", "json"):  # in this process: `fedcli report` reads the store only
        output = work / f"report.{fmt}"
        reported = CliRunner().invoke(
            app, ["report", "--store", store_url, "--format", fmt, "--output", str(output)]
        )
        assert reported.exit_code == 0 and "fedcli:***@" in output.read_text(), reported.output
        outputs.append(reported.output)

    assert_nothing_holds_the_password(tmp_path, watcher, outputs, [store_url, mlflow_uri])
    assert (root / "runs" / run_id / "checkpoints" / "round-000032.pt").is_file()
    record = SqlStore(store_url).get_run(run_id)
    assert record.config["tracking"]["store"] == shown[1] and record.status == "finished"


@pytest.mark.soak
def test_sweep_keeps_passwords_secret_soak(tmp_path: Path, pg_database) -> None:  # noqa: ANN001
    """A two-trial sweep (with its report) on a PostgreSQL store and MLflow store with a password:
    the trials get the URLs by environment; nothing written, printed or on a command line holds it
    (the trials' config files are watched while they exist)."""
    store_url, mlflow_uri = secret(pg_database()), secret(pg_database())
    work, temp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    temp.mkdir()
    watcher = Watcher(temp)
    spec = work / "spec.yaml"
    spec.write_text(
        "experiment: secret\nbase: {task: lsq, clients_per_round: 4, rounds: 3}\n"
        "grid: {train.client_lr: [0.01, 0.02]}\nseeds: [0]\n"
        f"report: {{metric: dist_to_opt, output: {work / 'sweep.md'}}}\n"
    )
    try:
        done = watcher.run(
            "sweep",
            str(spec),
            "--store",
            store_url,
            "--tracking-uri",
            mlflow_uri,
            "--root",
            str(tmp_path / "root"),
            extra_env={"TMPDIR": str(temp)},
            cwd=work,
        )
    finally:
        watcher.stop()
    assert done.returncode == 0, done.stderr
    assert len(SqlStore(store_url).list_runs()) == 2 and (work / "sweep.md").is_file()
    assert_nothing_holds_the_password(tmp_path, watcher, [done.stdout + done.stderr], [store_url, mlflow_uri])


def test_a_sweep_passes_passwords_to_its_trials_by_environment(tmp_path: Path) -> None:
    """The worker processes of a sweep get a credential-carrying URL in their environment, a new trial's
    config holds it masked (fedcli.sweep.plan.trial_env, trial_config_text), a resumed trial's message
    sent to a Ray actor too (fedcli.sweep.ray_runner.masked_message); a URL without a password changes
    nothing (the environment is inherited)."""
    from fedcli.config.build import build_config
    from fedcli.sweep.plan import NEW, RESUME, Plan, trial_config_text, trial_env
    from fedcli.sweep.ray_runner import masked_message
    from fedcli.sweep.spec import Trial
    from fedcli.sweep.worker_pool import trial_message

    url = f"postgresql+psycopg://me:{PASSWORD}@db.example/runs"
    cfg = build_config(overrides={"data.task": "lsq", "tracking.store": url, "tracking.tracking_uri": url})
    new = Plan(Trial("t", cfg), NEW, None, "")
    resume = Plan(Trial("t", cfg), RESUME, "0" * 32, "")
    text = trial_config_text(new, cores=1)
    overrides = masked_message(trial_message(resume, 1, None, None))["overrides"]
    assert PASSWORD not in text + repr(overrides)
    assert "me:***@db.example" in text
    assert (
        overrides["tracking.store"]
        == overrides["tracking.tracking_uri"]
        == "postgresql+psycopg://me:***@db.example/runs"
    )
    assert trial_env(cfg.tracking) == {**os.environ, "FEDCLI_STORE": url, "MLFLOW_TRACKING_URI": url}
    assert trial_env(build_config(overrides={"data.task": "lsq"}).tracking) is None
