"""The out-of-the-box matrix (issues 24, 36): every algorithm with its defaults on every bundled task.

    make matrix      # = python -m tests.benchmarks.matrix --rounds 25 --seeds 2 --out docs/out-of-the-box.md

Each cell is `fedcli train --algo A --task T --rounds R --seed S --threads 1 --no-mlflow` as a user
types it (a subprocess; defaults, recommendations and warnings as they are), once per seed, and the
table holds its final headline metric (mean over the seeds) next to FedAvg's:

- classification (femnist, mnist, har, vehicle, the four FedProx synthetic sets, shakespeare):
  accuracy, against the majority-class rate of the test split;
- multi-label (bibtex): macro-F1 under the task's decision rule (datasets/metrics.py; bibtex: top-2),
  micro-F1 beside it, against the best constant predictor (no tag, every tag, or the k most frequent
  training tags for k = 1..5: the trivial predictor's F1);
- regression and linear stochastic approximation (lsq, the Garnet TD tasks, where only
  fedavg, fedlsa and scafflsa apply): the distance to the optimum, against the initial model's.

Targets, checked in `verdict` (the learns / acts-as-itself checks): a run learns (classification:
>= 2x the majority rate, or halfway from it to 100 % where lower; multi-label: macro-F1 above the trivial predictor's; distance tasks: below
the initial model's distance), is at most 3 points below FedAvg (percent metrics) and differs from
FedAvg's run of the same seed (its loss curve); an exception passes only with a reason: the
algorithm's `caveats` (`fedcli list algos NAME`), a degenerate configuration recorded with the
run (tag fedcli.degenerate) or a known shortfall warned before the run and recorded with it (tag
fedcli.shortfall). A task whose data is not on this machine (har, vehicle: `--download`)
or whose runs are unaffordable here (shakespeare, `UNAFFORDABLE`) is listed with the reason and
not run. `tests/algorithms/test_out_of_the_box.py` runs the same checks for a few rounds in `make
test`. Accuracy is not timing-sensitive: run it on a loaded machine if need be.
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

TASKS = (
    "femnist",
    "mnist",
    "har",
    "vehicle",
    "synthetic-0-0",
    "synthetic-0.5-0.5",
    "synthetic-1-1",
    "synthetic-iid",
    "bibtex",
    "shakespeare",
    "lsq",
    "garnet-het-n10",
    "garnet-het-n100",
    "garnet-hom-n10",
    "garnet-hom-n100",
)
METRIC = {
    "classification": "eval/accuracy",
    "multilabel": "eval/macro_f1",
    "lsa": "eval/dist_to_opt",
    "regression": "eval/dist_to_opt",
}
SECONDARY = {"multilabel": ("eval/micro_f1",)}  # shown beside the headline metric
# `fedcli train` options a task needs beyond the defaults (--tasks quadratic-2d: the 2-client toy, not in TASKS,
# is fewer clients than the default cohort of 10: `fedcli train --task quadratic-2d` alone exits 2)
TASK_OPTIONS = {"quadratic-2d": ["--clients-per-round", "2"]}
LSA_ONLY = ("fedlsa", "scafflsa")  # they refuse any task but linear stochastic approximation
MARGIN = 0.03  # "none more than 3 points below fedavg"
# Tasks left out unless named with --tasks, with the measurement that says why (docs/out-of-the-box.md).
UNAFFORDABLE = {
    "shakespeare": "the bundled LEAF roles train an LSTM over ~4,200 80-character windows per client: "
    "130-190 s a round for 2 clients on the 2-core machine, some 15 hours a seed"
}


@dataclass
class Cell:
    """One (algorithm, task): its final metric (mean over seeds), its curves and what it recorded."""

    algo: str
    task: str
    value: float | None = (
        None  # the headline metric at the last round, mean over seeds; None when a run failed
    )
    values: tuple[float | None, ...] = ()  # per seed
    start: float | None = None  # the headline metric of the initial model (round 0), mean over seeds
    secondary: dict[str, float] = field(default_factory=dict)  # e.g. eval/micro_f1, mean over seeds
    curve: tuple[
        float, ...
    ] = ()  # eval/loss at every evaluated round, seeds one after another: = fedavg's = same model
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


def unavailable(task: str) -> str:
    """Why `task` is not run here ('' when it is): its data is absent (not bundled, needs --download) or
    its runs are unaffordable (`UNAFFORDABLE`)."""
    if task in UNAFFORDABLE:
        return UNAFFORDABLE[task]
    return unavailable_data(task)


def unavailable_data(task: str) -> str:
    """'' when `task`'s data loads here, else why not (not bundled and not downloaded)."""
    from fedcli.datasets.registry import TASKS as REGISTRY
    from fedcli.datasets.tasks import TaskOptions
    from fedcli.errors import DataError

    try:
        REGISTRY[task].load(TaskOptions(seed=0))
    except DataError as err:
        return f"data not on this machine: {str(err).splitlines()[0]}"
    return ""


