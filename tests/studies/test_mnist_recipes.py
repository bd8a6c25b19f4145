"""The MNIST paper recipes (fola-mnist, bayesadmm-mnist) run in their --smoke form through the CLI.

Each writes its report with one row per algorithm of the recipe (grouped by algorithm, and for
fola-mnist by Dirichlet alpha too); the full runs are `fedcli sweep --recipe NAME`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedcli.cli.main import app
from fedcli.recipes import read_recipe, smoke_spec

ALGOS = {
    "fola-mnist": ("fedavg", "fedcurv", "fola"),
    "bayesadmm-mnist": ("fedavg", "fedprox", "feddyn", "fedadmm", "bayesadmm"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ALGOS))
def test_mnist_recipe_smoke_report_has_a_row_per_algorithm(name: str, tmp_path: Path) -> None:
    body = read_recipe(name)
    assert body["paper"] and body["base"]["task"] == "mnist"
    assert {v["algo"] for v in body["variants"]} == set(ALGOS[name])  # what the recipe runs, as labelled

    out = tmp_path / f"{name}.md"
    result = CliRunner().invoke(
        app,
        [
            "sweep",
            "--recipe",
            name,
            "--smoke",
            "--no-mlflow",
            "--workers",
            "2",
            "--root",
            str(tmp_path / "runs"),
            "--output",
            str(out),
        ],
    )

    assert result.exit_code == 0, result.output
    assert f"sweep done: {len(ALGOS[name])} finished." in result.stderr
    text = out.read_text()
    assert f"Reruns: {body['paper']}." in text
    main = text.split("\n## ")[1]  # the metric table: one row per group
    rows = [line.split("|")[1].strip() for line in main.splitlines() if line.startswith("| ")][
        1:
    ]  # minus header
    assert sorted(row.split()[0] for row in rows) == sorted(ALGOS[name]), rows
    at = smoke_spec(body)["report"]["at"]
    assert all(re.search(rf"\| {re.escape(row)} \| 1 \| \*{{0,2}}[0-9.]+", main) for row in rows), (
        main
    )  # a value @R
    assert f"@{at[0]}R" in main
