"""The out-of-the-box matrix (issue 24): every algorithm with its defaults on the bundled tasks.

    make matrix      # = python -m tests.benchmarks.matrix --rounds 25 --out docs/out-of-the-box.md

Each cell is `fedcli train --algo A --task T --rounds R --seed 0 --threads 1 --no-mlflow` as a user
types it (a subprocess; defaults, recommendations and warnings as they are), and the table holds its
final metric next to FedAvg's. Classification tasks (femnist, mnist, synthetic-1-1) report accuracy
against the majority-class rate of the test split; bibtex (multi-label) recall@5 against always
ranking its five most frequent tags first (micro-F1 thresholds at 0.5 and is 0 while a model still
predicts no tag, as every model does for the first rounds at the task's lr 0.01); garnet-het-n10
(linear stochastic approximation, where only fedavg, fedlsa and scafflsa apply) the distance to
the optimum.

Targets, checked in `verdict`: a classification run reaches >= 2x the majority rate, is at most 3
points below FedAvg, and differs from FedAvg's run; an exception passes only with a reason: the
algorithm's `caveats` (`fedcli list algos NAME`) or a degenerate configuration recorded with the run
(tag fedcli.degenerate). `tests/algorithms/test_out_of_the_box.py` runs the same checks for a few
rounds in `make test`. Accuracy is not timing-sensitive: run it on a loaded machine if need be.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TASKS = ("femnist", "mnist", "synthetic-1-1", "bibtex", "garnet-het-n10")
METRIC = {"classification": "eval/accuracy", "multilabel": "eval/recall_at_5", "lsa": "eval/dist_to_opt"}
LSA_ONLY = ("fedlsa", "scafflsa")  # they refuse any task but linear stochastic approximation
MARGIN = 0.03  # "none more than 3 points below fedavg"


@dataclass
class Cell:
    """One run of the matrix: its final metric, its curve and what it recorded."""

    algo: str
    task: str
    value: float | None = None  # the metric at the last round; None when the run failed
    curve: tuple[float, ...] = ()  # eval/loss at every evaluated round: equal to fedavg's = the same model
    tags: dict[str, str] = field(default_factory=dict)
    error: str = ""  # the run's last stderr line when it exited non-zero
    seconds: float = 0.0


def applies(algo: str, task: str) -> bool:
    """Whether `algo` runs on `task` by design: the LSA algorithms need an LSA task, the rest a model to
    train; bayesadmm-full only a model of at most its hp.max_params parameters (D x D precisions)."""
    from fedcli.algorithms import ALGORITHMS
    from fedcli.datasets.models import num_parameters
    from fedcli.datasets.registry import TASKS as REGISTRY

    kind = REGISTRY[task].kind
    if (algo in LSA_ONLY) != (kind == "lsa"):
        return algo == "fedavg" and kind == "lsa"
    if algo == "bayesadmm-full":
        model = REGISTRY[task]
        return num_parameters(model.models[model.default_model]()) <= ALGORITHMS[algo].config_cls().max_params
    return True


def baseline(task: str, seed: int = 0) -> tuple[str, float | None]:
    """(name, value) of the task's trivial score: the majority-class accuracy of the test split, the recall@5
    of always ranking its five most frequent tags first, or None (LSA)."""
    from fedcli.datasets.registry import TASKS as REGISTRY
    from fedcli.datasets.tasks import TaskOptions

    record = REGISTRY[task]
    if record.kind == "lsa":
        return "distance to the optimum", None
    data = record.load(TaskOptions(seed=seed))
    y = data.test_y.numpy()
    if record.kind == "multilabel":
        counts = np.sort(y.sum(0))[::-1]
        return "top-5 tags recall@5", float(counts[:5].sum() / counts.sum())
    return "majority class", float(np.bincount(y.astype(np.int64)).max() / len(y))


def run_cell(algo: str, task: str, rounds: int, root: Path, seed: int = 0, pythonpath: str = "",
             extra: Sequence[str] = ()) -> Cell:
    """Train `algo` on `task` with its defaults as a user would, and read the run back from the store.

    `pythonpath` runs another checkout's fedcli (its packages assembled as `fedcli/...` there): the
    before/after tables of docs/out-of-the-box.md."""
    from fedcli.datasets.registry import TASKS as REGISTRY
    from fedcli.tracking.store import SqlStore

    command = [sys.executable, "-m", "fedcli", "-q", "train", "--algo", algo, "--task", task, "--rounds", str(rounds),
               "--seed", str(seed), "--threads", "1", "--no-mlflow", "--root", str(root), "--experiment", f"matrix-{task}",
               "--run-name", f"{algo} {task}", *extra]
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"PYTHONPATH": pythonpath} if pythonpath else {})}
    root.mkdir(parents=True, exist_ok=True)  # run from there: `python -m` puts the working folder first on sys.path
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=root)
    cell = Cell(algo, task, seconds=time.perf_counter() - start)
    if proc.returncode != 0:
        cell.error = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
        return cell
    run_id = proc.stdout.strip().splitlines()[-1]
    with SqlStore(f"sqlite:///{root / 'fedcli.db'}") as store:
        record = store.get_run(run_id)
        metric = METRIC[REGISTRY[task].kind]
        frame = store.metrics_frame([run_id], keys=[metric, "eval/loss"]).sort_values("round_idx")
    values = frame[frame["key"] == metric]["value"]
    cell.value = float(values.iloc[-1]) if len(values) else None
    cell.curve = tuple(float(v) for v in frame[frame["key"] == "eval/loss"]["value"])
    cell.tags = dict(record.tags)
    return cell


def stored_cell(algo: str, task: str, root: Path) -> Cell | None:
    """The newest finished run `algo task` of the matrix's store under `root` (--from-store), or None."""
    from fedcli.datasets.registry import TASKS as REGISTRY
    from fedcli.tracking.store import SqlStore

    with SqlStore(f"sqlite:///{root / 'fedcli.db'}") as store:
        runs = [r for r in store.list_runs(experiment=f"matrix-{task}") if r.run_name == f"{algo} {task}"
                and r.status == "finished"]
        if not runs:
            return None
        record = max(runs, key=lambda r: r.created_at)
        metric = METRIC[REGISTRY[task].kind]
        frame = store.metrics_frame([record.id], keys=[metric, "eval/loss"]).sort_values("round_idx")
    values = frame[frame["key"] == metric]["value"]
    return Cell(algo, task, value=float(values.iloc[-1]) if len(values) else None,
                curve=tuple(float(v) for v in frame[frame["key"] == "eval/loss"]["value"]), tags=dict(record.tags))


