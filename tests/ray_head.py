"""A Ray head on 127.0.0.1 for the Ray backend's tests and benchmark (tests/sweeps/test_ray_backend.py,
tests/benchmarks/sweeps.py): `ray start --head --block` with N CPUs and no dashboard, in its own
process group, ended with SIGTERM (then SIGKILL) to that group: `ray stop` would stop every Ray
instance of the machine, not only this one."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def ray_head_on_loopback(cpus: int, start_s: float = 120.0) -> Iterator[str]:
    """HOST:PORT of a Ray head with `cpus` CPUs on loopback while the block runs."""
    port, temp = free_port(), Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's socket paths
    log = open(temp / "head.log", "wb")  # noqa: SIM115 - closed below, after the head
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    head = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={cpus}",
            "--num-gpus=0",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={temp}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + start_s
        while head.poll() is None and b"Ray runtime started" not in (temp / "head.log").read_bytes():
            if time.monotonic() > deadline:
                raise AssertionError(f"the Ray head did not start within {start_s:.0f} s")
            time.sleep(0.2)
        assert head.poll() is None, (temp / "head.log").read_text(errors="replace")
        yield f"127.0.0.1:{port}"
    finally:
        stop_group(head)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def stop_group(head: subprocess.Popen[bytes]) -> None:
    """SIGTERM the head's process group (head, GCS, raylet, workers), SIGKILL what is left after 20 s."""
    for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(head.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and group_alive(head.pid):
            head.poll()
            time.sleep(0.2)
        if not group_alive(head.pid):
            break
    head.wait(timeout=10)


def group_alive(pgid: int) -> bool:
    """True while a process of group `pgid` other than a zombie runs (read from /proc)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False
