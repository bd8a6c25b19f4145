"""`fedcli evaluate`: metrics of a run's stored global model (minimal; issue 4 extends it)."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from fedcli.cli.common import Panel, console, open_store, tracking_config
from fedcli.cli.errors import user_errors
from fedcli.errors import ConfigError


def evaluate(
    ctx: typer.Context,
    run: Annotated[str, typer.Argument(help="Run id, unique id prefix or run name.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the metrics as JSON.")] = False,
    store: Annotated[str | None, typer.Option(help="SQLAlchemy URL of the store.", rich_help_panel=Panel.TRACK)] = None,
) -> None:
    """Evaluate a run's final global model on its task's test split.

    This release computes loss and accuracy (or dist_to_opt) of the final model only;
    --checkpoint, --split, --per-client and --predictive arrive with the evaluation issue.

    Example: fedcli evaluate 3f2a9c
    """
    import torch

    from fedcli.config import resume_config
    from fedcli.engine.evaluation import evaluate as evaluate_params
    from fedcli.engine.train import build

    with user_errors(bool(ctx.obj and ctx.obj.get("debug"))):
        record = open_store(tracking_config({"tracking.store": store}).store_url).get_run(run)
        if not record.model_path:
            raise ConfigError(f"run {record.id} has no stored model (status {record.status}).")
        cfg = resume_config(record.config, {})
        setup = build(cfg)
        saved = torch.load(record.model_path, map_location=setup.device, weights_only=False)
        metrics = evaluate_params(setup.task, setup.fns, saved["params"], setup.data.test_x, setup.data.test_y,
                                  setup.data.optimum)
    if as_json:
        typer.echo(json.dumps({"id": record.id, "name": record.run_name, **metrics}, indent=2))
        return
    table = Table("metric", "value", title=f"run {record.id[:8]} ({record.algo} on {record.task}), test split")
    for key, value in metrics.items():
        table.add_row(key, f"{value:.4f}")
    console().print(table)
