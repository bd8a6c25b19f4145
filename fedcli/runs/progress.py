"""What a run shows on stderr while it trains: the human-facing console and the progress bar (or plain lines).

`fedcli train` and `fedcli.train(progress=True)` show the same progress (docs/python-api.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from fedcli.config.sections import RunConfig


def console() -> Console:
    """Console for human-facing output (stderr), so stdout carries only results."""
    return Console(stderr=True, highlight=False)


ProgressFn = Callable[[int, dict[str, float]], None]


@contextmanager
def train_progress(cfg: RunConfig, quiet: bool = False) -> Iterator[ProgressFn | None]:
    """Show training progress on stderr: a live bar on a terminal, a plain line every 10 s otherwise.

    The bar leads with the round count and the ETA, so a narrow terminal keeps them, and
    metrics are dropped before those; without a terminal (nohup, a cluster job, `2> log`) a
    plain line `round 12/40 (30 %)  acc 0.61  0.31 s/round  ETA 8 s` goes out every 10 s and
    at the last round. While it is shown the engine's per-round INFO lines are held back (it
    shows the same numbers); `-v` still prints them.
    """
    if quiet:
        yield None
        return

    engine_log = logging.getLogger("fedcli.engine.rounds")
    previous = engine_log.level
    if logging.getLogger().level > logging.DEBUG:
        engine_log.setLevel(logging.WARNING)
    out = console()
    try:
        if out.is_terminal:
            with _bar(cfg, out) as update:
                yield update
        else:
            yield _plain_lines(cfg, out)
    finally:
        engine_log.setLevel(previous)


@contextmanager
def _bar(cfg: RunConfig, out: Console) -> Iterator[ProgressFn]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with (
        Progress(
            MofNCompleteColumn(),
            TimeRemainingColumn(compact=True, elapsed_when_finished=True),
            BarColumn(bar_width=None if out.width >= 120 else 12),
            TextColumn("[bold]{task.description}"),
            TextColumn("{task.fields[metrics]}"),
            console=out,
            transient=False,
            expand=False,
        ) as progress,
        logs_through(out),
    ):
        bar = progress.add_task(f"{cfg.algorithm.name}/{cfg.data.task}", total=cfg.train.rounds, metrics="")
        shown: dict[str, float] = {}

        def update(round_idx: int, metrics: dict[str, float]) -> None:
            shown.update({k: v for k, v in metrics.items() if k in LIVE_KEYS})
            progress.update(bar, completed=round_idx, metrics=_metrics_text(shown, out.width - 45))

        yield update


@contextmanager
def logs_through(out: Console) -> Iterator[None]:
    """Print log records through `out`, the live bar's console, while the bar is shown.

    The log handler's own console writes to the real stderr (rich unwraps the bar's stderr
    proxy), so a record logged under a live bar landed at the end of the bar's line
    ("... s/round 0.06383[15:40:50] INFO") and the bar was drawn again below it. Through the
    bar's console the record goes above the bar and the bar stays one line.
    """

    from rich.logging import RichHandler

    handlers = [h for h in logging.getLogger().handlers if isinstance(h, RichHandler)]
    previous = [h.console for h in handlers]
    for handler in handlers:
        handler.console = out
    try:
        yield
    finally:
        for handler, own in zip(handlers, previous, strict=True):
            handler.console = own


def _plain_lines(cfg: RunConfig, out: Console, every_s: float = 10.0) -> ProgressFn:
    import time

    start = time.monotonic()
    last = [start]
    shown: dict[str, float] = {}
    total = cfg.train.rounds

    def update(round_idx: int, metrics: dict[str, float]) -> None:
        shown.update({k: v for k, v in metrics.items() if k in LIVE_KEYS})
        now = time.monotonic()
        if round_idx < total and now - last[0] < every_s:
            return
        last[0] = now
        eta = (now - start) / max(round_idx, 1) * (total - round_idx)
        out.print(
            f"round {round_idx}/{total} ({100 * round_idx // total} %)  {_metrics_text(shown, 200)}"
            f"  ETA {eta:.0f} s",
            soft_wrap=True,
            highlight=False,
        )

    return update


def _metrics_text(shown: Mapping[str, float], width: int) -> str:
    """The live metrics, most important first, cut to whole items that fit `width` characters."""
    parts: list[str] = []
    used = 0
    for key, label in LIVE_KEYS.items():
        if key in shown:
            item = f"{label} {shown[key]:.4g}"
            if used + len(item) + 2 > max(width, 12) and parts:
                break
            parts.append(item)
            used += len(item) + 2
    return "  ".join(parts)


LIVE_KEYS = {
    "eval/accuracy": "acc",
    "eval/dist_to_opt": "dist",
    "time/round_s": "s/round",
    "eval/loss": "eval_loss",
    "train/loss": "train_loss",
}
