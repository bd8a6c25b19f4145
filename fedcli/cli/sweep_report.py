"""The end-of-sweep report of `fedcli sweep`: where the spec's `report:` block writes, and the `fedcli report`
markdown (and figures) of the sweep's finished runs under the recipe's description and paper claim.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def report_output(body: Mapping[str, Any], root: str, *, always: bool = False) -> Path | None:
    """Where the spec's `report:` block writes: its `output`, else <root>/reports/<experiment>.md."""
    block = body.get("report")
    if not block and not always:
        return None
    return Path((block or {}).get("output") or Path(root) / "reports" / f"{body['experiment']}.md")


def write_report(db: Any, body: Mapping[str, Any], run_ids: list[str], path: Path) -> None:
    """Write the `fedcli report` markdown (and figures) of the sweep's finished runs."""
    from fedcli.runs.outputs import output_error, write_output
    from fedcli.tracking.report.build import build_report
    from fedcli.tracking.report.model import ReportSpec
    from fedcli.tracking.report.plots import report_figures
    from fedcli.tracking.report.render import render_markdown, shown_store

    block = body["report"]
    numbers = lambda key: tuple(block.get(key) or ())  # noqa: E731
    group_by = block.get("group_by")
    command = shlex.join(
        ["fedcli", "report", "--runs", ",".join(i[:8] for i in run_ids), "--store", shown_store(db.url)]
    )
    spec = ReportSpec(
        runs=tuple(run_ids),
        metric=block.get("metric"),
        thresholds=numbers("thresholds"),
        at=numbers("at"),
        window=block.get("window"),
        smooth=block.get("smooth"),
        group_by=tuple(group_by.split(",")) if isinstance(group_by, str) else group_by,
        command=command,
        columns=tuple(block.get("columns") or ()),
    )
    built = build_report(db, spec)
    try:
        drawn = report_figures(built, path, None, "")  # PNGs beside the markdown, as `fedcli report --output`
    except OSError as exc:
        raise output_error(path, "report.output", exc) from None
    write_output(path, recipe_preamble(body, render_markdown(built, drawn)), "report.output")


def recipe_preamble(body: Mapping[str, Any], markdown: str) -> str:
    """Put the sweep's description and the paper claim it reruns under the report's title."""
    lines = markdown.split("\n")
    extra = [
        f"**{body['description']}**" if body.get("description") else "",
        f"Reruns: {body['paper']}." if body.get("paper") else "",
    ]
    extra = [line for line in extra if line]
    return "\n".join([lines[0], "", "\n\n".join(extra), *lines[1:]]) if extra else markdown
