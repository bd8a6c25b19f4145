"""Issue 32's "Must show" figures: paper-scale federations and client state larger than memory.

    OMP_NUM_THREADS=1 python -m tests.benchmarks.bench_scale --out bench-results [--parts so,state,ratio]
        [--work /tmp/bench-scale] [--rounds-state 40]            (make bench-scale)

Parts (each runs when the feature it measures exists, else its section says "not available"):

- ``so``: a 342,477-client StackOverflow-format federation (TFF h5 layout, lognormal client sizes,
  written by ``python -m fedcli.datasets.formats.generate``) against a 3,400-client one with the same size
  distribution: FedAvg and FedPA, 3 rounds of 50 clients on stackoverflow-nwp with ``--data-store
  disk``: the cache build (time, size), launch to round 1 with a warm cache, and the peak RSS of the
  whole process tree (targets: <= 4 GB, <= 1.5x the 3,400-client run, launch to round 1 <= 60 s).
- ``state``: SCAFFOLD and BayesADMM on a 3,400-client EMNIST-format federation (20 examples each),
  Reddi et al.'s CNN (1.2M parameters), 100 clients a round, ``--state-store disk``: peak RSS of the
  tree (target <= 3 GB), the bytes each checkpoint writes against the round (O(cohort), not
  O(visited)), and a SIGKILL + ``--resume`` against the uninterrupted run (bit for bit).
- ``ratio``: round time of ``--data-store disk`` against ``--data-store memory`` at the same cohort,
  interleaved run by run, on the bundled FEMNIST and on the 3,400-client EMNIST federation (target:
  <= 1.2x), and whether the two give the same metrics (same seed).

Writes ``<out>/bench_scale.json`` (every measurement) and ``<out>/bench_scale.md`` (the tables,
each figure next to its target). Timing parts should run alone: ``make bench-scale`` wraps the
run in ``quiet-run`` where that exists. Peak RSS is sampled from /proc every 0.1 s over the
launched process and all its descendants (Linux).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RUN_LOG: Path | None = None  # <out>/bench_scale_runs.jsonl (set by main)
PY = sys.executable
GB = 1e9

# The child: one fedcli.train run that prints "ROUND r <unix time>" after every round and "DONE <json>" at the end.
CHILD = r"""
import json, os, sys, time
import fedcli
args = json.loads(os.environ["BENCH_ARGS"])
def progress(r, m):
    print(f"ROUND {r} {time.time():.3f}", flush=True)
run = fedcli.train(progress=progress, **args)
m = run.metrics()
last = m.iloc[-1]
print("DONE " + json.dumps({"id": run.id, "status": run.status,
      "final": {k: float(v) for k, v in last.items() if k.startswith("eval/") and v == v},
      "round_s": [float(v) for v in m["time/round_s"].dropna()]}), flush=True)