def trivial_multilabel(task: str, seed: int = 0) -> dict[str, float]:
    """The best micro- and macro-F1 of a constant predictor on the test split (each metric its own best):
    no tag, every tag, or the k most frequent training tags (k = 1..5); each is a fixed set of tags, scored
    as such (logit +1 for the set, -1 elsewhere, at threshold 0.5: a constant predictor ignores the rule)."""
    import torch

    from fedcli.datasets.metrics import multilabel_metrics
    from fedcli.datasets.registry import TASKS as REGISTRY
    from fedcli.datasets.tasks import TaskOptions

    data = REGISTRY[task].load(TaskOptions(seed=seed))
    y = data.test_y
    order = torch.argsort(data.y.sum(0), descending=True)
    scores = [torch.full(y.shape, -1.0), torch.full(y.shape, 1.0)]
    for k in range(1, 6):
        s = torch.full(y.shape, -1.0)
        s[:, order[:k]] = 1.0
        scores.append(s)
    best = {"eval/micro_f1": 0.0, "eval/macro_f1": 0.0}
    for s in scores:
        got = multilabel_metrics(s, y)
        for key in best:
            best[key] = max(best[key], got[key.split("/")[1]])
    return best


def baseline(task: str, seed: int = 0) -> tuple[str, float | None]:
    """(name, value) of the task's trivial score: the majority-class accuracy of the test split, the best
    constant predictor's macro-F1, or None (distance tasks: the initial model's, per cell)."""
    from fedcli.datasets.registry import TASKS as REGISTRY
    from fedcli.datasets.tasks import TaskOptions

    record = REGISTRY[task]
    if record.kind in ("lsa", "regression"):
        return "the initial model's distance to the optimum", None
    if record.kind == "multilabel":
        return "best constant predictor's macro-F1", trivial_multilabel(task, seed)["eval/macro_f1"]
    y = record.load(TaskOptions(seed=seed)).test_y.numpy()
    return "majority class", float(np.bincount(y.astype(np.int64)).max() / len(y))


def _read(
    store: object, run_id: str, task: str
) -> tuple[float | None, float | None, dict[str, float], tuple[float, ...]]:
    """(final headline value, round-0 value, final secondary values, loss curve) of one stored run."""
    from fedcli.datasets.registry import TASKS as REGISTRY

    kind = REGISTRY[task].kind
    metric = METRIC[kind]
    keys = [metric, "eval/loss", *SECONDARY.get(kind, ())]
    frame = store.metrics_frame([run_id], keys=keys).sort_values("round_idx")  # type: ignore[attr-defined]
    head = frame[frame["key"] == metric]
    value = float(head["value"].iloc[-1]) if len(head) else None
    start = float(head[head["round_idx"] == 0]["value"].iloc[0]) if (head["round_idx"] == 0).any() else None
    secondary = {
        k: float(frame[frame["key"] == k]["value"].iloc[-1])
        for k in SECONDARY.get(kind, ())
        if (frame["key"] == k).any()
    }
    return value, start, secondary, tuple(float(v) for v in frame[frame["key"] == "eval/loss"]["value"])


def run_cell(
    algo: str,
    task: str,
    rounds: int,
    root: Path,
    seed: int = 0,
    pythonpath: str = "",
    extra: Sequence[str] = (),
) -> Cell:
    """Train `algo` on `task` with its defaults as a user would (one seed), and read the run back.

    `pythonpath` runs another checkout's fedcli (its packages assembled as `fedcli/...` there): the
    before/after tables of docs/out-of-the-box.md."""
    from fedcli.tracking.store.sql_store import SqlStore

    command = [
        sys.executable,
        "-m",
        "fedcli",
        "-q",
        "train",
        "--algo",
        algo,
        "--task",
        task,
        "--rounds",
        str(rounds),
        "--seed",
        str(seed),
        "--threads",
        "1",
        "--no-mlflow",
        "--root",
        str(root),
        "--experiment",
        f"matrix-{task}",
        "--run-name",
        f"{algo} {task} seed {seed}",
        *extra,
    ]
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"PYTHONPATH": pythonpath} if pythonpath else {})}
    root.mkdir(
        parents=True, exist_ok=True
    )  # run from there: `python -m` puts the working folder first on sys.path
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=root)
    cell = Cell(algo, task, seconds=time.perf_counter() - start)
    if proc.returncode != 0:
        cell.error = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
        return cell
    run_id = proc.stdout.strip().splitlines()[-1]
    with SqlStore(f"sqlite:///{root / 'fedcli.db'}") as store:
        cell.tags = dict(store.get_run(run_id).tags)
        cell.value, cell.start, cell.secondary, cell.curve = _read(store, run_id, task)
    cell.values = (cell.value,)
    return cell


