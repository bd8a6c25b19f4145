"""What `fedcli train` prints where, as a script or a cluster job sees it (no terminal)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_stdout_is_only_the_run_id_and_progress_is_plain_lines_on_stderr(tmp_path: Path) -> None:
    """Without -q and without a terminal: stdout = the run id alone; stderr has plain progress lines
    with the round count and an ETA, and hints that name the store of a non-default root."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "train",
            "--task",
            "lsq",
            "--rounds",
            "3",
            "--root",
            str(tmp_path),
            "--no-mlflow",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and len(lines[0]) == 32
    assert "round 3/3 (100 %)" in proc.stderr and "ETA" in proc.stderr
    assert "\x1b[" not in proc.stderr  # no terminal escapes in a log file
    assert f"--store sqlite:///{tmp_path.resolve() / 'fedcli.db'}" in proc.stderr


def test_version() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fedcli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.startswith("fedcli ")


def test_log_records_under_the_live_bar_go_through_the_bar_console() -> None:
    """A record logged while the bar is live is printed by the bar's console (above the bar), not
    written to the real stderr at the end of the bar's line; the handler gets its console back."""
    import io
    import logging

    from rich.console import Console
    from rich.logging import RichHandler

    from fedcli.runs.progress import logs_through

    own, bar = Console(file=io.StringIO()), Console(file=io.StringIO(), width=80)
    handler = RichHandler(console=own)
    logging.getLogger().addHandler(handler)
    try:
        with logs_through(bar):
            logging.getLogger("fedcli.test").warning("run abc finished")
        logging.getLogger("fedcli.test").warning("after the bar")
    finally:
        logging.getLogger().removeHandler(handler)
    assert "run abc finished" in bar.file.getvalue() and "run abc finished" not in own.file.getvalue()
    assert handler.console is own and "after the bar" in own.file.getvalue()
