"""User mistakes get one line on stderr and exit code 2, never a traceback (docs/style.md rule 13).

Output files the user names are checked and written all or nothing by fedcli/runs/outputs.py,
which the Python API uses too; an empty path option gets its message there (`check_path_value`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import typer
from typer.core import TyperGroup

try:  # Typer >= 0.2x runs a vendored copy of Click; its exceptions are those classes
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - older Typer on the click package
    from click import exceptions as click_errors  # type: ignore[no-redef]
from rich.console import Console
from rich.text import Text

try:  # the vendored Click keeps Abort in typer.exceptions, not in its exceptions module
    from typer.exceptions import Abort as _Abort
except ImportError:  # pragma: no cover - older Typer on the click package
    from click.exceptions import Abort as _Abort  # type: ignore[assignment]

from fedcli.errors import FedcliError
from fedcli.runs.outputs import EMPTY_PATH_MESSAGES, check_path_value


@contextmanager
def user_errors(debug: bool = False) -> Iterator[None]:
    """Turn FedcliError into 'error: <message>' on stderr + exit 2 (re-raise with --debug)."""
    try:
        yield
    except FedcliError as exc:
        if debug:
            raise
        print_error(str(exc))
        raise typer.Exit(
            getattr(exc, "exit_code", 2)
        ) from None  # 75: the run was taken over (tracking.store)
    except KeyboardInterrupt:
        Console(stderr=True).print("interrupted; the run is marked 'interrupted' in the store.")
        raise typer.Exit(130) from None


def print_error(message: str) -> None:
    """Print 'error: <message>' as one line on stderr (no rich markup: messages hold '[N, ...]')."""
    line = Text("error:", style="bold red")
    line.append(" " + " ".join(message.split()))  # one line, whatever the message holds
    Console(stderr=True, highlight=False, soft_wrap=True).print(line)


class OneLineUsageErrors(TyperGroup):
    """The app's group class: Click usage errors (bad option values, unknown options or commands,
    missing required options) as the same one 'error:' line and exit 2 as FedcliError, instead
    of Typer's usage box. Wire it with `typer.Typer(cls=OneLineUsageErrors, ...)`.

    It also refuses an empty path-valued option (EMPTY_PATH_MESSAGES) before Typer makes it ".".
    """

    def resolve_command(self, ctx: Any, args: list[str]) -> tuple[str | None, Any, list[str]]:
        name, cmd, rest = super().resolve_command(ctx, args)
        if cmd is not None and not ctx.resilient_parsing and not set(rest) & set(ctx.help_option_names):
            try:  # the subcommand's own parser, without converting: raw strings by parameter name
                parser = cmd.make_parser(cmd.context_class(cmd, info_name=name, parent=ctx))
                raw, _, _ = parser.parse_args(args=list(rest))
            except click_errors.ClickException:
                raw = {}  # the real parse reports it
            for key in EMPTY_PATH_MESSAGES.keys() & raw.keys():
                check_path_value(key, raw[key])
        return name, cmd, rest

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(
                args,
                prog_name,
                complete_var,
                standalone_mode=False,
                windows_expand_args=windows_expand_args,
                **extra,
            )
        try:
            code = super().main(
                args,
                prog_name,
                complete_var,
                standalone_mode=False,
                windows_expand_args=windows_expand_args,
                **extra,
            )
        except click_errors.NoArgsIsHelpError as exc:  # the help was printed already
            sys.exit(exc.exit_code)
        except FedcliError as exc:  # raised before a command runs (resolve_command's empty paths)
            print_error(str(exc))
            sys.exit(2)
        except click_errors.ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            hint = f"; see '{ctx.command_path} --help'." if ctx is not None else ""
            print_error(exc.format_message().rstrip(".") + hint)
            sys.exit(exc.exit_code)
        except _Abort:  # Ctrl-C outside a run (Click turns KeyboardInterrupt into Abort)
            Console(stderr=True).print("Aborted.")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)
