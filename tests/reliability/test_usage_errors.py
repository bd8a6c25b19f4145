"""OneLineUsageErrors: Click usage errors as one 'error:' line and exit 2; other exits unchanged.

Tested on a small app of its own: `fedcli.cli.main.app` adopts it with
`typer.Typer(cls=OneLineUsageErrors, ...)` (then the usage cases of test_bad_input.py pass).
"""

from __future__ import annotations

from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from fedcli.cli.errors import OneLineUsageErrors, user_errors
from fedcli.errors import ConfigError

app = typer.Typer(cls=OneLineUsageErrors, no_args_is_help=True, add_completion=False)


@app.command()
def run(rounds: Annotated[int, typer.Option(min=1)] = 1, code: int = 0, fail: bool = False) -> None:
    with user_errors():
        if fail:
            raise ConfigError("train.rounds must be >= 1; got 0.")
    typer.echo(f"rounds={rounds}")
    if code:
        raise typer.Exit(code)


@app.command()
def other() -> None:
    typer.echo("other")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "--rounds", "0"], "Invalid value for '--rounds'"),
        (["run", "--rounds", "x"], "'--rounds'"),
        (["run", "--roundz", "3"], "No such option: --roundz"),
        (["nosuch"], "No such command 'nosuch'"),
        (["run", "--fail"], "train.rounds must be >= 1; got 0."),
    ],
)
def test_usage_errors_are_one_line(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(app, args)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and result.stdout == ""
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], result.stderr


def test_other_exits_are_unchanged() -> None:
    assert CliRunner().invoke(app, ["run", "--rounds", "3"]).stdout == "rounds=3\n"
    assert CliRunner().invoke(app, ["run", "--rounds", "3"]).exit_code == 0
    assert CliRunner().invoke(app, ["run", "--code", "3"]).exit_code == 3
    assert CliRunner().invoke(app, ["run", "--help"]).exit_code == 0
    assert "Usage" in CliRunner().invoke(app, []).output  # no_args_is_help still shows the help
