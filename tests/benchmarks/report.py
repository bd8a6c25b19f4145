"""Markdown for `make bench` (bench-results/bench.md) from the results dict of run.py."""

from __future__ import annotations


def _s(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}g}"


def _x(num: float | None, den: float | None) -> str:
    return "—" if num is None or den is None else f"{num / den:.2f}x"


def markdown(results: dict[str, object]) -> str:
    m = results["machine"]
    lines = [
        f"# fedcli benchmark ({results.get('mode', 'full')})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores"
        + (f", GPU {m['gpu']}" if m.get("gpu") else ", no GPU")
        + f"; torch {m['torch']}, Python {m['python']}. "
        f"Date: {m['date']}. Load average at start {tuple(round(v, 2) for v in m['load_avg'])}"
        + (f", at end {tuple(round(v, 2) for v in m['load_avg_end'])}" if "load_avg_end" in m else "")
        + f". Repetitions: {results.get('reps')}; wall {_s(results.get('wall_s'), 4)} s.",
        "",
    ]
    flower = results.get("flower", {})
    if flower.get("note"):
        lines += [f"**Flower: {flower['note']}.**", ""]
    from tests.benchmarks.gpu import markdown as gpu_markdown

    lines += (
        _workloads(results)
        + gpu_markdown(results.get("gpu"))
        + _fedpa(results)
        + _tracking(results)
        + _startup(results)
        + _sweeps(results)
        + _memory(results)
    )
    if "targets" in results:
        lines += ["## Targets", "", "| target | value | required | status |", "|---|---|---|---|"]
        lines += [
            f"| {t['name']} | {_s(t['value'])} | {t['target']} | {t['status']} |" for t in results["targets"]
        ]
        lines.append("")
    return "\n".join(lines)


def _workloads(results: dict[str, object]) -> list[str]:
    work = results.get("workloads")
    if not work:
        return []
    rates = results["throughput_gflops"]
    lines = [
        "## Seconds per round (FEMNIST writers, FedAvg, 1 epoch, batch 20, SGD)",
        "",
        "Median of rounds 2..R, best of the repetitions, evaluation excluded. Throughput measured now: "
        f"GEMM {rates['gemm_1t']:.0f} GFLOP/s on 1 thread, {rates['gemm_threads']:.0f} on all cores as threads, "
        f"{rates['gemm_procs']:.0f} as one process per core; convolution {rates['conv_1t']:.0f} / "
        f"{rates['conv_threads']:.0f} / {rates['conv_procs']:.0f}. The FLOP floor divides the round's counted "
        "FLOPs (forward + backward, real examples only) by the best of these. `fedcli best` is the "
        "fastest fp32 executor (bf16 is opt-in and shown only).",
        "",
    ]
    names = list(dict.fromkeys(n for w in work.values() for n in w["best_s"]))
    lines += [
        "| workload | GFLOP/round | floor s | " + " | ".join(names) + " | fedcli best | auto picks |",
        "|---|---|---|" + "---|" * len(names) + "---|---|",
    ]
    for key, w in work.items():
        floor = w["floor"]
        cells = [_s(w["best_s"].get(n)) for n in names]
        lines.append(
            f"| {key} (R={w['rounds']}) | {floor['gflop_per_round']:.3g} | {floor['floor_s']:.3g} | "
            + " | ".join(cells)
            + f" | {w['fedcli_best']} | {w['auto']['executor']} |"
        )
    lines += [
        "",
        "| workload | Flower / fedcli | plain loop (best) / fedcli | fedcli / FLOP floor | "
        "plain loop / floor | Flower / floor |",
        "|---|---|---|---|---|---|",
    ]
    for key, w in work.items():
        floor_s = w["floor"]["floor_s"]
        lines.append(
            f"| {key} | {_x(w['flower_s'], w['fedcli_best_s'])} | {_x(w['plain_best_s'], w['fedcli_best_s'])} "
            f"| {_x(w['fedcli_best_s'], floor_s)} | {_x(w['plain_best_s'], floor_s)} "
            f"| {_x(w['flower_s'], floor_s)} |"
        )
    lines += [
        "",
        "The last two columns bound what any simulator can reach on this machine: a speed-up over the "
        "plain loop (or Flower) larger than plain loop / floor (Flower / floor) would need a round faster "
        "than its FLOP floor.",
    ]
    compiled = {
        f"{k} {name}": [r["compile_s"] for r in rs if r.get("compile_s") is not None]
        for k, w in work.items()
        for name, rs in w["runs"].items()
        if "compile" in name
    }
    if any(compiled.values()):
        lines += [
            "",
            "`--compile` (opt-in) seconds of compilation, per repetition (round 1 minus a typical round "
            "for process+compile; inductor's on-disk cache is cold only the first time): "
            + "; ".join(f"{k}: " + ", ".join(f"{v:.0f}" for v in vs) for k, vs in compiled.items() if vs)
            + ".",
        ]
    per = {
        k: f"{w['floor']['flop_per_example'] / 1e6:.3g} MFLOP/example ({100 * w['floor']['conv_share']:.0f} % conv)"
        for k, w in work.items()
    }
    lines += [
        "",
        "FLOP counts (torch.utils.flop_counter on one SGD step): "
        + "; ".join(f"{k}: {v}" for k, v in per.items())
        + ".",
        "",
    ]
    return lines


