"""`fedcli partition`: split a data set into clients and write a partition file.

The file (client -> example indices, the spec, the seed, the data's fingerprint, a format
version and a content hash) is what `fedcli train --partition FILE` reads. The summary
table goes to stdout (it is the result asked for); the file path goes to stderr.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from fedcli.cli.common import Panel, Scheme
from fedcli.cli.errors import user_errors
from fedcli.errors import ConfigError
from fedcli.runs.outputs import all_or_nothing, check_output, output_error


def partition(
    ctx: typer.Context,
    dataset: Annotated[
        str,
        typer.Option(
            help="Task whose training data is split (`fedcli list tasks`).", rich_help_panel=Panel.DATA
        ),
    ],
    scheme: Annotated[Scheme, typer.Option(help="Partition scheme.", rich_help_panel=Panel.DATA)],
    out: Annotated[Path, typer.Option(help="Partition file to write (JSON).")],
    alpha: Annotated[
        float | None,
        typer.Option(
            help="Dirichlet concentration: labels (dirichlet, two-level) or "
            "sizes (quantity). Smaller = more skew."
        ),
    ] = None,
    clients: Annotated[
        int | None, typer.Option(min=1, help="Number of clients. \\[default: all natural clients]")
    ] = None,
    shards_per_client: Annotated[int | None, typer.Option(min=1, help="Shards per client (shards).")] = None,
    labels_per_client: Annotated[int | None, typer.Option(min=1, help="Classes per client (labels).")] = None,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the partition (and of generated data).")] = 0,
    plot: Annotated[
        Path | None,
        typer.Option(help="Also draw the client x label heatmap and the size histogram to this PNG."),
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="Folder with the task's data files. \\[default: bundled copy]", rich_help_panel=Panel.DATA
        ),
    ] = None,
    download: Annotated[
        bool,
        typer.Option(
            help="Fetch missing public data files into --data-dir (needs a network).",
            rich_help_panel=Panel.DATA,
        ),
    ] = False,
    max_clients: Annotated[
        int | None,
        typer.Option(
            min=1, help="Read only the first N natural clients (StackOverflow).", rich_help_panel=Panel.DATA
        ),
    ] = None,
    size_alpha: Annotated[
        float, typer.Option(help="two-level: Dirichlet concentration of client sizes.")
    ] = 1.0,
    sigma: Annotated[float | None, typer.Option(help="quantity: log-normal sigma of client sizes.")] = None,
    min_size: Annotated[
        int, typer.Option(min=1, help="Redraw until every client has this many examples.")
    ] = 10,
    balanced: Annotated[
        bool, typer.Option(help="dirichlet: equal client sizes (FedLab client-inner).")
    ] = False,
) -> None:
    """Split a data set into federated clients and write a partition file.

    Example: fedcli partition --dataset mnist --scheme dirichlet --alpha 0.1 --clients 10 --out mnist-dir01.json
    """
    from fedcli.config.validation import require_max_clients_support
    from fedcli.datasets.partition.files import save_partition
    from fedcli.datasets.partition.make import make_partition
    from fedcli.datasets.partition.spec import PartitionSpec, check_unused_defaults
    from fedcli.datasets.partition.summary import plot_partition, summarize
    from fedcli.datasets.tasks import TaskOptions

    with user_errors(bool(ctx.obj and ctx.obj.get("debug"))):
        task = _task(dataset)
        spec = PartitionSpec(
            scheme=scheme.value,
            num_clients=clients,
            alpha=alpha,
            shards_per_client=shards_per_client,
            labels_per_client=labels_per_client,
            min_size=min_size,
            seed=seed,
            balanced=balanced,
            sigma=sigma,
            size_alpha=size_alpha,
        )
        check_unused_defaults(spec)
        require_max_clients_support(task, max_clients)
        check_output(out, "--out")  # before the data is loaded: a rejected command writes nothing
        check_output(plot, "--plot")
        if plot is not None and plot.resolve() == out.resolve():
            raise ConfigError(
                f"--plot must differ from --out; got {str(plot)!r} for both. Name the PNG apart."
            )
        data = task.load(
            TaskOptions(seed=seed, data_dir=data_dir, download=download, max_clients=max_clients)
        )
        labels = data.y.numpy()
        parts = make_partition(spec, labels=labels, natural=data.client_indices or None)
        summary = summarize(parts, labels, data.num_classes)
        with all_or_nothing(out, plot):  # a failed write (disk full) leaves no new file or folder
            try:
                save_partition(
                    out, parts, spec=spec, dataset=task.name, fingerprint=data.fingerprint, labels=labels
                )
            except OSError as exc:
                raise output_error(out, "--out", exc) from None
            if plot is not None:
                try:
                    plot_partition(parts, labels, data.num_classes, plot)
                except OSError as exc:
                    raise output_error(plot, "--plot", exc) from None
    Console().print(summary_table(f"{task.name} / {scheme.value}", summary))
    Console(stderr=True).print(f"wrote {out}" + (f" and {plot}" if plot is not None else ""))


def _task(name: str):  # noqa: ANN202 - a fedcli.datasets.tasks.Task
    from fedcli.config.checks import suggest
    from fedcli.datasets.registry import TASKS

    if name not in TASKS:
        raise ConfigError(
            f"unknown dataset {name!r}{suggest(name, list(TASKS))}; choose one of: {', '.join(TASKS)}."
        )
    return TASKS[name]


def summary_table(title: str, summary) -> Table:  # noqa: ANN001 - a PartitionSummary
    """The heterogeneity summary as a rich table (label rows only when the data has classes)."""
    rows = [
        ("clients", str(summary.num_clients)),
        ("examples assigned", f"{summary.num_assigned} of {summary.num_examples}"),
        (
            "client size min / median / max",
            f"{summary.size_min} / {summary.size_median:g} / {summary.size_max}",
        ),
    ]
    if summary.entropy is not None:
        rows += [
            ("classes", str(summary.num_classes)),
            (
                "label entropy per client, bits (min / mean / max)",
                f"{summary.entropy.min():.3f} / {summary.mean_entropy:.3f} / {summary.entropy.max():.3f}",
            ),
            ("global label entropy, bits", f"{summary.global_entropy:.3f}"),
            ("mean TV (= EMD, 0/1 ground metric) to global labels", f"{summary.mean_tv:.3f}"),
        ]
    table = Table("statistic", "value", title=title)
    for row in rows:
        table.add_row(*row)
    return table
