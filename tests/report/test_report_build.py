"""Report building and rendering (tracking/report/) on a store filled by hand."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedcli.errors import ConfigError
from fedcli.tracking.report.build import build_report
from fedcli.tracking.report.model import ReportSpec, resolve_key
from fedcli.tracking.report.render import render_csv, render_json, render_markdown
from fedcli.tracking.store.sql_store import SqlStore

ROUNDS = 6


def _config(algo: str, seed: int, lr: float = 0.1, rho: float | None = None, executor: str = "auto") -> dict:
    return {
        "seed": seed,
        "algorithm": {"name": algo, "hp": {} if rho is None else {"rho": rho}},
        "data": {"task": "toy"},
        "partition": {"scheme": "natural"},
        "train": {"client_lr": lr, "rounds": ROUNDS, "executor": executor},
        "tracking": {"root": f"/somewhere/{seed}"},
    }


def _add(store: SqlStore, config: dict, accuracy: list[float], experiment: str = "exp") -> str:
    run_id = store.start_run(
        experiment=experiment,
        run_name=None,
        config=config,
        algo=config["algorithm"]["name"],
        task="toy",
        seed=config["seed"],
        tags={},
        fedcli_version="t",
        torch_version="t",
        git_commit=None,
    )
    for round_idx, value in enumerate(accuracy):
        metrics = {"eval/accuracy": value, "eval/loss": 1.0 - value}
        if round_idx:
            metrics.update(
                {"comm/bytes_up": 1000.0 * round_idx, "comm/bytes_down": 500.0, "time/round_s": 0.5}
            )
        store.log_round(run_id, round_idx, metrics)
    store.end_run(run_id, "finished")
    return run_id


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    """FedAvg (2 seeds, one run on another executor) and FedPA rho=0.1 (2 seeds, one stops at round 4)."""
    with SqlStore(f"sqlite:///{tmp_path / 's.db'}") as sql:
        _add(sql, _config("fedavg", 0), [0.0, 0.2, 0.4, 0.6, 0.6, 0.6, 0.6])
        _add(sql, _config("fedavg", 1, executor="loop"), [0.0, 0.2, 0.4, 0.4, 0.6, 0.8, 0.8])
        _add(sql, _config("fedpa", 0, rho=0.1), [0.0, 0.5, 0.7, 0.9, 0.9, 0.9, 0.9])
        _add(sql, _config("fedpa", 1, rho=0.1), [0.0, 0.5, 0.7, 0.9, 0.9])
        yield sql


def _row(markdown: str, heading: str, label: str) -> list[str]:
    block = markdown.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    line = next(x for x in block.splitlines() if x.startswith(f"| {label} |"))
    return [cell.strip() for cell in line.strip("|").split("|")][1:]


def test_default_groups_ignore_seed_tracking_and_execution_settings(store: SqlStore) -> None:
    report = build_report(store, ReportSpec(thresholds=(0.5,), at=(4,), window=2, smooth=2))

    assert [g.label for g in report.groups] == ["fedavg", "fedpa"]
    assert [r.seed for r in report.groups[0].runs] == [0, 1]
    assert report.groups[0].mixed == {}  # train.executor differs but does not change results
    assert report.metric == "eval/accuracy"


def test_table_cells_follow_the_definitions(store: SqlStore) -> None:
    """accuracy@4 with W = 2 is the mean over rounds 3, 4: FedAvg seeds (0.6+0.6)/2 = 0.6 and
    (0.4+0.6)/2 = 0.5 -> 55.00 ± 7.07 (% with sample std); FedPA 90.00 ± 0.00 (bold: best).
    Rounds to 0.5 with S = 2: FedAvg seed 0 avg_3 = 0.5 -> 3; seed 1 avg_4 = 0.5 -> 4;
    FedPA avg_2 = 0.6 -> 2 for both. accuracy@6: FedAvg (0.6+0.6)/2, (0.8+0.8)/2 -> 70.00 ± 14.14;
    one FedPA seed stopped at round 4, so FedPA has 1 of 2 seeds: no runner-up to beat, no bold.
    FedPA's 90.00 beats FedAvg's 55.00 by 35 points, more than the larger std 7.07: bold."""
    report = build_report(store, ReportSpec(thresholds=(0.5, 0.95), at=(4, 6), window=2, smooth=2))
    markdown = render_markdown(report)

    fedavg = _row(markdown, "eval/accuracy (Table 3 layout)", "fedavg")
    fedpa = _row(markdown, "eval/accuracy (Table 3 layout)", "fedpa")
    std = np.std([0.6, 0.5], ddof=1) * 100
    assert fedavg[:3] == [
        "2",
        f"55.00 ± {std:.2f}",
        "70.00 ± 14.14",
    ]  # the only group with every seed: no bold
    assert fedpa[:3] == ["2", "**90.00 ± 0.00**", "90.00 (1/2)"]  # the 4-round run never reached R = 6
    assert fedavg[3] == f"3.5 ± {np.std([3, 4], ddof=1):.1f}"
    assert fedpa[3] == "**2 ± 0**"
    assert fedpa[4] == "— (4–6 rounds)" and fedavg[4] == "— (6 rounds)"


def test_bytes_to_threshold_and_totals(store: SqlStore) -> None:
    """bytes up in round r = 1000 r: to round 2 (FedPA) = 3000 B; FedAvg to rounds 3 and 4 = 6000,
    10000 -> 8.00 ± 2.83 kB in a kB column; totals over 6 rounds = 21000 B."""
    report = build_report(store, ReportSpec(thresholds=(0.5,), at=(4,), window=2, smooth=2))
    markdown = render_markdown(report)

    heading = "Communication: bytes to each threshold and in total"
    assert "up to 50% (kB, ↓)" in markdown
    assert _row(markdown, heading, "fedavg")[1] == f"8.00 ± {np.std([6, 10], ddof=1):.2f}"
    assert _row(markdown, heading, "fedpa")[1] == "**3.00 ± 0.00**"
    assert _row(markdown, heading, "fedavg")[3] == "21.00 ± 0.00"


def test_forced_grouping_names_the_keys_that_differ(store: SqlStore) -> None:
    report = build_report(store, ReportSpec(group_by=("task",), at=(4,)))

    assert [g.label for g in report.groups] == ["task=toy"]
    assert set(report.groups[0].mixed) == {"algorithm.name", "algorithm.hp.rho"}
    assert any("differ in more than the seed" in note for note in report.notes)


def test_where_accepts_aliases_and_selection_errors(store: SqlStore) -> None:
    report = build_report(store, ReportSpec(where={"hp.rho": "0.1"}, at=(4,)))

    assert [g.label for g in report.groups] == ["fedpa"]  # one algorithm: named though not a group key
    assert {r.algo for r in report.groups[0].runs} == {"fedpa"}
    with pytest.raises(ConfigError, match=r"unknown config key 'rhoo' \(did you mean"):
        resolve_key("rhoo", ["algorithm.hp.rho", "train.client_lr"])
    with pytest.raises(ConfigError, match="no runs match"):
        build_report(store, ReportSpec(where={"algo": "scaffold"}))


def test_resolve_key_aliases() -> None:
    known = ["algorithm.name", "algorithm.hp.rho", "train.client_lr", "data.task"]

    assert resolve_key("algo", known) == "algorithm.name"
    assert resolve_key("hp.rho", known) == "algorithm.hp.rho"
    assert resolve_key("client_lr", known) == "train.client_lr"
    assert resolve_key("train.client_lr", known) == "train.client_lr"


def test_same_store_same_text_and_scripting_formats(store: SqlStore) -> None:
    spec = ReportSpec(thresholds=(0.5,), at=(4,), window=2, smooth=2, command="fedcli report --at 4")

    first, second = render_markdown(build_report(store, spec)), render_markdown(build_report(store, spec))
    as_json, as_csv = render_json(build_report(store, spec)), render_csv(build_report(store, spec))

    assert first == second
    assert (
        "fedcli report --at 4" in first and "20" not in first.split("\n", 3)[1]
    )  # no timestamp in the header
    assert '"label": "fedpa"' in as_json
    assert as_csv.splitlines()[0] == "group,run_id,seed,table,column,statistic,value"
    assert "fedpa,,,main,at@4,mean,0.9" in as_csv


def test_labels_lead_with_the_algorithm_and_unset_or_execution_keys_never_split(tmp_path: Path) -> None:
    """rho differs among FedPA runs -> `fedpa rho=0.1`, `fedpa rho=0.3`; `data.file` is None in one
    run and absent in another (an older run), `train.workers` differs: neither splits a group
    nor makes one mixed."""
    with SqlStore(f"sqlite:///{tmp_path / 's.db'}") as sql:
        old = _config("fedpa", 0, rho=0.1)
        new = {**_config("fedpa", 1, rho=0.1), "data": {"task": "toy", "file": None}}
        new["train"] = {**new["train"], "workers": 4}
        for config in (old, new, _config("fedpa", 0, rho=0.3), _config("fedavg", 0)):
            _add(sql, config, [0.0, 0.5, 0.6, 0.7, 0.7, 0.7, 0.7])

        report = build_report(sql, ReportSpec(at=(4,)))

    assert [g.label for g in report.groups] == ["fedavg", "fedpa rho=0.1", "fedpa rho=0.3"]
    assert [len(g.runs) for g in report.groups] == [1, 2, 1]
    assert all(not g.mixed for g in report.groups)
    assert report.groups[1].keys == {"algo": "fedpa", "hp.rho": "0.1"}


def test_window_and_smooth_default_to_the_run_length_and_long_windows_warn(store: SqlStore) -> None:
    """Runs of 6 (and 4) rounds: R = 4, so W = max(1, min(100, 4 // 10)) = 1 and S = 1. An
    explicit --window 50 is kept, with a warning note; --smooth 2 fits and gives none."""
    from fedcli.tracking.report.model import default_smooth, default_window

    default = build_report(store, ReportSpec(at=(4,)))
    long = build_report(store, ReportSpec(at=(4,), window=50, smooth=2))

    assert (default.spec.window, default.spec.smooth) == (1, 1)
    assert [default_window(r) for r in (4, 25, 500, 5000)] == [1, 2, 50, 100]
    assert [default_smooth(r) for r in (4, 25, 500)] == [1, 2, 10]
    assert not any(n.startswith("Warning") for n in default.notes)
    assert any(
        n.startswith("Window 1 and smoothing 1: the default for runs of 4 rounds") for n in default.notes
    )
    assert not any("the default for runs" in n for n in long.notes)
    assert (long.spec.window, long.spec.smooth) == (50, 2)
    assert [n for n in long.notes if n.startswith("Warning")] == [
        "Warning: --window 50 exceeds the 4 rounds every run ran: metric@R averages all rounds 1..R. "
        "Drop --window for the default (1 here: max(1, min(100, rounds // 10)))."
    ]
    assert "window 50; smoothing 2" in render_markdown(long)


def test_unfinished_runs_only_when_asked(tmp_path: Path) -> None:
    with SqlStore(f"sqlite:///{tmp_path / 's.db'}") as sql:
        run_id = _add(sql, _config("fedavg", 0), [0.0, 0.5, 0.6])
        sql.end_run(run_id, "interrupted")

        with pytest.raises(ConfigError, match="pass --include-unfinished"):
            build_report(sql, ReportSpec())
        report = build_report(sql, ReportSpec(include_unfinished=True))

    assert [r.id for r in report.groups[0].runs] == [run_id]
    assert any("did not finish (status interrupted)" in n for n in report.notes)


def test_reports_show_a_sqlite_store_under_the_working_folder_relative(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A committed report names no machine's paths: the store under the working folder is shown
    relative to it (the command still reruns from there); other stores as they are."""
    from fedcli.tracking.report.render import shown_store

    monkeypatch.chdir(tmp_path)
    assert shown_store(f"sqlite:///{tmp_path / 'runs' / 'fedcli.db'}") == "sqlite:///runs/fedcli.db"
    assert shown_store("sqlite:////elsewhere/fedcli.db") == "sqlite:////elsewhere/fedcli.db"
    assert shown_store("sqlite:///rel/fedcli.db") == "sqlite:///rel/fedcli.db"
    assert shown_store("postgresql+psycopg://me@db/f") == "postgresql+psycopg://me@db/f"
