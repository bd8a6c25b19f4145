"""A report's options checked and its files written, for `fedcli report` and `fedcli.report(...)`.

The report itself is built and rendered by fedcli.tracking.report; the partition heatmap needs the
data layer, which `fedcli.tracking` must not import, so its counts are read here (`partition_counts`).
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedcli.errors import ConfigError, FedcliError
from fedcli.runs.outputs import all_or_nothing, publish, staging_dir, write_output
from fedcli.runs.progress import console

if TYPE_CHECKING:
    import numpy as np

    from fedcli.tracking.report.model import Report


class Format(str, Enum):
    md = "md"
    csv = "csv"
    json = "json"


def parse_numbers(flag: str, text: str | None, kind: type) -> list[Any]:
    """'0.84,0.86' -> [0.84, 0.86]; ConfigError naming the flag on anything else."""
    if not text:
        return []
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(
            f"{flag} must be comma-separated {'integers' if kind is int else 'numbers'}; got {text!r}."
        ) from None
    if kind is int and any(v < 1 for v in values):
        raise ConfigError(f"{flag} rounds must be >= 1; got {text!r}.")
    if any(v != v or v in (float("inf"), float("-inf")) for v in values):
        raise ConfigError(f"{flag} must be finite numbers; got {text!r}.")
    return values


def parse_list(flag: str, items: list[str] | None, what: str) -> tuple[str, ...]:
    """['a,b', 'c'] -> ('a', 'b', 'c'); a flag given but naming nothing (',') is a ConfigError."""
    parts = tuple(part.strip() for item in items or [] for part in item.split(",") if part.strip())
    if items and not parts:
        raise ConfigError(
            f"{flag} must name at least one {what}; got {','.join(items)!r}. Drop {flag} for the default."
        )
    twice = next((p for i, p in enumerate(parts) if p in parts[:i]), None)
    if twice is not None:  # a repeated column or group key was shown twice (or dropped): say which
        raise ConfigError(f"{flag} names {what} {twice!r} twice; keep one.")
    return parts


def parse_metric(metric: str | None) -> str | None:
    if metric is not None and not metric.strip():
        raise ConfigError(
            "--metric must be a metric name such as accuracy or eval/loss; got ''. "
            "Drop --metric for the default."
        )
    return metric


def parse_where(items: list[str]) -> dict[str, str]:
    """['algo=fedpa'] -> {'algo': 'fedpa'}."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--where must be KEY=VALUE (e.g. algo=fedpa); got {item!r}.")
        if key.strip() in out:  # the last one won: `--where algo=a --where algo=b` matched algo=b only
            raise ConfigError(
                f"--where {key.strip()} must be given once; got {key.strip()}={out[key.strip()]} and "
                f"{item.strip()!r}. Keep one (a report filters on one value per key)."
            )
        out[key.strip()] = value.strip()
    return out


def write_report(built: Report, output: Path | None, output_format: Format, load_data: bool) -> str:
    """Render the report; with --output write it (and the markdown's PNGs) all or nothing."""
    from fedcli.tracking.report.plots import report_figures
    from fedcli.tracking.report.render import render_csv, render_json, render_markdown

    if output_format is not Format.md:
        text = render_csv(built) if output_format is Format.csv else render_json(built)
        if output is not None:
            with all_or_nothing(output):
                write_output(output, text, "--output")
        return text
    if output is None:
        console().print("no figures: pass --output FILE to write the PNGs beside the markdown.")
        return render_markdown(built, [])
    counts, title = partition_counts(built, load_data)
    with all_or_nothing(output), staging_dir(output, "--output") as staging:
        text = render_markdown(built, report_figures(built, staging / output.name, counts, title))
        write_output(output, text, "--output")
        publish(staging, output.parent, "--output")
    return text


def partition_counts(built: Report, load_data: bool) -> tuple[np.ndarray | None, str]:
    """Clients x labels counts of the partition all runs share: from its partition file, else (with
    `load_data`, offline tasks with class targets only) by building the first run's setup again."""
    import json

    import numpy as np

    from fedcli.tracking.report.render import shared_partition

    shared = shared_partition(built)
    if shared is None:
        return None, ""
    file = shared.get("partition.file", "None")
    if file not in ("None", "—"):
        hist = (
            json.loads(Path(file).read_text(encoding="utf-8")).get("label_histograms")
            if Path(file).exists()
            else None
        )
        return (
            (None, "")
            if hist is None
            else (np.asarray(hist), f"{shared['data.task']}, partition file {Path(file).name}")
        )
    if not load_data:
        built.notes.append(
            f"The runs share the {shared.get('partition.scheme')} partition of {shared['data.task']}; "
            "its heatmap needs the data: add --partition-heatmap."
        )
        return None, ""
    from fedcli.config.build import resume_config
    from fedcli.datasets.partition.summary import label_histograms
    from fedcli.datasets.registry import TASKS
    from fedcli.datasets.yours.trust import recorded_code
    from fedcli.engine.setup import build

    stored = dict(built.groups[0].runs[0].config)
    code = recorded_code(stored.get("data") if isinstance(stored.get("data"), dict) else None)
    if any(c.what == "data function" for c in code):
        built.notes.append(
            "No partition heatmap: the runs' data comes from a data function, user code that fedcli "
            'report does not import (docs/operations.md, "Security").'
        )  # a row names it
        return None, ""
    if code:  # the runs' own model is user code: the data and partition do not depend on the model, the default does
        stored["data"] = {**stored["data"], "model": None, "model_sha256": None, "model_args": None}
    try:
        cfg = resume_config(stored, {"train.device": "cpu"})
        if not TASKS[cfg.data.task].offline or cfg.data.data_dir:
            return None, ""
        setup = build(cfg)  # the data and partition exactly as the runs had them
    except (FedcliError, KeyError):
        return None, ""
    counts = label_histograms(setup.fed.client_indices, setup.data.y.numpy(), setup.data.num_classes)
    return counts, f"{cfg.data.task}, {cfg.partition.scheme} partition, {setup.fed.num_clients} clients"
