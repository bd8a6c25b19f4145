"""Paper-table reports from the SQL store (`fedcli report`, docs/architecture.md §6).

`build.build_report(store, spec)` selects runs, groups them (by default by every config key that
differs between runs, except the seed and the `tracking` section), and computes per run the
quantities of the FedPA paper's Table 3 (metric@R, rounds to a threshold; definitions in
`fedcli.tracking.metric_defs`), bytes to each threshold and wall time; per group the mean ± std
over seeds. Only the SQL store is read (pandas over SQLAlchemy); nothing here needs MLflow. The
output is deterministic: groups sorted by their key values, runs by (seed, id), fixed decimals,
no timestamp.

Import from the module that defines a name (this package imports nothing):

- `model` — `ReportSpec`, the `Column`/`Group`/`Report` records, config-key names and aliases;
- `build` — selection, grouping, the per-run numbers, notes, `build_report`;
- `render` — number formats, markdown tables and page, CSV, JSON;
- `search` — the search section of a report (Optuna study, best trial, importances);
- `plots` — the figures (matplotlib, Agg).

They import downward only: model <- build, model <- render, render/build <- plots.
"""
