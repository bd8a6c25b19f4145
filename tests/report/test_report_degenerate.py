"""Reports say when a comparison is not one (issue 24): bold only beyond the seed spread, identical
curves named, degenerate runs footnoted, recommended settings marked in the configuration table."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fedcli.tracking.report.build import build_report
from fedcli.tracking.report.model import ReportSpec
from fedcli.tracking.report.render import BOLD_RULE, render_markdown
from fedcli.tracking.store.sql_store import SqlStore


def _add(
    store: SqlStore,
    algo: str,
    seed: int,
    accuracy: list[float],
    tags: dict[str, str] | None = None,
    epochs: int = 1,
) -> str:
    config = {
        "seed": seed,
        "algorithm": {"name": algo, "hp": {}},
        "data": {"task": "toy"},
        "train": {"rounds": len(accuracy) - 1, "local_epochs": epochs},
    }
    run_id = store.start_run(
        experiment="exp",
        run_name=None,
        config=config,
        algo=algo,
        task="toy",
        seed=seed,
        tags=tags or {},
        fedcli_version="t",
        torch_version="t",
        git_commit=None,
    )
    for round_idx, value in enumerate(accuracy):
        store.log_round(run_id, round_idx, {"eval/accuracy": value, "eval/loss": 1.0 - value})
    store.end_run(run_id, "finished")
    return run_id


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    with SqlStore(f"sqlite:///{tmp_path / 's.db'}") as sql:
        yield sql


def _cells(markdown: str, label: str) -> list[str]:
    block = markdown.split("## eval/accuracy (Table 3 layout)\n", 1)[1].split("\n## ", 1)[0]
    line = next(x for x in block.splitlines() if x.startswith(f"| {label} |"))
    return [cell.strip() for cell in line.strip("|").split("|")][2:]


def test_a_best_mean_inside_the_seed_spread_is_not_bold(store: SqlStore) -> None:
    """The issue's case: 17.89 ± 14.23 against 14.45 ± 10.28 (2 seeds each): the 3.44-point gap is
    smaller than the larger std 14.23, so neither cell is bold; the rule is printed under the table."""
    _add(store, "fedpa", 0, [0.0, 0.2795])  # mean 0.1789, std 0.1423 (ddof 1)
    _add(store, "fedpa", 1, [0.0, 0.0783])
    _add(store, "fedavg", 0, [0.0, 0.2172])  # mean 0.1445, std 0.1028
    _add(store, "fedavg", 1, [0.0, 0.0718])
    markdown = render_markdown(build_report(store, ReportSpec(window=1, smooth=1)))

    assert (
        _cells(markdown, "fedpa")[0] == "17.89 ± 14.23" and _cells(markdown, "fedavg")[0] == "14.45 ± 10.28"
    )
    assert "**" not in "".join(_cells(markdown, "fedpa") + _cells(markdown, "fedavg"))
    assert BOLD_RULE in markdown


def test_a_gap_beyond_the_spread_is_bold_and_ties_are_not(store: SqlStore) -> None:
    """fedpa 0.80 ± 0.00 beats fedavg 0.50 ± 0.14 by 30 points > 14: bold. scaffold ties fedpa at 0.80
    in a second report: a tie has no winner, so nothing is bold there."""
    _add(store, "fedpa", 0, [0.0, 0.8])
    _add(store, "fedpa", 1, [0.0, 0.8])
    _add(store, "fedavg", 0, [0.0, 0.4])
    _add(store, "fedavg", 1, [0.0, 0.6])
    markdown = render_markdown(build_report(store, ReportSpec(window=1, smooth=1)))
    assert (
        _cells(markdown, "fedpa")[0] == "**80.00 ± 0.00**"
        and _cells(markdown, "fedavg")[0] == "50.00 ± 14.14"
    )

    _add(store, "scaffold", 0, [0.0, 0.8])
    _add(store, "scaffold", 1, [0.0, 0.8])
    markdown = render_markdown(build_report(store, ReportSpec(window=1, smooth=1)))
    assert (
        _cells(markdown, "fedpa")[0] == "80.00 ± 0.00" and _cells(markdown, "scaffold")[0] == "80.00 ± 0.00"
    )


def test_groups_with_identical_curves_are_named_in_a_note(store: SqlStore) -> None:
    """The README loop of the issue: fedpa that never left its burn-in trained FedAvg bit for bit; the
    report names the two groups as identical, footnotes the degenerate runs with their tag's message,
    and does not call the third (different) group identical."""
    message = "fedpa:all-burn-in: hp.burn_in_rounds=100 >= train.rounds=3: every round is burn-in"
    for seed, curve in ((0, [0.05, 0.1, 0.2, 0.3]), (1, [0.05, 0.15, 0.25, 0.35])):
        _add(store, "fedavg", seed, curve)
        _add(store, "fedpa", seed, curve, tags={"fedcli.degenerate": message})
        _add(store, "scaffold", seed, [v + 0.01 for v in curve])
    report = build_report(store, ReportSpec())
    markdown = render_markdown(report)

    identical = [n for n in report.notes if "identical eval/accuracy curves" in n]
    assert identical == [n for n in identical if "**fedavg**, **fedpa**" in n] and len(identical) == 1
    assert "scaffold" not in identical[0]
    assert (
        f"Group **fedpa**: 2 of 2 run(s) ran a degenerate configuration (tag fedcli.degenerate): {message}"
        in markdown
    )


def test_runs_with_a_known_shortfall_are_footnoted_with_its_message(store: SqlStore) -> None:
    """fola-offline on synthetic-1-1 warns before the run that it trails FedAvg there (tag fedcli.shortfall):
    the report footnotes its group with the message; FedAvg's group gets no such note."""
    message = "fola-offline:offline-product: the paper's offline-Laplace ablation trails FedAvg here"
    for seed in (0, 1):
        _add(store, "fedavg", seed, [0.1, 0.7])
        _add(store, "fola-offline", seed, [0.1, 0.5], tags={"fedcli.shortfall": message})
    markdown = render_markdown(build_report(store, ReportSpec(window=1, smooth=1)))
    assert (
        f"Group **fola-offline**: 2 of 2 run(s) ran where the algorithm is known to trail FedAvg "
        f"(tag fedcli.shortfall): {message}"
    ) in markdown
    assert "Group **fedavg**: " not in markdown


def test_recommended_settings_are_marked_in_the_configuration_table(store: SqlStore) -> None:
    """fedpa took local_epochs = 5 from its recommendation (tag fedcli.recommended), fedavg ran the default
    1: the configuration table shows both values, marks fedpa's as recommended and says the groups ran at
    unequal settings."""
    _add(store, "fedavg", 0, [0.0, 0.4], epochs=1)
    _add(
        store,
        "fedpa",
        0,
        [0.0, 0.5],
        epochs=5,
        tags={"fedcli.recommended": "hp.burn_in_rounds=1; train.local_epochs=5"},
    )
    markdown = render_markdown(build_report(store, ReportSpec(window=1, smooth=1)))

    row = next(line for line in markdown.splitlines() if line.startswith("| `local_epochs` |"))
    assert row == "| `local_epochs` | 1 | 5 (recommended) |"
    assert "the groups ran at unequal settings" in markdown
