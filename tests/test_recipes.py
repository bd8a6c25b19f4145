"""Recipes (fedcli/recipes/*.yaml): every one expands and runs in its --smoke form through the CLI.

The smoke runs keep the recipes from rotting (an algorithm, key or study they use changes); the
full runs are `make reproduce` (docs/reproductions.md). Variants, smoke overrides and study
dispatch are checked on their own below.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedcli.cli.main import app
from fedcli.errors import ConfigError
from fedcli.recipes import read_recipe, recipe_names, smoke_spec
from fedcli.sweep.spec import expand, load_spec

PAPER_RECIPES = (
    "fedpa-toy",
    "fedpa-bias",
    "fedpa-table1",
    "fedpa-femnist",
    "fedsparse-femnist",
    "fola-toy",
    "fola-mnist",
    "bayesadmm-toys",
    "bayesadmm-mnist",
    "scafflsa-garnet",
)


def test_the_issue_s_recipes_are_shipped_with_a_paper_claim_and_a_smoke_form() -> None:
    names = recipe_names()
    for name in PAPER_RECIPES:
        assert name in names, f"recipe {name} is missing"
        body = read_recipe(name)
        assert body.get("paper") and body.get("description"), name
        assert body.get("study") or body.get("smoke"), f"{name} has no smoke form"


def test_variants_cross_grid_and_seeds_and_win_over_both() -> None:
    spec = {
        "experiment": "v",
        "base": {"task": "lsq", "rounds": 2, "local_epochs": 3},
        "variants": [{"label": "A-1E", "algo": "fedavg", "local_epochs": 1}, {"label": "P", "algo": "fedpa"}],
        "grid": {"client_lr": [0.01, 0.1]},
        "seeds": [0, 1],
    }
    trials = expand(spec)
    assert [t.name for t in trials][:4] == [
        "A-1E client_lr=0.01 s0",
        "A-1E client_lr=0.01 s1",
        "A-1E client_lr=0.1 s0",
        "A-1E client_lr=0.1 s1",
    ]
    assert len(trials) == 8 and len({t.config.config_hash for t in trials}) == 8
    assert {t.config.train.local_epochs for t in trials if t.name.startswith("A-1E")} == {1}
    assert {t.config.train.local_epochs for t in trials if t.name.startswith("P ")} == {3}  # base
    assert {t.config.algorithm.name for t in trials if t.name.startswith("P ")} == {"fedpa"}


def test_smoke_overrides_merge_and_rename_the_experiment() -> None:
    spec = {
        "experiment": "x",
        "base": {"task": "lsq", "rounds": 50, "local_epochs": 2},
        "seeds": [0, 1, 2],
        "report": {"metric": "dist_to_opt", "at": [50]},
        "smoke": {"base": {"rounds": 2}, "seeds": [0], "report": {"at": [2]}},
    }
    out = smoke_spec(spec)
    assert out["experiment"] == "x-smoke" and out["seeds"] == [0] and "smoke" not in out
    assert out["base"] == {"task": "lsq", "rounds": 2, "local_epochs": 2}
    assert out["report"] == {"metric": "dist_to_opt", "at": [2]}


def test_smoke_needs_a_smoke_block_and_variants_must_be_mappings(tmp_path: Path) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text("experiment: e\nbase: {task: lsq}\n")
    with pytest.raises(ConfigError, match="--smoke needs a spec with a `smoke:` block"):
        load_spec(spec, None, smoke=True)
    spec.write_text("experiment: e\nvariants: [fedavg]\n")
    with pytest.raises(ConfigError, match="variants must be a list of mappings"):
        load_spec(spec, None)


def test_list_recipes_shows_every_recipe_with_its_paper() -> None:
    result = CliRunner().invoke(app, ["sweep", "--list-recipes"])
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert [line.split("\t")[0] for line in lines] == recipe_names()
    assert any("[Al-Shedivat et al. 2021, Table 3a]" in line for line in lines)


@pytest.mark.slow
@pytest.mark.parametrize("name", recipe_names())
def test_recipe_smoke_run_writes_its_report(name: str, tmp_path: Path) -> None:
    out = tmp_path / "report" / f"{name}.md"
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
    assert result.stdout.strip().splitlines()[-1] == str(out)
    text = out.read_text()
    assert "|---" in text, "the report has no table"  # every report is tables of numbers
    assert list(out.parent.glob("*.png")), "the report has no figure"
    body = read_recipe(name)
    if body.get("paper") and not body.get("study"):
        assert f"Reruns: {body['paper']}." in text