def verdict(cell: Cell, fedavg: Cell | None, base: float | None, kind: str, caveat: str) -> str:
    """'' when the cell meets the targets (module docstring); else what it misses, and whether a reason
    (the algorithm's caveats, a recorded degenerate configuration) is on record."""
    if cell.error:
        return f"failed: {cell.error}"
    misses = []
    if kind == "classification" and base is not None and cell.value is not None and cell.value < 2 * base:
        misses.append("< 2x majority")
    if fedavg is not None and cell.algo != "fedavg" and fedavg.value is not None and cell.value is not None:
        lower = md_lower(kind)
        gap = (cell.value - fedavg.value) if lower else (fedavg.value - cell.value)
        if kind != "lsa" and gap > MARGIN:
            misses.append(f"{100 * gap:.1f} points below fedavg")
        if cell.curve == fedavg.curve:
            misses.append("= fedavg")
    if not misses:
        return ""
    reason = "degenerate (tag)" if cell.tags.get("fedcli.degenerate") else "caveat" if caveat else "UNEXPLAINED"
    return f"{'; '.join(misses)} [{reason}]"


def recommended_items(cell: Cell) -> list[str]:
    """`key=value` items of the run's tag fedcli.recommended."""
    return [item.strip() for item in (cell.tags.get("fedcli.recommended") or "").split(";") if item.strip()]


def md_lower(kind: str) -> bool:
    """Lower is better for the LSA distance only."""
    return kind == "lsa"


def algorithms() -> list[str]:
    from fedcli.algorithms import ALGORITHMS

    return list(ALGORITHMS)


def run_matrix(tasks: Sequence[str], rounds: int, root: Path, only: Sequence[str] = (),
               pythonpath: str = "", extra: dict[str, list[str]] | None = None,
               from_store: bool = False) -> dict[str, dict[str, Cell]]:
    """task -> algo -> Cell, fedavg first on each task (the reference column); `from_store` reuses the
    finished runs already under `root` and trains only the missing cells."""
    out: dict[str, dict[str, Cell]] = {}
    for task in tasks:
        names = ["fedavg", *(a for a in algorithms() if a != "fedavg" and (not only or a in only))]
        out[task] = {}
        for algo in names:
            if applies(algo, task):
                stored = stored_cell(algo, task, root) if from_store else None
                out[task][algo] = cell = stored or run_cell(algo, task, rounds, root, pythonpath=pythonpath,
                                                            extra=(extra or {}).get(task, []))
                shown = "failed" if cell.error else f"{cell.value:.4f}"
                print(f"{task:>15} {algo:>15} {shown} ({cell.seconds:.0f} s)", file=sys.stderr, flush=True)
    return out