def stored_cell(algo: str, task: str, root: Path, seed: int = 0) -> Cell | None:
    """The newest finished run `algo task seed S` of the matrix's store under `root` (--from-store), or None."""
    from fedcli.errors import ConfigError
    from fedcli.tracking.store.sql_store import SqlStore

    if not (root / "fedcli.db").exists():
        return None
    with SqlStore(f"sqlite:///{root / 'fedcli.db'}") as store:
        try:
            listed = store.list_runs(experiment=f"matrix-{task}")
        except ConfigError:  # no such experiment yet
            return None
        runs = [r for r in listed if r.run_name == f"{algo} {task} seed {seed}" and r.status == "finished"]
        if not runs:
            return None
        record = max(runs, key=lambda r: r.created_at)
        value, start, secondary, curve = _read(store, record.id, task)
    return Cell(
        algo,
        task,
        value=value,
        values=(value,),
        start=start,
        secondary=secondary,
        curve=curve,
        tags=dict(record.tags),
    )


def merge(seeds: Sequence[Cell]) -> Cell:
    """One cell over its seeds: mean values and starts (round 0), the curves one after another, seed 0's
    tags; the first error if any run failed."""
    first = seeds[0]
    failed = next((c for c in seeds if c.error), None)
    values = tuple(v for c in seeds for v in c.values)
    present = [v for v in values if v is not None]
    keys = set.intersection(*(set(c.secondary) for c in seeds))
    return Cell(
        first.algo,
        first.task,
        value=float(np.mean(present)) if present and len(present) == len(values) else None,
        values=values,
        start=float(np.mean(starts))
        if len(starts := [c.start for c in seeds if c.start is not None]) == len(seeds)
        else None,
        secondary={k: float(np.mean([c.secondary[k] for c in seeds])) for k in sorted(keys)},
        curve=tuple(x for c in seeds for x in c.curve),
        tags=first.tags,
        error=failed.error if failed else "",
        seconds=sum(c.seconds for c in seeds),
    )


def accuracy_target(majority: float) -> float:
    """The accuracy a classifier must reach to count as learning: 2x the majority rate, or halfway from
    it to 100 % where that is lower (majority > 1/3: vehicle's binary task has 53 %, which no model
    can double)."""
    return min(2 * majority, (1 + majority) / 2)


def learns(cell: Cell, base: float | None, kind: str) -> str:
    """'' when the run learns (module docstring), else what it misses."""
    if cell.value is None:
        return "no value"
    if kind == "classification" and base is not None and cell.value < accuracy_target(base):
        return "< target (2x majority, or halfway to 100 %)"
    if kind == "multilabel" and base is not None and cell.value <= base:
        return "≤ trivial macro-F1"
    if kind in ("lsa", "regression") and cell.start is not None and cell.value >= cell.start:
        return "no closer to the optimum than round 0"
    return ""


def verdict(cell: Cell, fedavg: Cell | None, base: float | None, kind: str, caveat: str) -> str:
    """'' when the cell meets the targets (module docstring); else what it misses, and whether a reason
    (the algorithm's caveats, a recorded degenerate configuration) is on record."""
    if cell.error:
        return f"failed: {cell.error}"
    misses = [m for m in (learns(cell, base, kind),) if m]
    if fedavg is not None and cell.algo != "fedavg" and fedavg.value is not None and cell.value is not None:
        gap = (cell.value - fedavg.value) if md_lower(kind) else (fedavg.value - cell.value)
        if not md_lower(kind) and gap > MARGIN:
            misses.append(f"{100 * gap:.1f} points below fedavg")
        if cell.curve == fedavg.curve:
            misses.append("= fedavg")
    if not misses:
        return ""
    reason = (
        "degenerate (tag)"
        if cell.tags.get("fedcli.degenerate")
        else "warned (tag)"
        if cell.tags.get("fedcli.shortfall")
        else "caveat"
        if caveat
        else "UNEXPLAINED"
    )
    return f"{'; '.join(misses)} [{reason}]"


