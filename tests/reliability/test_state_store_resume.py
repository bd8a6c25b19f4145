"""Client states on disk and incremental checkpoints with real processes (issue 32 item 2).

`python -m fedcli train` on a fresh `--root` (SQLite stores): SIGKILL + `--resume` with the disk
store gives the uninterrupted (RAM store) run's final model and metrics bit for bit, for SCAFFOLD
and BayesADMM; a checkpoint of the old format (2: every client state in the .pt) resumes exactly;
`fedcli evaluate --checkpoint` reads a format-3 checkpoint; a disk that fills up under the disk store
is one line, exit 2, and the run resumes once there is space. The in-process tests of the store and
the format are tests/engine/test_clientstate_store.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fedcli.engine import checkpoint as ckpt
from fedcli.engine.client_files import StoredClientStates
from fedcli.tracking.store.sql_store import SqlStore

TINY = ["--task", "lsq", "--clients-per-round", "4", "--no-mlflow"]  # 20 clients: rounds take milliseconds
DISK = [
    "--state-store",
    "disk",
    "--state-cache-mb",
    "0",
]  # every state written back and read again each round


def fedcli(root: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "fedcli", "-q", "train", "--root", str(root), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 300) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out.strip().splitlines()[-1]


def store(root: Path) -> SqlStore:
    return SqlStore(f"sqlite:///{root / 'fedcli.db'}")


def final(root: Path, run_id: str, rounds: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """(final parameters, metrics of the last round) of a run."""
    params = torch.load(root / "runs" / run_id / "model.pt", weights_only=True)["params"]
    frame = store(root).metrics_frame([run_id])
    last = frame[frame["round_idx"] == rounds]
    return params, {
        str(k): float(v)
        for k, v in zip(last["key"], last["value"], strict=True)
        if not str(k).startswith("time/")
    }


def assert_same_run(
    a: tuple[dict[str, torch.Tensor], dict[str, float]], b: tuple[dict[str, torch.Tensor], dict[str, float]]
) -> None:
    for name, tensor in a[0].items():
        assert torch.equal(b[0][name], tensor), name
    assert a[1] and a[1] == b[1]  # every metric of the last round, bit for bit (floats compared exactly)


@pytest.mark.parametrize("algo", ["scaffold", "bayesadmm"])
def test_sigkill_then_resume_with_the_disk_store_equals_the_uninterrupted_run(
    tmp_path: Path, algo: str
) -> None:
    rounds = 120
    ref_root, root = tmp_path / "ref", tmp_path / "killed"
    ref_id = finish(fedcli(ref_root, *TINY, "--algo", algo, "--rounds", str(rounds), "--state-store", "ram"))
    victim = fedcli(root, *TINY, *DISK, "--algo", algo, "--rounds", str(rounds))
    import time

    deadline = time.monotonic() + 120
    run_id = None
    while time.monotonic() < deadline and run_id is None:
        if (root / "fedcli.db").exists():
            runs = store(root).list_runs()
            if runs and (store(root).last_round(runs[0].id) or 0) >= 30:
                run_id = runs[0].id
        time.sleep(0.05)
    assert run_id is not None, "the run did not reach round 30"
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    assert (store(root).last_round(run_id) or 0) < rounds
    checkpoints = root / "runs" / run_id / "checkpoints"
    assert (
        list(checkpoints.glob("*.clients.npy"))
        and (root / "runs" / run_id / "client-state" / "slots.bin").exists()
    )
    resumed = subprocess.run(
        [sys.executable, "-m", "fedcli", "-q", "train", "--root", str(root), "--resume", run_id[:8]],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert resumed.returncode == 0, resumed.stderr
    assert_same_run(final(ref_root, ref_id, rounds), final(root, run_id, rounds))
    assert not (
        root / "runs" / run_id / "client-state"
    ).exists()  # removed at the end: the checkpoints hold it


def test_a_checkpoint_of_the_old_format_resumes_exactly(tmp_path: Path) -> None:
    """A run's newest checkpoint rewritten as format 2 (what fedcli wrote before format 3, with the
    function it used, kept for that) resumes to the uninterrupted run's final model and metrics."""
    ref_root, root = tmp_path / "ref", tmp_path / "old"
    ref_id = finish(fedcli(ref_root, *TINY, "--algo", "scaffold", "--rounds", "12"))
    run_id = finish(fedcli(root, *TINY, *DISK, "--algo", "scaffold", "--rounds", "6"))
    path = ckpt.checkpoint_path(root / "runs" / run_id, 6)
    payload = ckpt.read_file(path, "f")
    assert payload["format_version"] == 3 and "client_states" not in payload
    # the run's own states, read back from format 3, written as format 2 over the same file
    from fedcli.algorithms import ALGORITHMS
    from fedcli.algorithms.base import OptimConfig
    from fedcli.config.checks import make_hyperparameters

    alg, hp = ALGORITHMS["scaffold"], make_hyperparameters("scaffold", {})
    params = {"linear.weight": torch.zeros(1, 11)}
    server_t, client_t = (
        alg.server_init(params, hp, OptimConfig(client_lr=0.1)),
        alg.init_client_state(params, hp),
    )
    record = store(root).get_run(run_id)
    server, clients = ckpt.load_checkpoint(
        path,
        "f",
        server_template=server_t,
        client_template=client_t,
        run_id=run_id,
        config_hash=record.config_hash,
        requested=record.requested,
        round_idx=6,
    )
    assert isinstance(clients, StoredClientStates) and len(clients) > 4
    old = ckpt.checkpoint_payload(
        round_idx=6,
        server_state=server,
        client_states=clients.to_dict(),
        config=payload["config"],
        seed=payload["seed"],
        run_id=run_id,
    )
    ckpt.atomic_save(ckpt.plain_payload(old), path)
    for npy in path.parent.glob("*.clients.npy"):
        npy.unlink()  # nothing of format 3 left to read
    assert ckpt.read_file(path, "f")["format_version"] == 2
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            "--root",
            str(root),
            "--resume",
            run_id[:8],
            "--rounds",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "trying an older one" not in resumed.stderr
    assert_same_run(final(ref_root, ref_id, 12), final(root, run_id, 12))
    # the checkpoints written after it are format 3 again, and name every client the old one held
    newest = ckpt.read_file(ckpt.checkpoint_path(root / "runs" / run_id, 12), "f")
    assert newest["format_version"] == 3 and set(clients.index) <= set(
        newest["client_index"]["clients"].tolist()
    )


