"""What runs on a Ray node for `fedcli sweep --backend ray`: `TrialActor` (a long-lived sweep worker per
actor, the default) and the older task of one trial, `run_trial` (its `fedcli train` command).

`fedcli sweep --backend ray` (fedcli/sweep_ray.py, docs/scaling.md) submits `run_trial` once per
trial. It writes the trial's config (sent as text, not as a path on the driver's disk) to a
temporary folder of the node, runs the same command line as the local backend
(fedcli.sweeps.trial_command) with this node's Python, and returns its exit code and the
tail of its output. A cancelled task (the sweep was stopped: `ray.cancel` raises
KeyboardInterrupt here) forwards SIGTERM to the trial and waits for it to checkpoint and exit,
so its run reads `interrupted` and a rerun resumes it; a trial that outlives its worker gets
SIGTERM from the kernel (PR_SET_PDEATHSIG: fedcli.sweep_process.die_with_parent).

Standard library only (and fedcli.sweep_process, which is too): a Ray worker imports this module
to run the task, and importing fedcli.sweeps (torch) there would cost every worker seconds and
memory for nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedcli.sweep_process import die_with_parent

CONFIG_TOKEN = "{config}"  # replaced in the command by the path of the trial's config on the node
KILL_AFTER_S = 180.0  # as fedcli.sweeps.KILL_AFTER_S: a stopped trial still running this long is killed
TAIL_LINES = 20
POLL_S = 0.2  # _wait's slice: how late a cancel may be noticed


def run_trial(args: Sequence[str], config_text: str | None, cwd: str, env: Mapping[str, str]) -> dict[str, Any]:
    """Run `python -m fedcli -q train ARGS` here; return its exit code, output tails, host and pid.

    Args:
        args: what follows `fedcli -q train` (fedcli.sweeps.trial_args), CONFIG_TOKEN for the
            config file's path.
        config_text: the YAML of a new trial's config; None for a resumed one.
        cwd: the sweep's working folder, used where this node has it (relative data paths),
            else the temporary folder.
        env: variables set for the trial (the sweep's store and MLflow URIs).
    """
    _interruptible()
    with tempfile.TemporaryDirectory(prefix="fedcli-trial-") as tmp:
        folder = Path(tmp)
        config = folder / "run.yaml"
        if config_text is not None:
            config.write_text(config_text)
        command = [sys.executable, "-m", "fedcli", "-q", "train",
                   *(str(config) if a == CONFIG_TOKEN else a for a in args)]
        with open(folder / "stdout.txt", "wb") as out, open(folder / "stderr.txt", "wb") as err:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    cwd=cwd if os.path.isdir(cwd) else tmp, env={**os.environ, **env},
                                    preexec_fn=die_with_parent(os.getpid()))
        stopped = False
        try:
            code = _wait(proc)
        except KeyboardInterrupt:  # ray.cancel: stop the trial in order (it checkpoints and exits 143)
            stopped = True
            code = _stop(proc)
        return {"code": code, "stopped": stopped, "host": socket.gethostname(), "pid": proc.pid,
                "stdout": _tail(folder / "stdout.txt"), "stderr": _tail(folder / "stderr.txt")}


class TrialActor:
    """A long-lived Ray actor (issue 27): one sweep worker process on its node (`python -m
    fedcli.sweep_worker`, fedcli/sweep_worker.py) that runs many trials, one `run` call each.

    Created with `max_concurrency=2`, so that `stop` (SIGTERM to the worker: its trial checkpoints
    and reads `interrupted`) runs while `run` waits for the trial. The worker dies with the actor
    (PR_SET_PDEATHSIG), the actor with the sweep's driver.
    """

    def __init__(self, cwd: str, env: Mapping[str, str]) -> None:
        # a masked URL (`user:***@host`; fedcli.sweep_ray never sends a password through Ray) is this node's own
        env = {k: v for k, v in env.items() if not (_masked(v) and os.environ.get(k))}
        # an unnamed file: Ray ends actors with ray.kill, so a folder made here was never removed (one
        # per actor was left in /tmp); it is freed with this process
        self.stderr = tempfile.TemporaryFile(prefix="fedcli-worker-")  # noqa: SIM115 - lives with the actor
        self.proc = subprocess.Popen([sys.executable, "-m", "fedcli.sweep_worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, cwd=cwd if os.path.isdir(cwd) else None,
                                     env={**os.environ, **env}, preexec_fn=die_with_parent(os.getpid()))

    def where(self) -> tuple[str, int]:
        """(host, worker pid)."""
        return socket.gethostname(), self.proc.pid

    def run(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """Run one trial; return the worker's `ended` event (with `host`), or how the worker died."""
        import json

        assert self.proc.stdin is not None and self.proc.stdout is not None
        hook = message.get("hook")
        if isinstance(hook, Mapping) and _masked(hook.get("storage")) and os.environ.get("FEDCLI_STORE"):
            message = {**message, "hook": {**hook, "storage": os.environ["FEDCLI_STORE"]}}  # through a pipe only
        run_id = message.get("resume")
        try:
            self.proc.stdin.write((json.dumps(dict(message)) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            pass  # it died: the read below says how
        for raw in self.proc.stdout:
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            if event.get("event") == "started":
                run_id = event.get("run_id") or run_id
            elif event.get("event") == "ended":
                return {**event, "host": socket.gethostname(), "pid": self.proc.pid}
        code = self.proc.wait()
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        tail = _tail_of(self.stderr)
        return {"event": "died", "status": "failed", "run_id": run_id, "round": None, "metrics": {},
                "reason": f"its sweep worker (pid {self.proc.pid} on {socket.gethostname()}) {how}"
                          + (f" ({tail[-1][:300]})" if tail and code > 0 else ""),
                "host": socket.gethostname(), "pid": self.proc.pid}

    def stop(self) -> None:
        """SIGTERM to the worker: its trial stops in order (checkpointed, `interrupted`) and it exits."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)

    def close(self) -> None:
        """End an idle worker (its stdin closed); kill it after KILL_AFTER_S."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=KILL_AFTER_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _masked(value: object) -> bool:
    """A URL whose password was masked by fedcli.tracking.urls.mask_url (`:***@`, `password=***`)."""
    return isinstance(value, str) and ("***" in value or "%2A%2A%2A" in value.upper())


def _interruptible() -> None:
    """Let `ray.cancel` interrupt this task. It raises KeyboardInterrupt by simulating SIGINT in the
    worker's main thread, which does nothing while SIGINT is ignored: and a worker inherits an
    ignored SIGINT from a sweep started in the background (`fedcli sweep ... &` in a script, nohup).
    Seen with Ray 2.60: SIGTERM to such a sweep cancelled its task, whose trial trained on."""
    with contextlib.suppress(ValueError):  # not the main thread: Ray runs tasks there, so never here
        if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _wait(proc: subprocess.Popen[bytes]) -> int:
    """Wait for the trial in short slices: ray.cancel raises KeyboardInterrupt through the
    interpreter's pending-signal flag, which a thread blocked in a bare waitpid never checks
    (measured with Ray 2.60: `proc.wait()` let a cancelled trial run to its end)."""
    while True:
        try:
            return proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            continue


def _stop(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM once, wait up to KILL_AFTER_S, then SIGKILL; return the exit code."""
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    while True:
        try:
            return proc.wait(timeout=KILL_AFTER_S)
        except subprocess.TimeoutExpired:
            proc.kill()
        except KeyboardInterrupt:  # a second cancel: keep waiting, a second SIGTERM would cut the checkpoint
            continue


def _tail_of(file: Any) -> list[str]:
    """The last lines of an open file another process writes (pread: its shared offset stays put)."""
    size = os.fstat(file.fileno()).st_size
    start = max(0, size - 65536)
    lines = os.pread(file.fileno(), size - start, start).decode(errors="replace").splitlines()
    return [line for line in lines if line.strip()][-TAIL_LINES:]


def _tail(path: Path) -> list[str]:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return [line for line in lines if line.strip()][-TAIL_LINES:]
