"""`fedcli sweep --dry-run` estimates: each trial's federation, peak memory and time per round, measured.

For every distinct trial config (seeds share one), a probe runs the trial as it would run, in a
child process (`python -m fedcli.sweep.estimate`), for PROBE_ROUNDS rounds with nothing stored
(a throwaway SQLite store in a temporary folder, no MLflow) and reports:

- the federation: clients, training and test examples, the largest client, model parameters;
- the set-up time (data load, a disk store's build the first time, model, back end);
- the time per round: the last probe round's wall time (round 1 carries one-off warm-up);
- the peak host memory: the probe's peak RSS (``ru_maxrss``: data, model, one cohort, evaluation),
  plus the measured growth of RSS from the end of round 1 to the end of the last probe round,
  extrapolated over the rounds the full run needs until it has visited every client (client state
  of SCAFFOLD / FedDyn / ADMM duals grows with the clients seen, then stops), bounded by the run's
  client-state cache when its state store is on disk;
- the peak device memory: ``torch.cuda.max_memory_allocated`` on CUDA; "host" on the CPU.

The probe's worker processes (the process executor) are not in its RSS; docs/scaling.md, "paper
scale", describes the estimate and how it compared with measured runs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

PROBE_ROUNDS = 2
PROBE_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Estimate:
    """What --dry-run prints for one trial (see the module docstring); `error` when the probe failed."""

    trial: str
    clients: int = 0
    train_examples: int = 0
    test_examples: int = 0
    largest_client: int = 0
    params: int = 0
    setup_s: float = 0.0
    round_s: float = 0.0
    probe_peak_bytes: int = 0
    host_peak_bytes: int = 0
    device_peak_bytes: int | None = None
    device: str = "cpu"
    full_run_s: float = 0.0
    error: str | None = None


def rss_bytes() -> int:
    """This process's resident set size now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """This process's peak RSS (ru_maxrss: KiB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def probe(doc: dict[str, Any]) -> dict[str, Any]:
    """Run the config `doc` (RunConfig.to_dict()) for PROBE_ROUNDS rounds in a throwaway store; measure."""
    import torch

    from fedcli.config.build import build_config
    from fedcli.runs.run import prepared_run

    with tempfile.TemporaryDirectory(prefix="fedcli-probe-") as tmp:
        doc = {
            **doc,
            "tracking": {
                **doc.get("tracking", {}),
                "root": tmp,
                "store": None,
                "tracking_uri": None,
                "use_mlflow": False,
                "experiment": "dry-run-probe",
                "run_name": None,
            },
            "train": {**doc["train"], "rounds": PROBE_ROUNDS, "checkpoint_every": 0},
        }
        cfg = build_config(doc=doc)
        started = time.perf_counter()
        marks: list[tuple[int, float, int]] = []  # (round, time, rss) after each round
        with prepared_run(cfg) as prepared:
            setup = prepared.setup
            setup_s = time.perf_counter() - started
            sizes = [len(ix) for ix in setup.fed.client_indices]
            out: dict[str, Any] = {
                "clients": len(sizes),
                "train_examples": int(sum(sizes)),
                "largest_client": max(sizes, default=0),
                "test_examples": len(setup.data.test_y),
                "params": sum(p.numel() for p in setup.init_params.values()),
                "device": str(setup.device),
                "setup_s": setup_s,
                "state_store": cfg.train.state_store,
                "state_cache_mb": cfg.train.state_cache_mb,
            }
            marks.append((0, time.perf_counter(), rss_bytes()))
            prepared.run(lambda r, _m: marks.append((r, time.perf_counter(), rss_bytes())))
        out["round_s"] = marks[-1][1] - marks[-2][1]
        out["growth_per_round"] = max(0, (marks[-1][2] - marks[1][2]) / max(1, len(marks) - 2))
        out["probe_peak_bytes"] = peak_rss_bytes()
        out["device_peak_bytes"] = (
            int(torch.cuda.max_memory_allocated(setup.device)) if setup.device.type == "cuda" else None
        )
    return out


def extrapolate(trial: str, cfg: Any, measured: dict[str, Any]) -> Estimate:
    """The full run's estimate from a probe's measurements (see the module docstring)."""
    rounds, cohort = cfg.train.rounds, max(1, cfg.train.clients_per_round)
    to_visit = min(
        rounds, math.ceil(measured["clients"] / cohort)
    )  # rounds until state stops growing (expected)
    growth = measured["growth_per_round"] * max(0, to_visit - PROBE_ROUNDS)
    if cfg.train.state_store == "disk":  # the disk store keeps at most the cache in RAM
        growth = min(growth, cfg.train.state_cache_mb * 2**20)
    return Estimate(
        trial=trial,
        clients=measured["clients"],
        train_examples=measured["train_examples"],
        test_examples=measured["test_examples"],
        largest_client=measured["largest_client"],
        params=measured["params"],
        setup_s=measured["setup_s"],
        round_s=measured["round_s"],
        probe_peak_bytes=measured["probe_peak_bytes"],
        host_peak_bytes=int(measured["probe_peak_bytes"] + growth),
        device_peak_bytes=measured["device_peak_bytes"],
        device=measured["device"],
        full_run_s=measured["setup_s"] + rounds * measured["round_s"],
    )


def estimate_trials(trials: Sequence[Any], *, timeout_s: float = PROBE_TIMEOUT_S) -> list[Estimate]:
    """One probe per distinct config (trials that differ only in the seed share it), each in a child process."""
    probes: dict[str, dict[str, Any] | str] = {}
    out = []
    for trial in trials:
        cfg = trial.config
        key = replace(cfg, seed=0).config_hash
        if key not in probes:
            probes[key] = run_probe(cfg.to_dict(), timeout_s)
        measured = probes[key]
        out.append(
            Estimate(trial=trial.name, error=measured)
            if isinstance(measured, str)
            else extrapolate(trial.name, cfg, measured)
        )
    return out


def run_probe(doc: dict[str, Any], timeout_s: float) -> dict[str, Any] | str:
    """The probe in a child process: its measurements, or the one line of why it failed."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "fedcli.sweep.estimate"],
            input=json.dumps(doc),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return f"the probe took over {timeout_s:.0f} s"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        return tail[-1] if tail else f"the probe exited with {proc.returncode}"
    return dict(json.loads(lines[-1]))


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "host"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n = n / 1024  # type: ignore[assignment]
    return str(n)


def fmt_seconds(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def main() -> int:
    from fedcli.errors import FedcliError

    doc = json.loads(sys.stdin.read())
    try:
        print(json.dumps(probe(doc)), flush=True)
    except FedcliError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