def render(results: dict[str, dict[str, Cell]], rounds: int, command: str) -> str:
    """The markdown page: one table per task, the value next to FedAvg's, the targets and the reasons."""
    from fedcli.algorithms import ALGORITHMS
    from fedcli.datasets.registry import TASKS as REGISTRY

    lines = [f"Command: `{command}` ({rounds} rounds, seed 0, one thread per run; {platform.machine()}, "
             f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d', time.gmtime())}).", ""]
    unexplained = 0
    for task, cells in results.items():
        kind = REGISTRY[task].kind
        name, base = baseline(task)
        metric = METRIC[kind]
        fedavg = cells.get("fedavg")
        scale = 1.0 if kind == "lsa" else 100.0
        unit = "" if kind == "lsa" else " (%)"
        head = f"### {task}: {metric}{unit} at round {rounds}"
        target = f" (target: ≥ {2 * scale * base:.1f})" if kind == "classification" and base is not None else ""
        partition = sorted({k for c in cells.values() for k in recommended_items(c) if k.startswith("partition.")})
        lines += [head, "", f"{name}: {scale * base:.1f}{target}" if base is not None else "lower is better",
                  *(["", f"Partition: the task's default, recorded as recommended ({'; '.join(partition)})."]
                    if partition else []), "",
                  f"| algorithm | {metric.split('/')[1]} | fedavg | vs fedavg | targets | recorded with the run |",
                  "|---|---:|---:|---:|---|---|"]
        for algo, cell in cells.items():
            caveat = ALGORITHMS[algo].caveats
            miss = verdict(cell, fedavg, base, kind, caveat)
            unexplained += "UNEXPLAINED" in miss or miss.startswith("failed")
            value = "—" if cell.value is None else f"{scale * cell.value:.2f}" if kind == "lsa" else f"{scale * cell.value:.1f}"
            ref = "—" if fedavg is None or fedavg.value is None else (
                f"{scale * fedavg.value:.2f}" if kind == "lsa" else f"{scale * fedavg.value:.1f}")
            diff = "—" if algo == "fedavg" or cell.value is None or fedavg is None or fedavg.value is None else \
                f"{scale * (cell.value - fedavg.value):+.{2 if kind == 'lsa' else 1}f}"
            recorded = "; ".join(f"degenerate {v.split(': ', 1)[0]}"
                                 for v in (cell.tags.get("fedcli.degenerate") or "").split(" | ") if v)
            own = [k for k in recommended_items(cell) if not k.startswith("partition.")]
            if own:
                recorded = "; ".join(x for x in (recorded, f"recommended {'; '.join(own)}") if x)
            lines.append(f"| {algo} | {value} | {ref} | {diff} | {miss or 'met'} | {recorded or '—'} |")
        lines.append("")
    lines += [f"Targets missed without a recorded reason: {unexplained}.", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--tasks", nargs="*", default=list(TASKS))
    parser.add_argument("--only", nargs="*", default=[], help="only these algorithms (and fedavg)")
    parser.add_argument("--root", type=Path, default=Path("matrix-runs"))
    parser.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    parser.add_argument("--pythonpath", default="", help="run the fedcli importable from here (another checkout)")
    parser.add_argument("--extra", nargs="*", default=[], metavar="TASK=OPTIONS",
                        help="more `fedcli train` options for a task's runs (e.g. the scheme an older fedcli needs)")
    parser.add_argument("--from-store", action="store_true",
                        help="reuse the finished runs under --root (render again; train only missing cells)")
    args = parser.parse_args(argv)
    extra = {k: v.split() for k, _, v in (item.partition("=") for item in args.extra)}
    results = run_matrix(args.tasks, args.rounds, args.root.resolve(), args.only, args.pythonpath, extra,
                         args.from_store)
    text = render(results, args.rounds, "make matrix" if args.out else " ".join(sys.argv))
    if args.out is None:
        print(text)
        return 0
    page = args.out.read_text() if args.out.exists() else ""
    marker = "<!-- matrix -->"
    if page.count(marker) == 2:  # keep the page's prose, replace the generated part between the markers
        before, _, after = page.split(marker, 2)
        text = f"{before}{marker}\n{text}\n{marker}{after}"
    args.out.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 1 if "UNEXPLAINED" in text else 0


if __name__ == "__main__":
    sys.exit(main())
