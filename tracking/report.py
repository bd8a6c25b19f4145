"""Paper-table reports from the SQL store (`fedcli report`, docs/architecture.md §6, docs/style.md rule 19).

`build_report(store, spec)` selects runs, groups them (by default by every config key that
differs between runs, except the seed and the `tracking` section), and computes per run
the quantities of the FedPA paper's Table 3 (metric@R, rounds to a threshold; definitions in
`fedcli.tracking.metric_defs`), bytes to each threshold (FedSparse's communication table)
and wall time; per group the mean ± std over seeds. Unless asked, the metric@R window and
the running-average length fit the run: W = max(1, min(100, R // 10)) and
S = max(1, min(10, R // 10)) for R = the last round every run reached. `render_markdown`,
`render_csv` and `render_json` turn that into text; `fedcli.tracking.plots` draws the figures.

Only the SQL store is read (pandas over SQLAlchemy); nothing here needs MLflow. The output
is deterministic: groups are sorted by their key values (numbers numerically), runs by
(seed, id) within a group, numbers use fixed decimals, and no timestamp is written.

The code lies in three modules, this one re-exports their public names (import from here):
`report_model` (ReportSpec, the Column/Group/Report records, config-key names and aliases),
`report_build` (selection, grouping, the per-run numbers, notes, `build_report`) and
`report_render` (number formats, markdown tables and page, CSV, JSON). They import downward
only: model <- build, model <- render; none imports this module.
"""

from __future__ import annotations

from fedcli.tracking.report_build import (
    REPORT_KEYS,
    build_report,
    drop_repeats,
    group_label,
    group_runs,
    logged_keys,
    make_tables,
    run_values,
    select_runs,
)
from fedcli.tracking.report_model import (
    MISSING,
    NON_RESULT_KEYS,
    PERCENT_NAMES,
    Column,
    Curve,
    Group,
    Report,
    ReportSpec,
    default_smooth,
    default_window,
    display_key,
    resolve_key,
    resolve_metric,
    run_config,
)
from fedcli.tracking.report_render import (
    BOLD_RULE,
    BYTE_UNITS,
    CONVENTIONS,
    byte_unit,
    format_cell,
    format_number,
    markdown_table,
    recommended_keys,
    render_csv,
    render_json,
    render_markdown,
    shared_partition,
    shown_store,
)

__all__ = ["BOLD_RULE", "BYTE_UNITS", "CONVENTIONS", "MISSING", "NON_RESULT_KEYS", "PERCENT_NAMES", "REPORT_KEYS",
           "Column", "Curve", "Group", "Report", "ReportSpec", "build_report", "byte_unit", "default_smooth",
           "default_window", "display_key", "drop_repeats", "format_cell", "format_number", "group_label",
           "group_runs", "logged_keys", "make_tables", "markdown_table", "recommended_keys", "render_csv",
           "render_json", "render_markdown", "resolve_key", "resolve_metric", "run_config", "run_values",
           "select_runs", "shared_partition", "shown_store"]
