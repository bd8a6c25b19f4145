"""User mistakes get one line on stderr and exit code 2, never a traceback (STYLE.md rule 13)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console

from fedcli.errors import FedcliError


@contextmanager
def user_errors(debug: bool = False) -> Iterator[None]:
    """Turn FedcliError into 'error: <message>' on stderr + exit 2 (re-raise with --debug)."""
    try:
        yield
    except FedcliError as exc:
        if debug:
            raise
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {exc}", markup=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        Console(stderr=True).print("interrupted; the run is marked 'interrupted' in the store.")
        raise typer.Exit(130) from None
