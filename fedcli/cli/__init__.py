"""The fedcli command line (Typer)."""
