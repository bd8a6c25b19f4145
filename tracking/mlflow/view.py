"""The runs table `fedcli ui` opens on: a saved MLflow view with the columns fedcli runs are compared by.

MLflow keeps the runs table's columns per browser (localStorage), so a browser's first visit
shows Run Name, Created, Dataset, Duration, Source and Models: no metric, no parameter
(MLflow 3.17). MLflow 3.15 added saved views: an experiment tag `mlflow.sharedViewState.<id>`
whose value is the envelope `{"name", "createdAt", "updatedAt", "state"}`, `state` being the
runs page's state as a JSON string (search facets and the table's UI state: `selectedColumns`,
`columnOrder`, `columnWidths`, ...). The runs page lists such tags under its "Views" menu and
opens one from the URL parameter `viewStateShareKey=<id>` on the runs route
(`#/experiments/<id>/runs?...`; MLflow's redirect from `#/experiments/<id>` drops the
parameter). Read from MLflow 3.17.2's bundled UI (mlflow/server/js/build: the saved-view
envelope, the `viewStateShareKey` parameter and the `mlflow.sharedViewState.` tag prefix).

`write_view` writes VIEW_ID ("fedcli: compare runs") to an experiment: the metrics and params
below, chosen from the experiment's own runs. The browser then shows MLflow's banner "You're
viewing a shared view" (Override saved view makes the columns that browser's own; Exit shared
view returns to its own columns). What a view cannot carry: expanded parent runs (MLflow leaves
`runsExpanded` out of shared state; a sweep's trials stay folded under its parent run until its
expander is clicked) and the Assistant panel, which MLflow opens by itself on a browser's first
visit to a server on localhost, 127.0.0.1 or ::1 (its x closes it for good in that browser).
docs/operations.md, "Browsing runs".
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

__all__ = ["VIEW_ID", "VIEW_NAME", "comparison_columns", "has_saved_views", "page_state", "write_view"]

VIEW_ID = "fedcli-compare"  # the tag is mlflow.sharedViewState.fedcli-compare; the URL's viewStateShareKey
VIEW_NAME = "fedcli: compare runs"
TAG_PREFIX = "mlflow.sharedViewState."
SINCE = (3, 15)  # MLflow's first release with saved views (its 3.15.0 release notes, "Shareable table views")
METRICS = (
    "eval/accuracy",
    "eval/dist_to_opt",
    "eval/loss",
    "train/loss",
)  # those the runs logged, in this order
PARAMS = ("algorithm.name", "data.task", "train.rounds", "train.local_epochs", "seed")  # always, where logged
# never columns: resources, paths and bookkeeping (they differ between runs without changing a result)
NOT_COMPARED = (
    "tracking.",
    "data.data_dir",
    "data.file",
    "partition.file",
    "train.threads",
    "train.workers",
    "train.device",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.cohort_chunk",
)
MAX_PARAMS = 14  # params shown at most (the tag value stays far below MLflow's 5,000-character limit)
MAX_RUNS = 500  # newest runs read to choose the columns


def has_saved_views() -> bool:
    """Whether the installed MLflow's UI reads saved views (>= 3.15)."""
    try:
        return tuple(int(part) for part in version("mlflow").split(".")[:2]) >= SINCE
    except (PackageNotFoundError, ValueError):
        return False


def comparison_columns(runs: Sequence[Any]) -> list[str]:
    """The runs table's columns for `runs` (MLflow `Run`s): the metrics of METRICS they logged, then
    the params of PARAMS, every `hp.*` param, and the other params whose value differs between the
    runs (NOT_COMPARED left out), at most MAX_PARAMS; as MLflow's column ids (metrics.`eval/loss`)."""
    logged = {key for run in runs for key in run.data.metrics}
    values: dict[str, set[str]] = {}
    for run in runs:
        for key, value in run.data.params.items():
            values.setdefault(key, set()).add(value)
    differing = sorted(k for k, v in values.items() if len(v) > 1 and not k.startswith(NOT_COMPARED))
    params = [k for k in PARAMS if k in values] + sorted(k for k in values if k.startswith("hp."))
    params += [k for k in differing if k not in params]
    return [f"metrics.`{k}`" for k in METRICS if k in logged] + [f"params.`{k}`" for k in params[:MAX_PARAMS]]


def page_state(columns: list[str], expanded: Iterable[str] = ()) -> dict[str, Any]:
    """MLflow 3's runs-page state (its defaults: newest first, active runs) with `columns` shown.

    Widths apply to the columns named in `columnOrder` ("1" is the checkbox column,
    `runDateAndNestInfo` the Created one), so run names and metric values show whole.
    `expanded` (parent run ids) applies only where the state goes to localStorage
    (scripts/ui_screenshots.py): a shared view drops it.
    """
    order = ["1", "attributes.`Run Name`", "runDateAndNestInfo", "duration", *columns]
    widths = {"attributes.`Run Name`": 230, **{c: 150 if c.startswith("metrics") else 130 for c in columns}}
    return {
        "searchFilter": "",
        "orderByKey": "attributes.start_time",
        "orderByAsc": False,
        "startTime": "ALL",
        "lifecycleFilter": "Active",
        "datasetsFilter": [],
        "modelVersionFilter": "All Runs",
        "selectedColumns": columns,
        "columnOrder": order,
        "columnWidths": widths,
        "runsExpanded": dict.fromkeys(expanded, True),
        "runsPinned": [],
        "runsHidden": [],
        "runsVisibilityMap": {},
        "runsHiddenMode": "FIRST_10_RUNS",
        "viewMaximized": False,
        "runListHidden": False,
        "isAccordionReordered": False,
        "useGroupedValuesInCharts": True,
        "hideEmptyCharts": True,
        "groupBy": None,
        "groupsExpanded": {},
        "autoRefreshEnabled": False,
        "globalLineChartConfig": {"xAxisKey": "step", "lineSmoothness": 0, "selectedXAxisMetricKey": ""},
    }


def write_view(client: Any, experiment_id: str) -> list[str]:
    """Write (or refresh) the saved view VIEW_ID on experiment `experiment_id` of `client` (an
    `MlflowClient`) and return its columns; [] and nothing written when the experiment has no run.

    The tag is rewritten only when its columns changed, keeping its creation time.
    """
    runs = client.search_runs([experiment_id], max_results=MAX_RUNS, order_by=["attributes.start_time DESC"])
    if not runs:
        return []
    columns = comparison_columns(runs)
    state = json.dumps(page_state(columns), separators=(",", ":"))
    key = TAG_PREFIX + VIEW_ID
    old = client.get_experiment(experiment_id).tags.get(key)
    created = now = int(time.time() * 1000)
    if old is not None:
        try:
            envelope = json.loads(old)
            if envelope.get("state") == state:
                return columns
            created = int(envelope.get("createdAt", now))
        except (ValueError, TypeError, AttributeError):
            pass  # not ours or damaged: replaced
    client.set_experiment_tag(
        experiment_id,
        key,
        json.dumps({"name": VIEW_NAME, "createdAt": created, "updatedAt": now, "state": state}),
    )
    return columns