def recommended_items(cell: Cell) -> list[str]:
    """`key=value` items of the run's tag fedcli.recommended."""
    return [item.strip() for item in (cell.tags.get("fedcli.recommended") or "").split(";") if item.strip()]


def md_lower(kind: str) -> bool:
    """Lower is better for the distance tasks only."""
    return kind in ("lsa", "regression")


def algorithms() -> list[str]:
    from fedcli.algorithms import ALGORITHMS

    return list(ALGORITHMS)


def run_matrix(
    tasks: Sequence[str],
    rounds: int,
    root: Path,
    only: Sequence[str] = (),
    pythonpath: str = "",
    extra: dict[str, list[str]] | None = None,
    from_store: bool = False,
    seeds: int = 1,
    forced: Sequence[str] = (),
    stored_only: bool = False,
) -> tuple[dict[str, dict[str, Cell]], dict[str, str]]:
    """(task -> algo -> Cell, fedavg first on each task (the reference column); task -> why it was not run).
    `from_store` reuses the finished runs already under `root` and trains only the missing cells; `forced`
    tasks run even when `UNAFFORDABLE`; `stored_only` trains nothing (cells without a stored run are left out,
    a task without any is listed as not run)."""
    out: dict[str, dict[str, Cell]] = {}
    skipped: dict[str, str] = {}
    for task in tasks:
        why = (
            ""
            if pythonpath
            else ""
            if task in forced and task in UNAFFORDABLE and not unavailable_data(task)
            else unavailable(task)
        )
        if why:
            skipped[task] = why
            print(f"{task:>17} not run: {why}", file=sys.stderr, flush=True)
            continue
        names = ["fedavg", *(a for a in algorithms() if a != "fedavg" and (not only or a in only))]
        out[task] = {}
        if stored_only and stored_cell("fedavg", task, root) is None:
            skipped[task] = "no stored run (--stored-only: not run in the time given)"
            del out[task]
            continue
        for algo in names:
            if not applies(algo, task):
                continue
            per_seed = []
            for seed in range(seeds):
                stored = stored_cell(algo, task, root, seed) if from_store or stored_only else None
                if stored is None and stored_only:
                    break
                per_seed.append(
                    stored
                    or run_cell(
                        algo,
                        task,
                        rounds,
                        root,
                        seed=seed,
                        pythonpath=pythonpath,
                        extra=[*TASK_OPTIONS.get(task, []), *(extra or {}).get(task, [])],
                    )
                )
            if len(per_seed) < seeds:
                continue
            out[task][algo] = cell = merge(per_seed)
            shown = "failed" if cell.error else "—" if cell.value is None else f"{cell.value:.4f}"
            print(f"{task:>17} {algo:>15} {shown} ({cell.seconds:.0f} s)", file=sys.stderr, flush=True)
    return out, skipped


def _fmt(value: float | None, kind: str) -> str:
    if value is None:
        return "—"
    return f"{value:.3f}" if md_lower(kind) else f"{100 * value:.1f}"