def test_evaluate_reads_a_format_3_checkpoint(tmp_path: Path) -> None:
    run_id = finish(
        fedcli(tmp_path, *TINY, *DISK, "--algo", "scaffold", "--rounds", "5", "--checkpoint-every", "1")
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "evaluate",
            run_id[:8],
            "--checkpoint",
            "4",
            "--json",
            "--store",
            f"sqlite:///{tmp_path / 'fedcli.db'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": ""},
    )
    assert out.returncode == 0, out.stderr
    stored = store(tmp_path).metrics_frame([run_id])
    loss = stored[(stored["round_idx"] == 4) & (stored["key"] == "eval/loss")]["value"].iloc[0]
    assert json.dumps(float(loss)) in out.stdout or repr(float(loss)) in out.stdout, (loss, out.stdout[:2000])


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MB tmpfs (root only); resized with `remount`. Skipped where mounting is not allowed."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({made.stderr.strip() or 'not root'}); needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_under_the_disk_store_is_one_line_exit_2_and_the_run_resumes(small_disk: Path) -> None:
    """SCAFFOLD on FEMNIST's MLP with client states on disk (0.8 MB a client) fills a 2 MB disk under
    the run's folder (the results store elsewhere): one line naming 'no space left on device' and the
    run's folder, exit 2, no traceback; with space again the run resumes from its intact checkpoint
    and finishes."""
    root, db = small_disk / "runs", f"sqlite:///{small_disk.parent / 'fedcli.db'}"
    proc = fedcli(
        root,
        "--algo",
        "scaffold",
        "--task",
        "femnist",
        "--rounds",
        "6",
        "--clients-per-round",
        "3",
        "--no-mlflow",
        "--checkpoint-every",
        "1",
        "--store",
        db,
        *DISK,
    )
    _, err = proc.communicate(timeout=600)
    message = " ".join(err.split())
    assert proc.returncode == 2, err
    assert (
        "no space left on device" in message and str(root / "runs") in message and "Traceback" not in err
    ), err
    assert len([line for line in err.splitlines() if line.strip()]) <= 3, (
        err
    )  # one message (rich may wrap it)
    record = SqlStore(db).list_runs()[0]
    assert record.status in ("failed", "interrupted")
    subprocess.run(["mount", "-o", "remount,size=96m", str(small_disk)], check=True)
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            "--root",
            str(root),
            "--store",
            db,
            "--resume",
            record.id,
            "--no-mlflow",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert resumed.returncode == 0, resumed.stderr
    assert SqlStore(db).get_run(record.id).status == "finished" and SqlStore(db).last_round(record.id) == 6
