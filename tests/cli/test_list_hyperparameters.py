"""`fedcli list algos NAME`: each hyperparameter with its default and the comment its source gives it."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from typer.testing import CliRunner

from fedcli.algorithms import ALGORITHMS
from fedcli.cli.hpdoc import field_descriptions, hyperparameter_rows
from fedcli.cli.main import app

RUNNER = CliRunner()


@dataclass(frozen=True, kw_only=True)
class _Base:
    """Docstring, not a comment."""

    inherited: float = 0.5  # from the base class
    overridden: int = 1  # the base's text


@dataclass(frozen=True, kw_only=True)
class _Config(_Base):
    trailing: float = 0.1  # shrinkage rho >= 0; Table 6
    continued: int = 1  # first line;
    #                     second line
    # the block right above an
    # uncommented field describes it
    required: float
    bare: str = "x"

    # a comment after a blank line describes nothing
    multi: tuple[int, ...] = (  # opening line
        1,
        2,  # inside the value
    )
    overridden: int = 2  # the subclass's text

    def __post_init__(self) -> None:
        pass  # a method's comment is no field's


def test_trailing_continued_leading_inherited_and_missing_comments() -> None:
    assert field_descriptions(_Config) == {
        "inherited": "from the base class",
        "overridden": "the subclass's text",
        "trailing": "shrinkage rho >= 0; Table 6",
        "continued": "first line; second line",
        "required": "the block right above an uncommented field describes it",
        "bare": "",
        "multi": "opening line inside the value",
    }


def test_rows_give_type_default_and_required() -> None:
    rows = {r["name"]: r for r in hyperparameter_rows(_Config)}

    assert rows["required"]["default"] == "required" and rows["required"]["type"] == "float"
    assert rows["multi"]["default"] == (1, 2) and rows["trailing"]["default"] == 0.1


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_builtin_hyperparameter_has_a_description(name: str) -> None:
    """docs/style.md rule 5: every field is commented, so every one has a description to show."""
    described = field_descriptions(ALGORITHMS[name].config_cls)

    assert all(described.values()), {k: v for k, v in described.items() if not v}


def test_list_algos_name_shows_defaults_and_meanings() -> None:
    result = RUNNER.invoke(app, ["list", "algos", "fedpa"], env={"COLUMNS": "120"})

    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if "│ rho " in line)
    assert "0.1" in line and "shrinkage rho >= 0; Table 6" in line
    assert "burn_in_epochs" in result.stdout and "client_mixin_epochs_per_round" in result.stdout  # continued
    assert "Al-Shedivat" in result.stdout


def test_list_algos_name_json_and_mistakes() -> None:
    as_json = RUNNER.invoke(app, ["list", "algos", "fedprox", "--json"])
    unknown = RUNNER.invoke(app, ["list", "algos", "fedpaa"])
    misplaced = RUNNER.invoke(app, ["list", "tasks", "fedpa"])

    assert as_json.exit_code == 0
    (row,) = json.loads(as_json.stdout)
    (mu,) = row["hyperparameter_details"]
    assert mu["name"] == "mu" and mu["default"] == 0.1 and "proximal weight" in mu["description"]
    assert row["recommended"] == [] and row["caveats"] == ALGORITHMS["fedprox"].caveats
    assert (
        unknown.exit_code == 2
        and "did you mean 'fedpa'" in unknown.stderr
        and "Traceback" not in unknown.output
    )
    assert misplaced.exit_code == 2 and "applies to `fedcli list algos NAME` only" in misplaced.stderr