def render(
    results: dict[str, dict[str, Cell]],
    rounds: int,
    command: str,
    seeds: int = 1,
    skipped: dict[str, str] | None = None,
) -> str:
    """The markdown page: one table per task, the value next to FedAvg's, the targets and the reasons."""
    from fedcli.algorithms import ALGORITHMS
    from fedcli.datasets.registry import TASKS as REGISTRY
    from fedcli.engine.evaluation import kind_metrics

    seed_words = "seed 0" if seeds == 1 else f"seeds 0-{seeds - 1}, mean"
    lines = [
        f"Command: `{command}` ({rounds} rounds, {seed_words}, one thread per run; {platform.machine()}, "
        f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d', time.gmtime())}).",
        "",
    ]
    unexplained = 0
    failed: list[str] = []
    for task, cells in results.items():
        record = REGISTRY[task]
        kind = record.kind
        name, base = baseline(task)
        metric = METRIC[kind]
        fedavg = cells.get("fedavg")
        unit = "" if md_lower(kind) else " (%)"
        extra = SECONDARY.get(kind, ())
        lines += [f"### {task}: {metric}{unit} at round {rounds}", ""]
        if kind == "classification" and base is not None:
            lines.append(f"{name}: {100 * base:.1f} (target: ≥ {100 * accuracy_target(base):.1f})")
        elif kind == "multilabel" and base is not None:
            fns = kind_metrics(record)
            micro = trivial_multilabel(task)["eval/micro_f1"]
            lines.append(
                f"Decision rule of the F1 metrics: {fns.rule if fns else '?'}. Trivial predictor (best "
                f"constant: no tag, every tag, or the 1-5 most frequent training tags): macro-F1 "
                f"{100 * base:.1f}, micro-F1 {100 * micro:.1f} (target: macro-F1 above it)."
            )
        else:
            start = fedavg.start if fedavg is not None else None
            lines.append(
                "lower is better; target: below the initial model's distance"
                + (
                    f" ({start:.3f} for fedavg, mean over seeds; each cell is compared with its own)"
                    if start is not None
                    else ""
                )
            )
        partition = sorted(
            {k for c in cells.values() for k in recommended_items(c) if k.startswith("partition.")}
        )
        if partition:
            lines += ["", f"Partition: the task's default, recorded as recommended ({'; '.join(partition)})."]
        shown = metric.split("/")[1]
        lines += [
            "",
            f"| algorithm | {shown} |"
            + "".join(f" {k.split('/')[1]} |" for k in extra)
            + " fedavg | vs fedavg | targets | recorded with the run |",
            "|---|---:|" + "---:|" * len(extra) + "---:|---:|---|---|",
        ]
        for algo, cell in cells.items():
            miss = verdict(cell, fedavg, base, kind, ALGORITHMS[algo].caveats)
            unexplained += "UNEXPLAINED" in miss or miss.startswith("failed")
            if miss.startswith("failed"):
                failed.append(f"{task}/{algo}")
            ref = fedavg.value if fedavg is not None else None
            diff = (
                "—"
                if algo == "fedavg" or cell.value is None or ref is None
                else (f"{cell.value - ref:+.3f}" if md_lower(kind) else f"{100 * (cell.value - ref):+.1f}")
            )
            recorded = "; ".join(
                f"{what} {v.split(': ', 1)[0]}"
                for what, tag in (("degenerate", "fedcli.degenerate"), ("shortfall", "fedcli.shortfall"))
                for v in (cell.tags.get(tag) or "").split(" | ")
                if v
            )
            own = [k for k in recommended_items(cell) if not k.startswith("partition.")]
            if own:
                recorded = "; ".join(x for x in (recorded, f"recommended {'; '.join(own)}") if x)
            more = "".join(f" {_fmt(cell.secondary.get(k), kind)} |" for k in extra)
            lines.append(
                f"| {algo} | {_fmt(cell.value, kind)} |{more} {_fmt(ref, kind)} | {diff} | {miss or 'met'} | "
                f"{recorded or '—'} |"
            )
        lines.append("")
    if skipped:
        lines += ["Not run:", "", *[f"- {task}: {why.rstrip('.')}." for task, why in skipped.items()], ""]
    lines += [
        f"Targets missed without a recorded reason (failed runs included): {unexplained}"
        + (f"; failed: {', '.join(failed)}." if failed else "."),
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 per cell (make matrix: 2)")
    parser.add_argument("--tasks", nargs="*", default=list(TASKS))
    parser.add_argument("--only", nargs="*", default=[], help="only these algorithms (and fedavg)")
    parser.add_argument("--root", type=Path, default=Path("matrix-runs"))
    parser.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    parser.add_argument(
        "--command",
        default=None,
        help="the command the page names (default: make matrix with --out, else this command line)",
    )
    parser.add_argument(
        "--pythonpath", default="", help="run the fedcli importable from here (another checkout)"
    )
    parser.add_argument(
        "--extra",
        nargs="*",
        default=[],
        metavar="TASK=OPTIONS",
        help="more `fedcli train` options for a task's runs (e.g. the scheme an older fedcli needs)",
    )
    parser.add_argument(
        "--from-store",
        action="store_true",
        help="reuse the finished runs under --root (render again; train only missing cells)",
    )
    parser.add_argument(
        "--run-unaffordable",
        action="store_true",
        help=f"run {', '.join(UNAFFORDABLE)} too (hours: module docstring)",
    )
    parser.add_argument(
        "--stored-only",
        action="store_true",
        help="train nothing: render the finished runs under --root (a matrix cut short)",
    )
    args = parser.parse_args(argv)
    extra = {k: v.split() for k, _, v in (item.partition("=") for item in args.extra)}
    results, skipped = run_matrix(
        args.tasks,
        args.rounds,
        args.root.resolve(),
        args.only,
        args.pythonpath,
        extra,
        args.from_store,
        args.seeds,
        stored_only=args.stored_only,
        forced=list(UNAFFORDABLE) if args.run_unaffordable else (),
    )
    command = args.command or ("make matrix" if args.out else " ".join(sys.argv))
    text = render(results, args.rounds, command, args.seeds, skipped)
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
    return 1 if "UNEXPLAINED" in text or "failed:" in text else 0


if __name__ == "__main__":
    sys.exit(main())
