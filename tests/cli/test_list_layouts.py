"""`fedcli list` at 80 columns, in a pipe and wide: values wrap, never cut; runs show their own
non-default hyperparameters in the table and in --json.

At 80 columns (and in a pipe, where rich assumes 80) `list algos` and `list tasks` print one
record per item: the name beside its paper or description, then one indented line per field,
wrapped in about 60 columns. Wide terminals get tables whose cells fold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from fedcli.algorithms import ALGORITHMS
from fedcli.cli.main import app
from fedcli.datasets.registry import TASKS
from fedcli.tracking.keys import flatten_config

RUNNER = CliRunner()


def words(text: str) -> str:
    """The text with every run of whitespace one space (wrapping only moves whitespace)."""
    return " ".join(text.split())


def hyperparameter_items() -> list[str]:
    """Every `name=default` that `fedcli list algos` shows, as the JSON gives it."""
    rows = json.loads(RUNNER.invoke(app, ["list", "algos", "--json"]).stdout)
    return [f"{k}={v}" for row in rows for k, v in flatten_config(row["hyperparameters"]).items()]


def assert_whole(stdout: str, width: int) -> None:
    lines = stdout.splitlines()
    assert max(len(line) for line in lines) <= width
    assert "…" not in stdout
    tokens = {token.rstrip(",") for token in stdout.split()}
    missing = [item for item in hyperparameter_items() if item not in tokens]
    assert not missing, f"not shown whole: {missing[:5]}"


def test_list_algos_at_80_columns_shows_every_default_whole() -> None:
    """FedPA's burn_in_rounds=100 was shown as "burn_in_rounds=10…" (a 4-column table at 80)."""
    result = RUNNER.invoke(app, ["list", "algos"], env={"COLUMNS": "80"})

    assert result.exit_code == 0, result.output
    assert_whole(result.stdout, 80)
    assert "burn_in_rounds=100" in result.stdout.split() or "burn_in_rounds=100," in result.stdout.split()
    for name, record in ALGORITHMS.items():
        assert words(record.paper) in words(result.stdout), name


def test_list_algos_in_a_pipe_is_the_80_column_layout() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.run(
        [sys.executable, "-m", "fedcli", "list", "algos"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )

    assert proc.returncode == 0, proc.stderr
    assert_whole(proc.stdout, 80)
    assert "\x1b[" not in proc.stdout


def test_list_tasks_in_a_pipe_shows_every_description_and_source_whole() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.run(
        [sys.executable, "-m", "fedcli", "list", "tasks"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )

    assert proc.returncode == 0, proc.stderr
    assert max(len(line) for line in proc.stdout.splitlines()) <= 80 and "…" not in proc.stdout
    for name, task in TASKS.items():
        assert words(f"{name} {task.description}") in words(proc.stdout), name
        assert words(task.source) in words(proc.stdout), name


def test_list_tasks_at_80_columns_keeps_descriptions_readable() -> None:
    """Each description reads as one text (a 7-column table wrapped it to a word or two per line),
    and its lines use the width: no wrapped line but a record's last is shorter than 40 characters."""
    result = RUNNER.invoke(app, ["list", "tasks"], env={"COLUMNS": "80"})

    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in result.stdout
    text = words(result.stdout)
    for name, task in TASKS.items():
        assert words(f"{name} {task.description}") in text, name
        assert words(task.source) in text, name
    for line, following in zip(lines, lines[1:], strict=False):
        if following.startswith(" " * 18) and following.strip():  # `line` wrapped onto `following`
            assert len(line.rstrip()) >= 40, (line, following)


def test_wide_terminals_get_tables_whose_cells_fold() -> None:
    algos = RUNNER.invoke(app, ["list", "algos"], env={"COLUMNS": "200"})
    tasks = RUNNER.invoke(app, ["list", "tasks"], env={"COLUMNS": "200"})

    assert algos.exit_code == 0 and tasks.exit_code == 0
    assert "┃ hyperparameters" in algos.stdout and "┃ description" in tasks.stdout
    assert "…" not in algos.stdout and "…" not in tasks.stdout


def test_list_runs_shows_each_runs_non_default_hyperparameters(tmp_path: Path) -> None:
    """Two FedProx runs trained with the same --hp mu=0.01 (FedProx's default is 0.1) and a FedAvg
    run: the hp column showed "—" for both (mu did not differ between the listed runs); now each
    shows mu=0.01, at 80 columns too, and --json carries every hyperparameter and the non-default ones."""
    ids = []
    for algo, hp in (
        ("fedprox", ["--hp", "mu=0.01"]),
        ("fedprox", ["--hp", "mu=0.01", "--seed", "1"]),
        ("fedavg", []),
    ):
        result = RUNNER.invoke(
            app,
            [
                "-q",
                "train",
                "--task",
                "lsq",
                "--algo",
                algo,
                *hp,
                "--rounds",
                "1",
                "--root",
                str(tmp_path),
                "--no-mlflow",
            ],
        )
        assert result.exit_code == 0, result.output
        ids.append(result.stdout.strip())

    table = RUNNER.invoke(app, ["list", "runs", "--root", str(tmp_path)], env={"COLUMNS": "80"})
    as_json = RUNNER.invoke(app, ["list", "runs", "--root", str(tmp_path), "--json"])

    assert table.exit_code == 0, table.output
    assert max(len(line) for line in table.stdout.splitlines()) <= 80
    rows = {line.split("│")[1].strip(): line for line in table.stdout.splitlines() if line.startswith("│ ")}
    assert "mu=0.01" in rows[ids[0][:8]] and "mu=0.01" in rows[ids[1][:8]]
    assert "│ —" in rows[ids[2][:8]]
    listed = {row["id"]: row for row in json.loads(as_json.stdout)}
    assert listed[ids[0]]["non_default_hyperparameters"] == {"mu": "0.01"}
    assert (
        listed[ids[0]]["hyperparameters"]["mu"] == "0.01"
        and listed[ids[2]]["non_default_hyperparameters"] == {}
    )
