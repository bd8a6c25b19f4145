"""MLflow: the copy of the SQL store that `fedcli ui` shows, kept by a low-priority mirror process.

Import from the module that defines a name (this package imports nothing; importing `sink` or
`model` imports MLflow, the others import it only where they use it):

- `sink` — `MlflowSink` (explicit-client MLflow, asynchronous metric batches), `default_tracking_uri`;
- `mirror` — the mirror process (`python -m fedcli.tracking.mlflow.mirror`): brings one run's
  MLflow copy in line with the store; its docstring says why it is a process;
- `lifeline` — both mirror processes' own life: URLs from stdin, nice 19, a bounded life once the
  process that started them is gone (`watch_parent`), a fast exit;
- `handle` — the training process's side of the mirror (`MirrorHandle`: spawn, start, check, finish);
- `checks` — a tracking URI's checks before anything is written (`preflight`), MLflow's schema
  lock, a run's MLflow params;
- `sweep_mirror` — a sweep's one mirror process (`SweepMirror`,
  `python -m fedcli.tracking.mlflow.sweep_mirror`), which also opens the sweep's MLflow parent run
  from the tags the sweep hands it;
- `model` — a run's logged MLflow model (a pyfunc "model from code" that loads through
  `fedcli.tracking.served`);
- `view` — the saved runs-table view `fedcli ui` opens on.
"""
