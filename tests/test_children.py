"""fedcli/children.py with real child processes: framed messages that a child's stray output cannot break,
how a child died, and the early-spawn holder (docs/architecture.md, "Child processes")."""

from __future__ import annotations

import signal
import subprocess
import sys

from fedcli import children

CHILD = """
import json, sys
from fedcli.children import child_channel
inbox, outbox = child_channel()
print("not a message", flush=True)  # fd 1 now goes to stderr
message = json.loads(inbox.recv_bytes())
outbox.send_bytes(json.dumps({"echo": message["x"] * 2}).encode())
print("bye")
"""


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def test_a_childs_prints_go_to_stderr_and_its_messages_arrive_whole() -> None:
    proc = _child(CHILD)
    channel = children.Channel(proc)
    assert channel.send({"x": 21})
    assert channel.receive() == {"echo": 42}
    assert channel.receive() is None  # its output ended: it exited
    assert proc.wait(timeout=60) == 0
    assert children.stderr_of(proc).split() == b"not a message bye".split()


def test_death_says_the_signal_or_the_code_and_the_childs_own_last_line() -> None:
    proc = _child("import time; time.sleep(60)")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert children.death(proc.returncode) == "was killed by SIGKILL"
    proc = _child(
        "import sys; print('lib: noise\\nme: the disk is full\\nlib: more', file=sys.stderr); sys.exit(3)"
    )
    proc.wait(timeout=60)
    reason = children.own_line(children.stderr_of(proc), "me: ")
    assert children.death(proc.returncode, reason) == "exited with code 3 (the disk is full)"
    assert children.death(0, "ignored") == "exited with code 0"


def test_the_early_child_is_adopted_once_and_a_dead_one_not_at_all() -> None:
    started = []

    def start() -> children.Early:
        started.append(_child("import sys; sys.stdin.read()"))
        return started[-1], None

    assert children.spawn_early("test", start) and not children.spawn_early("test", start)
    assert len(started) == 1 and children.early("test") is started[0]
    adopted = children.adopt_early("test")
    assert adopted is not None and adopted[0] is started[0] and children.adopt_early("test") is None
    children.Channel(started[0]).close()
    assert started[0].wait(timeout=60) == 0
    children.spawn_early("test", start)
    children.discard_early("test")  # SIGTERM
    assert started[1].wait(timeout=60) == -signal.SIGTERM and children.early("test") is None
    children.spawn_early("test", start)
    started[2].kill()
    started[2].wait(timeout=60)
    assert children.adopt_early("test") is None  # dead: not adopted


def test_a_process_backend_worker_that_was_killed_says_so() -> None:
    """The process back end's worker (fedcli/engine/backends/process.py) reports its death with `death`."""
    import pytest
    import torch

    from fedcli.engine.backends.process import WorkerError, _Worker

    worker = _Worker(torch.multiprocessing.get_context("spawn"))
    try:
        worker.process.kill()
        with pytest.raises(WorkerError, match=r"exited unexpectedly \(was killed by SIGKILL\); rerun with"):
            worker.receive()
    finally:
        worker.process.join(timeout=10)