def _fedpa(results: dict[str, object]) -> list[str]:
    rows = results.get("fedpa")
    if not rows:
        return []
    lines = [
        "## FedPA overhead over FedAvg (client update, 5 epochs x 100 steps, l = 5; paper Table 1)",
        "",
        "| d | FedAvg ms | FedPA ms | overhead | paper |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['d']:g} | {r['fedavg_ms']:.1f} | {r['fedpa_ms']:.1f} | {r['overhead_pct']:+.1f} % | "
        + ("—" if r["paper_pct"] is None else f"+{r['paper_pct']:g} %")
        + " |"
        for r in rows
    ]
    return lines + [""]


def _tracking(results: dict[str, object]) -> list[str]:
    lines = []
    t = results.get("tracking")
    if t:
        lines += [
            "## MLflow's cost: `fedcli train` with the default MLflow sink vs `--no-mlflow`",
            "",
            "FEMNIST MLP, FedAvg, fresh root each run; mean round wall time (time/round_s), median of "
            "alternating repetitions.",
            "",
            "| clients | with MLflow, s | without, s | overhead | rounds 1-10 with / without | overhead 1-10 |",
            "|---|---|---|---|---|---|",
        ]
        for key, c in t.items():  # type: ignore[union-attr]
            lines.append(
                f"| {key.split('_')[-1]} | {c['with']:.4f} | {c['without']:.4f} | {c['overhead_pct']:+.1f} % "
                f"| {c['with_first']:.4f} / {c['without_first']:.4f} | {c['overhead_first_pct']:+.1f} % |"
            )
        lines.append("")
    c = results.get("checkpoints")
    if c:
        lines += [
            "## Checkpoints' cost: the demo with the default (auto) checkpoints vs `--checkpoint-every 0`",
            "",
            f"{c['with']:.4f} vs {c['without']:.4f} s per round: {c['overhead_pct']:+.1f} % "  # type: ignore[index]
            f"(rounds 1-10: {c['overhead_first_pct']:+.1f} %).",
            "",
        ]  # type: ignore[index]
    return lines


def _startup(results: dict[str, object]) -> list[str]:
    s = results.get("startup")
    if not s:
        return []
    return [
        "## Start-up: launch to the start of round 1",
        "",
        "| command | seconds |",
        "|---|---|",
        f"| fedcli train --rounds 1 (defaults: femnist MLP, MLflow on) | {_s(s['default'].get('to_first_round_s'))} |",
        f"| fedcli train --rounds 1 --no-mlflow | {_s(s['no_mlflow'].get('to_first_round_s'))} |",
        *(
            f"| fedcli train --model mlp --rounds 20{flag} (end: {_s(s[key].get('total_s'))} s) | "
            f"{_s(s[key].get('to_first_round_s'))} |"
            for key, flag in (("mlp_20", ""), ("mlp_20_no_mlflow", " --no-mlflow"))
            if key in s
        ),
        f"| Flower start_simulation (to its first configure_fit) | {_s(s['flower'].get('to_first_round_s'))} |",
        "",
    ]


def _sweeps(results: dict[str, object]) -> list[str]:
    if not results.get("sweeps"):
        return []
    from tests.benchmarks.sweeps import markdown as sweeps_markdown

    return [
        "## Sweeps: wall time vs the training inside it (issue 27)",
        "",
        sweeps_markdown(results["sweeps"]),
        "",
    ]  # type: ignore[arg-type]


def _memory(results: dict[str, object]) -> list[str]:
    mem = results.get("memory")
    if not mem:
        return []
    lines = [
        f"## Memory: {mem['num_clients']} synthetic clients ({mem['examples']} 28x28 images), {mem['algo']}, MLP",
        "",
        f"A dense per-client state for every client would take {mem['dense_store_mb']:.0f} MB; the store "
        "holds only visited clients. Transient = peak RSS during a round minus RSS before it.",
        "",
        "| cohort | chunk | clients visited | RSS growth MB | client-state store MB | transient per round MB |",
        "|---|---|---|---|---|---|",
    ]
    for run in mem["runs"]:
        f = run["final"]
        lines.append(
            f"| {run['cohort']} | {run['chunk'] or '—'} | {f['visited']} | {f['growth_mb']:.0f} | "
            f"{f['store_mb']:.0f} | {run['transient_mb_median']:.0f} |"
        )
    return lines + [""]