"""


# ----------------------------------------------------------------------------- process-tree memory


def tree_rss(pid: int) -> int:
    """RSS bytes of `pid` and every descendant (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
            with open(f"/proc/{entry}/statm") as fh:
                rss[int(entry)] = int(fh.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo.extend(children.get(p, []))
    return total


class Sampler:
    """Peak tree RSS of a process, sampled every `every` seconds in a thread."""

    def __init__(self, pid: int, every: float = 0.1) -> None:
        self.pid, self.every, self.peak, self._stop = pid, every, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            self._stop.wait(self.every)

    def stop(self) -> int:
        self._stop.set()
        self.thread.join()
        return self.peak


def train(
    args: dict[str, Any],
    env: dict[str, str] | None = None,
    *,
    kill_after_round: int | None = None,
    timeout: float = 3600,
) -> dict[str, Any]:
    """Launch one run (CHILD); return launch-to-round-1, the rounds' times, the tree's peak RSS, the result."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_ARGS": json.dumps(args), **(env or {})}
    start = time.time()
    proc = subprocess.Popen(
        [PY, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, cwd=ROOT
    )
    sampler = Sampler(proc.pid)
    rounds: dict[int, float] = {}
    done: dict[str, Any] | None = None
    assert proc.stdout is not None
    deadline = start + timeout
    for line in proc.stdout:
        if line.startswith("ROUND "):
            _, r, t = line.split()
            rounds[int(r)] = float(t)
            if kill_after_round is not None and int(r) >= kill_after_round:
                time.sleep(1.0)  # the checkpoint of that round is written on its own thread
                proc.send_signal(signal.SIGKILL)
                break
        elif line.startswith("DONE "):
            done = json.loads(line[5:])
        if time.time() > deadline:
            proc.kill()
            break
    proc.wait()
    peak = sampler.stop()
    err = proc.stderr.read() if proc.stderr else ""
    out = {
        # set-up and round 0's evaluation done: round 1 starts
        "launch_to_round0_s": rounds[0] - start if 0 in rounds else None,
        "launch_to_round1_s": rounds[1] - start if 1 in rounds else None,  # round 1 trained (and logged)
        "wall_s": time.time() - start,
        "peak_tree_rss": peak,
        "rounds_seen": len(rounds),
        "returncode": proc.returncode,
        "result": done,
    }
    if done is None and kill_after_round is None:
        out["error"] = (err.strip().splitlines() or ["no output"])[-1]
    if RUN_LOG is not None:  # every run as it ends: a part cut short keeps what it measured
        with RUN_LOG.open("a") as fh:
            fh.write(json.dumps({"args": {k: v for k, v in args.items() if k != "hp"}, **out}) + "\n")
    return out


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def gen(fmt: str, clients: int, out: Path, **kw: Any) -> dict[str, Any]:
    """Generate a federation once (a `.done` marker); its summary and generation time."""
    marker = out / ".done.json"
    if marker.exists():
        return dict(json.loads(marker.read_text()))
    from fedcli.datasets.formats.generate import generate

    started = time.perf_counter()
    summary = generate(fmt, clients, out, 0, quiet=True, **kw)
    summary["generate_s"] = time.perf_counter() - started
    summary["bytes"] = du(out)
    summary.pop("files", None)
    marker.write_text(json.dumps(summary))
    return summary


def has_option(option: str) -> bool:
    """Whether `fedcli train` has `option` (the feature a part measures exists)."""
    help_text = subprocess.run(
        [PY, "-m", "fedcli", "train", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "300"},
    ).stdout
    return option in help_text


# ----------------------------------------------------------------------------- parts


def part_so(
    work: Path, before: dict[str, Any] | None = None, sizes: tuple[int, ...] = (3400, 342477), rounds: int = 3
) -> dict[str, Any]:
    """`before`: this part's earlier result; its cold runs (the cache builds) and other sizes' runs are kept."""
    if not has_option("--data-store"):
        return {"available": False, "why": "fedcli train has no --data-store (the disk data store)"}
    res: dict[str, Any] = {"available": True, "federations": {}, "runs": {}}
    for key, run in ((before or {}).get("runs") or {}).items():
        if key.endswith(" cold") or int(key.split()[0]) not in sizes:
            res["runs"][key] = run
    for n, f in ((before or {}).get("federations") or {}).items():
        if int(n) not in sizes:
            res["federations"][int(n)] = f
    for n in sizes:
        data = work / f"so{n // 1000}k"
        res["federations"][n] = gen("stackoverflow", n, data, mean_size=4, tokens_only=True)
        cache = work / f"cache-so{n}"
        env = {"FEDCLI_DATA_CACHE": str(cache)}
        base = {
            "task": "stackoverflow-nwp",
            "data_dir": str(data),
            "data_store": "disk",
            "rounds": rounds,
            "clients_per_round": 50,
            "no_mlflow": True,
            # no executor: `auto`, what a user's command gets (the loop for an LSTM on a CPU; vmap with 50
            # LSTM clients held 6.9 GB)
            "eval_sample": 2000,  # evaluation is not what this part measures: a small fixed sample,
            "eval_every": rounds,  # at round 0 and the last round
        }
        if not (cache.exists() and du(cache) > 0):
            cold = train({**base, "algo": "fedavg", "root": str(work / f"runs-so{n}-cold")}, env)
            res["runs"][f"{n} fedavg cold"] = cold
        res["federations"][n]["cache_bytes"] = du(cache)
        for algo in ("fedavg", "fedpa"):
            hp = {"hp": {"burn_in_rounds": 1}} if algo == "fedpa" else {}
            res["runs"][f"{n} {algo} warm"] = train(
                {**base, "algo": algo, "root": str(work / f"runs-so{n}-{algo}"), "local_epochs": 3, **hp}, env
            )
    return res


def checkpoint_bytes(run_dir: Path) -> dict[int, int]:
    """round -> bytes of its checkpoint (.pt plus its .clients.npy)."""
    out: dict[int, int] = {}
    for p in (run_dir / "checkpoints").glob("round-*"):
        digits = p.name.split("-", 1)[1].split(".", 1)[0]
        if digits.isdigit():
            out[int(digits)] = out.get(int(digits), 0) + p.stat().st_size
    return dict(sorted(out.items()))


def part_state(work: Path, rounds: int) -> dict[str, Any]:
    if not has_option("--state-store"):
        return {"available": False, "why": "fedcli train has no --state-store (the client-state store)"}
    data = work / "emnist3400"
    res: dict[str, Any] = {
        "available": True,
        "federation": gen("emnist", 3400, data, mean_size=20, sigma=0.0),
        "runs": {},
    }
    for algo in ("scaffold", "bayesadmm"):
        base = {
            "algo": algo,
            "task": "emnist",
            "model": "cnn",
            "data_dir": str(data),
            "rounds": rounds,
            "clients_per_round": 100,
            "batch_size": 20,
            "no_mlflow": True,
            "state_store": "disk",
            "checkpoint_every": 1,
            "keep_checkpoints": 100000,
            "executor": "loop",
            "seed": 0,
            "eval_every": rounds,  # evaluated at the last round only: the metrics the resume is compared on
        }
        root = work / f"runs-state-{algo}"
        full = train({**base, "root": str(root)}, timeout=7200)
        if full.get("result"):
            full["checkpoint_bytes"] = checkpoint_bytes(root / "runs" / full["result"]["id"])
        kroot = work / f"runs-state-{algo}-killed"
        killed = train({**base, "root": str(kroot)}, kill_after_round=max(1, rounds // 2), timeout=7200)
        resumed: dict[str, Any] = {}
        from fedcli.tracking.store.sql_store import SqlStore

        ids = [r.id for r in SqlStore(f"sqlite:///{kroot / 'fedcli.db'}").list_runs()]
        if ids:
            resumed = train({"resume": ids[0], "root": str(kroot), "no_mlflow": True}, timeout=7200)
        same = bool(
            full.get("result")
            and resumed.get("result")
            and full["result"]["final"] == resumed["result"]["final"]
        )
        if same and full.get("result"):
            import torch

            a = torch.load(root / "runs" / full["result"]["id"] / "model.pt", weights_only=True)["params"]
            b = torch.load(kroot / "runs" / ids[0] / "model.pt", weights_only=True)["params"]
            same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        res["runs"][algo] = {
            "full": full,
            "killed_rounds": killed["rounds_seen"],
            "resumed": resumed,
            "bit_exact": same,
        }
    return res


def part_ratio(work: Path, reps: int = 3, rounds: int = 16) -> dict[str, Any]:
    if not has_option("--data-store"):
        return {"available": False, "why": "fedcli train has no --data-store"}
    emnist = work / "emnist3400"
    gen("emnist", 3400, emnist, mean_size=20, sigma=0.0)
    cases = {
        "femnist (bundled)": {"task": "femnist"},
        "emnist 3,400 clients": {"task": "emnist", "model": "mlp", "data_dir": str(emnist)},
    }
    out: dict[str, Any] = {"available": True, "cases": {}}
    for name, task in cases.items():
        times: dict[str, list[float]] = {"memory": [], "disk": []}
        finals: dict[str, Any] = {}
        for rep in range(reps):  # interleaved: memory, disk, memory, disk, ...
            for store in ("memory", "disk"):
                r = train(
                    {
                        **task,
                        "algo": "fedavg",
                        "rounds": rounds,  # 6 rounds x 2 gave 0.98x-1.33x on FEMNIST from one run to the next
                        "clients_per_round": 20,
                        "data_store": store,
                        "executor": "loop",
                        "no_mlflow": True,
                        "seed": 0,
                        "root": str(work / f"runs-ratio-{store}-{rep}-{len(name)}"),
                    },
                    {"FEDCLI_DATA_CACHE": str(work / "cache-ratio")},
                )
                if r.get("result"):
                    times[store].extend(r["result"]["round_s"][1:])  # round 1 carries the warm-up
                    finals[store] = r["result"]["final"]
                else:
                    finals[store] = r.get("error")
        med = {k: statistics.median(v) if v else None for k, v in times.items()}
        ratio = med["disk"] / med["memory"] if med["disk"] and med["memory"] else None
        out["cases"][name] = {
            "median_round_s": med,
            "ratio": ratio,
            "rounds": {k: len(v) for k, v in times.items()},
            "same_metrics": finals.get("memory") == finals.get("disk"),
            "final": finals,
        }
    return out


# ----------------------------------------------------------------------------- report


def median_round(run: dict[str, Any]) -> str:
    """The median of a finished run's time/round_s, or a dash."""
    times = (run.get("result") or {}).get("round_s") or []
    return f"{statistics.median(times):.1f} s over {len(times)} rounds" if times else "—"


def gib(n: float | None) -> str:
    return "—" if n is None else f"{n / 2**30:.2f} GiB"


def mark(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "MISSED")


def report(res: dict[str, Any]) -> str:
    lines = ["# bench-scale (issue 32)", "", f"{res['host']}; {res['date']}; command: `{res['command']}`", ""]
    so = res.get("so")
    if so is not None:
        lines += [
            "## StackOverflow-format federations (stackoverflow-nwp, --data-store disk, 50 clients/round)",
            "",
        ]
        if not so.get("available"):
            lines += [f"not available: {so['why']}", ""]
        else:
            lines += [
                "| clients | train sentences | h5 bytes | generate | cache build (cold launch to round 1) | cache bytes |",
                "|---|---|---|---|---|---|",
            ]
            for n, f in so["federations"].items():
                cold = so["runs"].get(f"{n} fedavg cold", {})
                lines.append(
                    f"| {int(n):,} | {f['examples']['stackoverflow_train.h5']:,} | {f['bytes']:,} | "
                    f"{f.get('generate_s', 0):.0f} s | {cold.get('launch_to_round1_s') or cold.get('wall_s') or 0:.0f} s | "
                    f"{f.get('cache_bytes', 0):,} |"
                )
            lines += [
                "",
                "| run | launch to round 1's start (warm) | launch to round 1's end | peak RSS, tree | s/round | status |",
                "|---|---|---|---|---|---|",
            ]
            for key, r in so["runs"].items():
                rs = (r.get("result") or {}).get("round_s") or []
                lines.append(
                    f"| {key} | {r.get('launch_to_round0_s') or 0:.1f} s | {r.get('launch_to_round1_s') or 0:.1f} s | "
                    f"{gib(r['peak_tree_rss'])} | "
                    f"{statistics.median(rs) if rs else 0:.2f} | {r.get('error') or 'ok'} |"
                )
            big, small = so["runs"].get("342477 fedpa warm"), so["runs"].get("3400 fedpa warm")
            peaks = [so["runs"].get(f"342477 {a} warm", {}).get("peak_tree_rss") for a in ("fedavg", "fedpa")]
            if big and small and all(peaks):
                worst = max(peaks)  # type: ignore[type-var]
                ratio = max(
                    so["runs"][f"342477 {a} warm"]["peak_tree_rss"]
                    / so["runs"][f"3400 {a} warm"]["peak_tree_rss"]
                    for a in ("fedavg", "fedpa")
                )
                l0, l1 = (
                    max(so["runs"][f"342477 {a} warm"].get(k) or 1e9 for a in ("fedavg", "fedpa"))
                    for k in ("launch_to_round0_s", "launch_to_round1_s")
                )
                lines += [
                    "",
                    f"- peak RSS of the 342,477-client runs: {gib(worst)} (target <= 4 GB: "
                    f"{mark(worst <= 4 * GB)})",
                    f"- against the 3,400-client runs: {ratio:.2f}x (target <= 1.5x: {mark(ratio <= 1.5)})",
                    f"- launch to round 1's start (set-up and round 0's evaluation), warm cache: {l0:.1f} s "
                    f"(target <= 60 s: {mark(l0 <= 60)}); to round 1's end: {l1:.1f} s",
                ]
            lines.append("")
    st = res.get("state")
    if st is not None:
        lines += [
            "## Client state on disk: 3,400-client EMNIST format, CNN (1.2M parameters), 100 clients/round",
            "",
        ]
        if not st.get("available"):
            lines += [f"not available: {st['why']}", ""]
        else:
            for algo, r in st["runs"].items():
                full = r["full"]
                lines += [
                    f"### {algo}",
                    "",
                    f"- peak RSS, tree: {gib(full['peak_tree_rss'])} (target <= 3 GB: "
                    f"{mark(full['peak_tree_rss'] <= 3 * GB if full.get('result') else None)}); "
                    f"{full.get('error') or 'finished'}",
                    f"- median round time: {median_round(full)} (the whole process tree on this host's load)",
                    f"- SIGKILL after round {r['killed_rounds']} + --resume: final metrics and model "
                    f"{'bit for bit equal' if r['bit_exact'] else 'NOT equal (or not measured)'}",
                    "",
                    "| round | checkpoint bytes |",
                    "|---|---|",
                ]
                lines += [f"| {k} | {v:,} |" for k, v in (full.get("checkpoint_bytes") or {}).items()]
                lines.append("")
    ra = res.get("ratio")
    if ra is not None:
        lines += [
            "## Round time, disk data store vs memory (same cohort of 20, loop executor, interleaved)",
            "",
        ]
        if not ra.get("available"):
            lines += [f"not available: {ra['why']}", ""]
        else:
            lines += [
                "| data | memory s/round | disk s/round | ratio (target <= 1.2) | same metrics |",
                "|---|---|---|---|---|",
            ]
            for name, c in ra["cases"].items():
                m, d, q = c["median_round_s"]["memory"], c["median_round_s"]["disk"], c["ratio"]
                shown = "—" if q is None else f"{q:.2f}"
                lines.append(
                    f"| {name} | {m or 0:.4f} | {d or 0:.4f} | {shown} ({mark(None if q is None else q <= 1.2)}) "
                    f"| {c['same_metrics']} |"
                )
            lines.append("")
    lines += ["GPU: " + res.get("gpu", "not measured on this host (no CUDA device)"), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench-scale")
    parser.add_argument("--parts", default="so,state,ratio")
    parser.add_argument("--rounds-state", type=int, default=40, help="rounds of the client-state part")
    parser.add_argument("--so-sizes", default="3400,342477", help="the so part's federations (clients)")
    parser.add_argument("--rounds-so", type=int, default=3, help="rounds of the so part's runs")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    global RUN_LOG
    RUN_LOG = args.out / "bench_scale_runs.jsonl"
    import platform

    import torch

    res: dict[str, Any] = {
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python -m tests.benchmarks.bench_scale", *(argv or sys.argv[1:])]),
    }
    if torch.cuda.is_available():
        res["gpu"] = (
            f"{torch.cuda.get_device_name(0)} present; the GPU variant of these parts is not implemented here"
        )
    path = args.out / "bench_scale.json"
    if path.exists():  # parts run one at a time keep each other's figures
        old = json.loads(path.read_text())
        res.update({k: v for k, v in old.items() if k in ("so", "state", "ratio")})
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "so": lambda: part_so(
            args.work, res.get("so"), tuple(int(n) for n in args.so_sizes.split(",")), args.rounds_so
        ),
        "state": lambda: part_state(args.work, args.rounds_state),
        "ratio": lambda: part_ratio(args.work),
    }
    for name in args.parts.split(","):
        print(f"== {name}", flush=True)
        res[name] = parts[name]()
        path.write_text(json.dumps(res, indent=1, default=str))
        (args.out / "bench_scale.md").write_text(report(res))
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
