"""The SQL results store: experiments, runs, per-round metrics, checkpoints, evaluations, sweep-trial claims.

The source of truth for `fedcli report` (docs/architecture.md, "Tracking"). Import from the module
that defines a name (this package imports nothing):

- `sql_store` — `SqlStore`, the store (its docstring describes SQLite's WAL set-up, leases and retries),
  one class in three parts: `session` (`StoreSession`: opening a store, its transactions, retries and
  lease checks), `writes` (`RunWrites`: starting, ending and resuming runs, sweep-trial claims, run fields
  and tags, the metric/checkpoint/evaluation writes), `queries` (`RunQueries`: the run and frame reads);
- `engine` — SQLite/PostgreSQL connection settings, the SQLite lock holder;
- `records` — `RunRecord`, `Claim`, `where` filters;
- `protocol` — `RunStore`, what a run's process needs of the store (the engine and `Tracker` are typed
  with it; `SqlStore` satisfies it);
- `liveness` — whether a run's or a claim's process is alive;
- `schema` — the tables, their set-up and upgrade, secrets masking;
- `common` — constants, canonical JSON and hashes (`canonical_json`, `config_hash`),
  `default_store_url`, durations from the environment, `RunTakenOver`, `StoreUnavailable`.

Imports go one way: common <- schema <- liveness <- records/engine <- session <- writes/queries <- sql_store.
"""
