"""A catalog of user mistakes across every command, run through the real CLI.

Each mistake runs in a fresh temporary working directory (`--root` inside it) and must:
exit with code 2, print exactly one non-empty line on stderr starting with "error:" and
naming the problem, print nothing on stdout, show no traceback, and leave the directory
exactly as it was (every path, size and mtime; for a copied pre-existing store also its
bytes and its SQL content). A few run as a real `python -m fedcli` process too.

Click's own usage errors (bad option values, unknown options and commands, missing files
of `exists=True` options) print Typer's multi-line usage box until fedcli/cli/main.py builds
the app with `cls=OneLineUsageErrors`; those cases are `xfail(strict=True, raises=PendingLead)`.
Their exit code, message and empty stdout are still hard checks: only the line count may
fail, and the strict xfail turns into a failure (remove the marker) once main.py is wired.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedcli.cli.main import app

ROOT = "runs"  # --root, relative to the case's working directory
STORE = "trained/fedcli.db"  # the copied pre-existing store, relative to the working directory
PARTITION = "trained/p.json"  # a valid lsq partition (iid, 5 clients) beside it


class PendingLead(AssertionError):
    """The error is right, but it is not one 'error:' line or something was written (lead's files)."""


@dataclass(frozen=True)
class Mistake:
    """One user mistake: the argv ({run} and {cwd} filled in), a substring of the error line,
    files to create first, and whether the trained store is copied in (to ./trained)."""

    args: tuple[str, ...]
    needle: str
    make: Callable[[Path], None] | None = None
    store: bool = False
    patch: str | None = None  # "enospc": os.replace fails (a full disk); "eacces": no file can be created
    # (tests run as root here, where chmod does not stop writes); "full" / "readonly": ./disk is a real
    # tmpfs that is full / mounted read-only (skipped where mounting is not allowed)
    marks: tuple = field(default=())
    env: tuple[tuple[str, str], ...] = ()  # environment variables set for the command


# ----------------------------------------------------------------------------- file makers


def text(name: str, body: str) -> Callable[[Path], None]:
    return lambda d: (d / name).write_text(body)


def npz(name: str = "d.npz", **arrays: np.ndarray) -> Callable[[Path], None]:
    return lambda d: np.savez(d / name, **arrays)


def edited_partition(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        doc = json.loads((d / PARTITION).read_text())
        edit(doc)
        (d / "bad.json").write_text(json.dumps(doc))

    return make


X10 = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32)
Y10 = np.arange(10) % 2
X_NAN = X10.copy()
X_NAN[3, 1] = np.nan
NOT_A_DIR = text("afile", "x")  # a regular file where a folder is expected


def train(*args: str) -> tuple[str, ...]:
    return ("train", *args, "--root", ROOT)


def byo(file: str, *args: str) -> tuple[str, ...]:
    """Train on your own data with a scheme that needs no client column (the file's checks come first)."""
    return train("--data", file, "--scheme", "iid", "--clients", "2", "--no-mlflow", *args)


def sweep(*args: str) -> tuple[str, ...]:
    return ("sweep", *args, "--root", ROOT)


# ----------------------------------------------------------------------------- the catalog

M = Mistake
BIG = "12345678901234567890"  # 20 digits: past every integer column (SQLite's 2**63, PostgreSQL's 2**31)
SPEC = "experiment: e\nbase: {task: lsq, rounds: 1}\n"  # a valid start for the sweep specs below
GRID_1000x1000 = SPEC + "grid: {hp.x: [%s], train.rounds: [%s]}\n" % (  # noqa: UP031 - two long lists
    ",".join(map(str, range(1000))),
    ",".join(map(str, range(1, 1001))),
)

# issue 23: numbers the stores cannot keep (inf, NaN, 20 digits, sizes that allocate terabytes), names
# and URIs that one store takes and another refuses, sweep specs of the wrong shape. Each was a
# traceback, a `failed` run, a silent no-op or a hang before; docs/architecture.md §8 states the limits.
LIMITS: dict[str, Mistake] = {
    "train-seed-2e63": M(
        train("--task", "lsq", "--seed", "9223372036854775808"), "seed must be <= 2147483647"
    ),
    "train-seed-2e31": M(train("--task", "lsq", "--seed", "2147483648"), "seed must be <= 2147483647"),
    "config-seed-20-digits": M(
        train("--config", "c.yaml"), "seed must be <= 2147483647", text("c.yaml", f"seed: {BIG}\n")
    ),
    "train-client-lr-inf": M(
        train("--task", "lsq", "--client-lr", "inf"), "train.client_lr must be a finite number"
    ),
    "train-client-lr-nan": M(
        train("--task", "lsq", "--client-lr", "nan"), "train.client_lr must be a finite number"
    ),
    "train-server-lr-inf": M(
        train("--task", "lsq", "--server-lr", "inf"), "train.server_lr must be a finite number"
    ),
    "train-client-momentum-inf": M(
        train("--task", "lsq", "--client-momentum", "inf"), "train.client_momentum must be a finite number"
    ),
    "train-server-momentum-neg-inf": M(
        train("--task", "lsq", "--server-momentum", "-inf"), "train.server_momentum must be a finite number"
    ),
    "config-client-lr-inf-text": M(
        train("--config", "c.yaml"),
        "train.client_lr must be a finite number",
        text("c.yaml", "train: {client_lr: '-inf'}\n"),
    ),
    "config-server-beta1-nan": M(
        train("--config", "c.yaml"),
        "train.server_beta1 must be a finite number",
        text("c.yaml", "train: {server_beta1: .nan}\n"),
    ),
    "train-sigma-inf": M(
        train("--task", "lsq", "--scheme", "quantity", "--clients", "5", "--sigma", "inf"),
        "partition.sigma must be a finite number",
    ),
    "train-sigma-overflow": M(
        train("--task", "lsq", "--scheme", "quantity", "--clients", "5", "--sigma", "1e308", "--no-mlflow"),
        "partition.sigma=1e+308 draws client sizes too large",
    ),
    "train-alpha-inf": M(
        train("--task", "synthetic-iid", "--scheme", "dirichlet", "--clients", "5", "--alpha", "inf"),
        "partition.alpha must be a finite number",
    ),
    "train-alpha-1e300": M(
        train("--task", "synthetic-iid", "--scheme", "dirichlet", "--clients", "5", "--alpha", "1e300"),
        "partition.alpha must be <= 1e+06",
    ),
    "train-size-alpha-nan": M(
        train(
            "--task",
            "synthetic-iid",
            "--scheme",
            "two-level",
            "--clients",
            "5",
            "--alpha",
            "0.5",
            "--size-alpha",
            "nan",
        ),
        "partition.size_alpha must be a finite number",
    ),
    "train-hp-inf": M(train("--algo", "fedprox", "--hp", "mu=inf"), "hp.mu must be a finite number"),
    "train-hp-nan": M(train("--algo", "fedprox", "--hp", "mu=.nan"), "hp.mu must be a finite number"),
    "train-hp-20-digits": M(
        train("--algo", "fedpa", "--hp", f"burn_in_rounds={BIG}"),
        "hp.burn_in_rounds must be at most 2147483647",
    ),
    "train-batch-size-20-digits": M(
        train("--task", "lsq", "--batch-size", BIG), "train.batch_size must be at most"
    ),
    "train-batch-size-1e9": M(
        train("--task", "lsq", "--batch-size", "1000000000", "--no-mlflow"),
        "more than the limit of 268,435,456",
    ),
    "train-local-epochs-1e6": M(
        train("--task", "lsq", "--local-epochs", "1000000", "--no-mlflow"),
        "more than the limit of 268,435,456",
    ),
    "train-rounds-2e31": M(
        train("--task", "lsq", "--rounds", "2147483648"), "train.rounds must be at most 2147483647"
    ),
    "train-rounds-20-digits": M(
        train("--task", "lsq", "--rounds", BIG), "train.rounds must be at most 2147483647"
    ),
    "train-eval-every-20-digits": M(
        train("--task", "lsq", "--eval-every", BIG), "train.eval_every must be at most"
    ),
    "train-clients-20-digits": M(
        train("--task", "lsq", "--scheme", "iid", "--clients", BIG), "partition.num_clients must be at most"
    ),
    "train-threads-2e31": M(
        train("--task", "lsq", "--threads", "2147483647"), "train.threads must be <= 1024"
    ),
    "train-workers-5000": M(train("--task", "lsq", "--workers", "5000"), "train.workers must be <= 1024"),
    "data-labels-1e12": M(
        byo("d.npz", "--clients-per-round", "2"),
        "class labels y must be < 100000",
        npz(x=X10, y=np.where(Y10 == 1, 10**12, 0)),
    ),
    "data-test-labels-1e12": M(
        byo("d.npz", "--clients-per-round", "2"),
        "class labels y_test must be < 100000",
        npz(x=X10, y=Y10, x_test=X10[:2], y_test=np.array([0, 10**12])),
    ),
    "partition-sigma-inf": M(
        (
            "partition",
            "--dataset",
            "lsq",
            "--scheme",
            "quantity",
            "--clients",
            "5",
            "--sigma",
            "inf",
            "--out",
            "p.json",
        ),
        "partition.sigma must be a finite number",
    ),
    "partition-alpha-inf": M(
        (
            "partition",
            "--dataset",
            "synthetic-iid",
            "--scheme",
            "dirichlet",
            "--clients",
            "5",
            "--alpha",
            "inf",
            "--out",
            "p.json",
        ),
        "partition.alpha must be a finite number",
    ),
    "partition-seed-20-digits": M(
        (
            "partition",
            "--dataset",
            "lsq",
            "--scheme",
            "iid",
            "--clients",
            "5",
            "--seed",
            BIG,
            "--out",
            "p.json",
        ),
        "partition.seed must be at most 2147483647",
    ),
    # names: one limit for SQLite and PostgreSQL (and MLflow), checked before anything is written
    "train-experiment-300-chars": M(
        train("--task", "lsq", "--experiment", "e" * 300), "tracking.experiment must be at most 200 bytes"
    ),
    "train-experiment-unicode-240-bytes": M(
        train("--task", "lsq", "--experiment", "实验" * 40), "tracking.experiment must be at most 200 bytes"
    ),
    "train-experiment-empty": M(
        train("--task", "lsq", "--experiment", ""), "tracking.experiment must be a non-empty"
    ),
    "train-experiment-blank": M(
        train("--task", "lsq", "--experiment", "  "), "tracking.experiment must be a non-empty"
    ),
    "train-experiment-newline": M(
        train("--task", "lsq", "--experiment", "a\nb"), "must not hold control characters"
    ),
    "train-run-name-empty": M(
        train("--task", "lsq", "--run-name", ""), "tracking.run_name must be a non-empty"
    ),
    "config-run-name-nul": M(
        train("--config", "c.yaml"),
        "tracking.run_name must not hold control characters",
        text("c.yaml", 'tracking: {run_name: "a\\0b"}\n'),
    ),
    "train-store-empty": M(
        train("--task", "lsq", "--store", ""), "tracking.store must be a SQLAlchemy URL; got ''"
    ),
    "train-tracking-uri-empty": M(
        train("--task", "lsq", "--tracking-uri", ""), "tracking.tracking_uri must be an"
    ),
    "train-tracking-uri-garbage": M(
        train("--task", "lsq", "--tracking-uri", "::nope::"),
        "tracking.tracking_uri must be an MLflow store URI",
    ),
    "train-mlflow-env-garbage": M(
        train("--task", "lsq"),
        "got '::nope::' (from MLFLOW_TRACKING_URI)",
        env=(("MLFLOW_TRACKING_URI", "::nope::"),),
    ),
    "train-tracking-uri-password-masked": M(
        train("--task", "lsq", "--tracking-uri", "postgres://u:hunter2@h/db"), "'postgres://u:***@h/db'"
    ),
    # sweep specs of the wrong shape, checked before anything is written (a dry run included)
    "sweep-seeds-int": M(
        sweep("s.yaml", "--dry-run"),
        "seeds must be a non-empty list of integer seeds",
        text("s.yaml", SPEC + "seeds: 3\n"),
    ),
    "sweep-seeds-text": M(
        sweep("s.yaml"), "seeds must be a non-empty list", text("s.yaml", SPEC + "seeds: [a, b]\n")
    ),
    "sweep-seeds-repeated": M(
        sweep("s.yaml"), "seeds must not repeat", text("s.yaml", SPEC + "seeds: [0, 0]\n")
    ),
    "sweep-seed-20-digits": M(
        sweep("s.yaml"), "seed must be <= 2147483647", text("s.yaml", SPEC + f"seeds: [{BIG}]\n")
    ),
    "sweep-base-list": M(
        sweep("s.yaml"), "base must be a mapping", text("s.yaml", "experiment: e\nbase: [task, lsq]\n")
    ),
    "sweep-grid-list": M(
        sweep("s.yaml"), "grid must be a mapping", text("s.yaml", SPEC + "grid: [algo, fedavg]\n")
    ),
    "sweep-grid-values-empty": M(
        sweep("s.yaml"),
        "grid key algo must have at least one value",
        text("s.yaml", SPEC + "grid: {algo: []}\n"),
    ),
    "sweep-grid-hp-nosuch": M(
        sweep("s.yaml", "--dry-run"),
        "sweep key hp.nosuch is a hyperparameter of none of the "
        "sweep's algorithms (fedavg); valid: fedavg: none.",
        text("s.yaml", SPEC + "grid: {hp.nosuch: [1, 2]}\n"),
    ),
    "sweep-base-hp-typo": M(
        sweep("s.yaml"),
        "sweep key hp.rhoo is a hyperparameter of none of the sweep's algorithms "
        "(fedpa) (did you mean 'hp.rho'?)",
        text("s.yaml", "experiment: e\nbase: {task: lsq, algo: fedpa, hp.rhoo: 0.1}\n"),
    ),
    "sweep-experiment-not-text": M(
        sweep("s.yaml"), "experiment must be a name", text("s.yaml", "experiment: 5\n")
    ),
    "sweep-experiment-300-chars": M(
        sweep("s.yaml"), "experiment must be at most 200 bytes", text("s.yaml", f"experiment: {'e' * 300}\n")
    ),
    "sweep-trial-name-too-long": M(
        sweep("s.yaml"),
        "(its run name) must be at most 200 bytes",
        text("s.yaml", SPEC + f"variants: [{{label: {'v' * 250}}}]\n"),
    ),
    "sweep-report-thresholds-text": M(
        sweep("s.yaml", "--dry-run"),
        "report.thresholds must be finite numbers",
        text("s.yaml", SPEC + "report: {thresholds: [high]}\n"),
    ),
    "sweep-report-at-zero": M(
        sweep("s.yaml"), "report.at must be round numbers >= 1", text("s.yaml", SPEC + "report: {at: [0]}\n")
    ),
    "sweep-report-window-text": M(
        sweep("s.yaml"),
        "report.window must be an integer number of rounds >= 1",
        text("s.yaml", SPEC + "report: {window: ten}\n"),
    ),
    "sweep-report-metric-empty": M(
        sweep("s.yaml"),
        "report.metric must be a metric name",
        text("s.yaml", SPEC + "report: {metric: ''}\n"),
    ),
    "sweep-report-metric-not-logged": M(
        sweep("s.yaml", "--dry-run"),
        "report.metric 'accuracy' is not logged by the sweep's tasks (regression)",
        text("s.yaml", SPEC + "report: {metric: accuracy}\n"),
    ),
    "sweep-report-group-by-unknown": M(
        sweep("s.yaml"), "unknown config key 'nosuch'", text("s.yaml", SPEC + "report: {group_by: nosuch}\n")
    ),
    "sweep-grid-1000x1000": M(
        sweep("s.yaml", "--dry-run"),
        "expands to 1,000,000 trials (variants x grid values x "
        "seeds: 1 x 1000 x 1000 x 1), more than max_trials = 1000",
        text("s.yaml", GRID_1000x1000),
    ),
    "sweep-max-trials-zero": M(
        sweep("s.yaml"), "max_trials must be an integer >= 1", text("s.yaml", SPEC + "max_trials: 0\n")
    ),
    "sweep-smoke-not-a-mapping": M(
        sweep("s.yaml", "--smoke"), "smoke must be a mapping", text("s.yaml", SPEC + "smoke: 5\n")
    ),
    "sweep-mlflow-env-garbage": M(
        sweep("--recipe", "fedopt-lsq", "--dry-run"),
        "(from MLFLOW_TRACKING_URI)",
        env=(("MLFLOW_TRACKING_URI", "::nope::"),),
    ),
}
CASES: dict[str, Mistake] = {
    # --- train: names, values, hyperparameters
    "train-unknown-algo": M(train("--algo", "fedpx"), "unknown algorithm 'fedpx' (did you mean 'fedprox'?)"),
    "train-unknown-task": M(train("--task", "lsqq"), "unknown task 'lsqq' (did you mean 'lsq'?)"),
    "train-model-not-of-task": M(train("--task", "lsq", "--model", "cnn"), "data.model must be one of"),
    "train-hp-not-key-value": M(train("--hp", "rho"), "--hp must be KEY=VALUE"),
    "train-hp-out-of-range": M(train("--algo", "fedpa", "--hp", "rho=-1"), "hp.rho must be >= 0"),
    "train-hp-unknown-key": M(
        train("--algo", "fedpa", "--hp", "rhoo=0.1"), "unknown hyperparameter 'hp.rhoo'"
    ),
    "train-hp-wrong-type": M(train("--algo", "fedpa", "--hp", "rho=abc"), "hp.rho must be"),
    "train-device-unknown": M(train("--task", "lsq", "--device", "tpu"), "train.device must be auto, cpu"),
    "train-client-lr-negative": M(train("--task", "lsq", "--client-lr", "-1"), "train.client_lr must be > 0"),
    "train-server-momentum-1.5": M(
        train("--task", "lsq", "--server-momentum", "1.5"), "train.server_momentum"
    ),
    "train-cohort-larger-than-clients": M(
        train("--task", "lsq", "--clients-per-round", "100000"), "train.clients_per_round=100000 exceeds"
    ),
    "train-rounds-zero": M(train("--rounds", "0"), "'--rounds'"),
    "train-rounds-not-int": M(train("--rounds", "abc"), "'--rounds'"),
    "train-scheme-unknown": M(train("--scheme", "dirichlett"), "'--scheme'"),
    "train-option-typo": M(train("--roundz", "3"), "--roundz"),
    "train-seed-negative": M(train("--seed", "-1"), "'--seed'"),
    "train-executor-fused-on-lsq": M(
        train("--task", "lsq", "--executor", "fused", "--no-mlflow"), "--executor fused"
    ),
    "train-max-clients-ignored": M(
        train("--task", "lsq", "--max-clients", "5"), "data.max_clients is not used by task 'lsq'"
    ),
    # --- train: config files
    "config-missing": M(train("--config", "nope.yaml"), "nope.yaml"),
    "config-malformed-yaml": M(
        train("--config", "c.yaml"), "is not valid YAML", text("c.yaml", "train: [rounds: 3\n")
    ),
    "config-unknown-key": M(
        train("--config", "c.yaml"),
        "unknown config key 'train.roundz' (did you mean 'rounds'?)",
        text("c.yaml", "train: {roundz: 3}\n"),
    ),
    "config-unknown-section": M(
        train("--config", "c.yaml"), "unknown config section 'trian'", text("c.yaml", "trian: {rounds: 3}\n")
    ),
    "config-wrong-type": M(
        train("--config", "c.yaml"),
        "train.rounds must be int; got 'ten'",
        text("c.yaml", "train: {rounds: ten}\n"),
    ),
    "config-not-a-mapping": M(
        train("--config", "c.yaml"), "must be a mapping", text("c.yaml", "- train\n- data\n")
    ),
    "config-seed-negative": M(
        train("--config", "c.yaml"), "seed must be an integer >= 0", text("c.yaml", "seed: -3\n")
    ),
    "config-executor-unknown": M(
        train("--config", "c.yaml"),
        "train.executor must be one of",
        text("c.yaml", "train: {executor: warp}\n"),
    ),
    "config-precision-unknown": M(
        train("--config", "c.yaml"),
        "train.precision must be one of",
        text("c.yaml", "train: {precision: fp8}\n"),
    ),
    "config-section-not-a-mapping": M(
        train("--config", "c.yaml"), "config section 'train' must be a mapping", text("c.yaml", "train: 5\n")
    ),
    "config-hp-not-a-mapping": M(
        train("--config", "c.yaml"),
        "algorithm.hp must be a mapping",
        text("c.yaml", "algorithm: {name: fedpa, hp: [1, 2]}\n"),
    ),
    "config-not-utf8": M(
        train("--config", "c.yaml"),
        "is not valid YAML",
        lambda d: (d / "c.yaml").write_bytes(b"\x1f\x8b\x08\x00\xff\xfe"),
    ),
    "config-min-size-unused": M(
        train("--config", "c.yaml"),
        "partition.min_size is not used by scheme 'iid'",
        text("c.yaml", "data: {task: lsq}\npartition: {scheme: iid, num_clients: 5, min_size: 50}\n"),
    ),
    "train-hp-given-twice": M(
        train("--algo", "fedpa", "--hp", "rho=1", "--hp", "rho=2"), "--hp rho must be given once"
    ),
    # --- train: partitions
    "partition-file-and-scheme": M(
        train("--task", "lsq", "--partition", PARTITION, "--scheme", "iid"), "Drop --scheme", store=True
    ),
    "partition-file-and-clients": M(
        train("--task", "lsq", "--partition", PARTITION, "--clients", "5"),
        "partition.num_clients=5",
        store=True,
    ),
    "partition-file-and-alpha": M(
        train("--task", "lsq", "--partition", PARTITION, "--alpha", "0.1"), "Drop --alpha", store=True
    ),
    "partition-file-not-json": M(
        train("--task", "lsq", "--partition", "bad.json"),
        "is not valid JSON",
        text("bad.json", '{"clients": [[0, 1]'),
    ),
    "partition-file-not-fedcli": M(
        train("--task", "lsq", "--partition", "bad.json"),
        "is not a fedcli partition file",
        text("bad.json", '{"a": 1}'),
    ),
    "partition-file-edited": M(
        train("--task", "lsq", "--partition", "bad.json"),
        "fails its content hash",
        edited_partition(lambda doc: doc["clients"][0].pop()),
        store=True,
    ),
    "partition-file-other-dataset": M(
        train("--task", "quadratic-2d", "--partition", PARTITION), "was made for dataset 'lsq'", store=True
    ),
    "scheme-alpha-negative": M(
        train("--task", "lsq", "--scheme", "dirichlet", "--clients", "5", "--alpha", "-0.5"),
        "partition.alpha must be > 0",
    ),
    "scheme-dirichlet-without-alpha": M(
        train("--task", "lsq", "--scheme", "dirichlet", "--clients", "5"), "partition.alpha must be set"
    ),
    "scheme-shards-without-count": M(
        train("--task", "lsq", "--scheme", "shards", "--clients", "5"),
        "partition.shards_per_client must be set",
    ),
    "scheme-iid-with-alpha": M(
        train("--task", "lsq", "--scheme", "iid", "--clients", "5", "--alpha", "0.5"),
        "partition.alpha is not used by scheme 'iid'",
    ),
    "scheme-iid-without-clients": M(
        train("--task", "lsq", "--scheme", "iid"), "partition.num_clients must be set"
    ),
    "scheme-more-clients-than-examples": M(
        train("--task", "lsq", "--scheme", "iid", "--clients", "100000", "--no-mlflow"), "exceeds the"
    ),
    "natural-more-clients-than-owners": M(
        train("--task", "lsq", "--clients", "50", "--no-mlflow"), "exceeds the 20 natural clients"
    ),
    # --- train: runs and stores
    "resume-unknown-run-no-store": M(train("--resume", "nosuchrun", "--no-mlflow"), "no results store at"),
    "resume-unknown-run": M(
        train("--resume", "nosuchrun", "--store", "sqlite:///{cwd}/" + STORE),
        "unknown run 'nosuchrun'",
        store=True,
    ),
    "resume-changes-algo": M(
        train("--resume", "{run}", "--algo", "fedpa", "--store", "sqlite:///{cwd}/" + STORE),
        "algorithm.name cannot change",
        store=True,
    ),
    "store-not-a-url": M(
        train("--task", "lsq", "--store", "notaurl", "--no-mlflow"), "not a valid SQLAlchemy URL"
    ),
    "store-unwritable": M(
        train("--task", "lsq", "--store", "sqlite:////proc/forbidden/x.db", "--no-mlflow"), "not writable"
    ),
    # --- train: bring your own data
    "data-wrong-suffix": M(
        train("--data", "d.txt"), "data.file must be a .npz, .csv, .parquet file", text("d.txt", "1,2\n")
    ),
    "data-missing-file": M(train("--data", "nope.npz"), "nope.npz"),
    "data-unknown-model": M(
        train("--data", "d.npz", "--model", "resnet"), "data.model must be one of linear", npz(x=X10, y=Y10)
    ),
    "data-with-task": M(
        train("--data", "d.npz", "--task", "lsq"),
        "data.task must be left unset with data.file",
        npz(x=X10, y=Y10),
    ),
    "data-with-data-dir": M(
        train("--data", "d.npz", "--data-dir", "elsewhere"), "Drop --data-dir", npz(x=X10, y=Y10)
    ),
    "data-no-features": M(byo("d.npz"), "x must have at least one feature", npz(x=np.zeros((10, 0)), y=Y10)),
    "data-npz-not-an-archive": M(byo("d.npz"), "cannot be read as .npz", text("d.npz", "hello")),
    "data-csv-header-only": M(byo("d.csv"), "must hold at least one example row", text("d.csv", "a,y\n")),
    "data-client-missing": M(
        byo("d.npz"),
        "client must name an owner for every row",
        npz(x=X10, y=Y10, client=np.where(Y10 == 0, 1.0, np.nan)),
    ),
    "data-natural-without-client": M(
        train("--data", "d.npz"), "needs a client array or column in d.npz", npz(x=X10, y=Y10)
    ),
    "data-x-y-lengths": M(byo("d.npz"), "y must have one entry per row of x", npz(x=X10, y=Y10[:8])),
    "data-client-length": M(
        byo("d.npz"), "client must have one entry per row of x", npz(x=X10, y=Y10, client=np.arange(4))
    ),
    "data-x-test-without-y-test": M(
        byo("d.npz"), "only one of x_test / y_test", npz(x=X10, y=Y10, x_test=X10)
    ),
    "data-y-strings": M(
        byo("d.npz"),
        "y must be integer class labels or float targets",
        npz(x=X10, y=np.array(["cat", "dog"] * 5)),
    ),
    "data-x-nan": M(byo("d.npz"), "x must be finite", npz(x=X_NAN, y=Y10)),
    "data-x-one-dimensional": M(byo("d.npz"), "x must be [N, features...]", npz(x=np.arange(10.0), y=Y10)),
    "data-float-labels-logreg": M(
        byo("d.npz", "--model", "logreg"),
        "--model logreg needs integer class labels",
        npz(x=X10, y=Y10 + 0.5),
    ),
    "data-y-test-float-y-int": M(
        byo("d.npz"),
        "y_test must be integer class labels",
        npz(x=X10, y=Y10, x_test=X10[:2], y_test=np.array([0.5, 1.0])),
    ),
    "data-csv-empty": M(byo("d.csv"), "cannot be read as csv", text("d.csv", "")),
    "data-csv-text-feature": M(
        byo("d.csv"), "feature columns must be numeric", text("d.csv", "a,y\nred,0\nblue,1\nred,1\n")
    ),
    "data-csv-missing-label": M(
        byo("d.csv"), "y must be finite", text("d.csv", "a,y\n1.0,0.5\n2.0,\n3.0,1.5\n4.0,2.5\n")
    ),
    # --- partition
    "partition-unknown-dataset": M(
        ("partition", "--dataset", "mnistt", "--scheme", "iid", "--clients", "5", "--out", "p.json"),
        "unknown dataset 'mnistt' (did you mean 'mnist'?)",
    ),
    "partition-missing-out": M(("partition", "--dataset", "lsq", "--scheme", "iid"), "'--out'"),
    "partition-dirichlet-without-alpha": M(
        (
            "partition",
            "--dataset",
            "synthetic-iid",
            "--scheme",
            "dirichlet",
            "--clients",
            "5",
            "--out",
            "p.json",
        ),
        "partition.alpha must be set",
    ),
    "partition-alpha-negative": M(
        (
            "partition",
            "--dataset",
            "synthetic-iid",
            "--scheme",
            "dirichlet",
            "--clients",
            "5",
            "--alpha",
            "-0.5",
            "--out",
            "p.json",
        ),
        "partition.alpha must be > 0",
    ),
    "partition-quantity-alpha-and-sigma": M(
        (
            "partition",
            "--dataset",
            "lsq",
            "--scheme",
            "quantity",
            "--clients",
            "5",
            "--alpha",
            "1",
            "--sigma",
            "1",
            "--out",
            "p.json",
        ),
        "exactly one of",
    ),
    "partition-too-many-clients": M(
        ("partition", "--dataset", "lsq", "--scheme", "iid", "--clients", "100000", "--out", "p.json"),
        "partition.num_clients=100000 exceeds",
    ),
    "partition-natural-too-many": M(
        ("partition", "--dataset", "lsq", "--scheme", "natural", "--clients", "50", "--out", "p.json"),
        "exceeds the 20 natural clients",
    ),
    "partition-labels-on-regression": M(
        (
            "partition",
            "--dataset",
            "lsq",
            "--scheme",
            "labels",
            "--clients",
            "5",
            "--labels-per-client",
            "2",
            "--out",
            "p.json",
        ),
        "needs class labels",
    ),
    "partition-min-size-zero": M(
        (
            "partition",
            "--dataset",
            "lsq",
            "--scheme",
            "iid",
            "--clients",
            "5",
            "--min-size",
            "0",
            "--out",
            "p.json",
        ),
        "'--min-size'",
    ),
    "partition-data-dir-missing": M(
        (
            "partition",
            "--dataset",
            "mnist",
            "--data-dir",
            "{cwd}/nope",
            "--scheme",
            "iid",
            "--clients",
            "5",
            "--out",
            "p.json",
        ),
        "MNIST data not found",
    ),
    "partition-min-size-unused": M(
        (
            "partition",
            "--dataset",
            "lsq",
            "--scheme",
            "iid",
            "--clients",
            "5",
            "--min-size",
            "1000",
            "--out",
            "p.json",
        ),
        "partition.min_size is not used by scheme 'iid'",
    ),
    "partition-size-alpha-unused": M(
        (
            "partition",
            "--dataset",
            "synthetic-iid",
            "--scheme",
            "dirichlet",
            "--clients",
            "5",
            "--alpha",
            "0.5",
            "--size-alpha",
            "2",
            "--out",
            "p.json",
        ),
        "partition.size_alpha is not used by scheme 'dirichlet'",
    ),
    "partition-max-clients-ignored": M(
        ("partition", "--dataset", "lsq", "--scheme", "natural", "--max-clients", "5", "--out", "p.json"),
        "data.max_clients is not used by task 'lsq'",
    ),
    "partition-out-proc": M(
        ("partition", "--dataset", "lsq", "--scheme", "iid", "--clients", "5", "--out", "/proc/x"),
        "/proc/x: not writable",
    ),
    "partition-out-directory": M(
        ("partition", "--dataset", "lsq", "--scheme", "iid", "--clients", "5", "--out", "{cwd}"),
        "which is a directory",
    ),
    "partition-out-under-a-file": M(
        ("partition", "--dataset", "lsq", "--scheme", "iid", "--clients", "5", "--out", "afile/p.json"),
        "not a directory",
        NOT_A_DIR,
    ),
    "partition-plot-proc": M(
        (
            "partition",
            "--dataset",
            "lsq",
            "--scheme",
            "iid",
            "--clients",
            "5",
            "--out",
            "p.json",
            "--plot",
            "/proc/p.png",
        ),
        "/proc/p.png: not writable",
    ),
    "partition-plot-is-out": M(
        (
            "partition",
            "--dataset",
            "lsq",
            "--scheme",
            "iid",
            "--clients",
            "5",
            "--out",
            "p.json",
            "--plot",
            "p.json",
        ),
        "--plot must differ from --out",
    ),
    "partition-disk-full": M(
        ("partition", "--dataset", "lsq", "--scheme", "iid", "--clients", "5", "--out", "p.json"),
        "no space left on device",
        patch="enospc",
    ),
    "partition-out-on-full-disk": M(
        ("partition", "--dataset", "lsq", "--scheme", "iid", "--clients", "5", "--out", "disk/p.json"),
        "no space left on device: disk/p.json",
        patch="full",
    ),
    "partition-out-on-read-only-disk": M(
        ("partition", "--dataset", "lsq", "--scheme", "iid", "--clients", "5", "--out", "disk/p.json"),
        "disk/p.json: not writable (Read-only file system)",
        patch="readonly",
    ),
    "partition-plot-on-full-disk": M(
        (
            "partition",
            "--dataset",
            "lsq",
            "--scheme",
            "iid",
            "--clients",
            "5",
            "--out",
            "p.json",
            "--plot",
            "disk/p.png",
        ),
        "no space left on device",
        patch="full",
    ),
    # --- sweep
    "sweep-no-spec": M(sweep(), "needs a SPEC.yaml or --recipe NAME"),
    "sweep-unknown-recipe": M(
        sweep("--recipe", "fedopt-lsqq"), "unknown recipe 'fedopt-lsqq' (did you mean 'fedopt-lsq'?)"
    ),
    "sweep-spec-missing": M(sweep("nope.yaml"), "nope.yaml"),
    "sweep-spec-malformed": M(sweep("s.yaml"), "is not valid YAML", text("s.yaml", "experiment: [x\n")),
    "sweep-spec-unknown-key": M(
        sweep("s.yaml"),
        "unknown sweep key 'gird' (did you mean 'grid'?)",
        text("s.yaml", "experiment: e\ngird: {algo: [fedavg]}\n"),
    ),
    "sweep-spec-no-experiment": M(
        sweep("s.yaml"), "needs `experiment: NAME`", text("s.yaml", "grid: {algo: [fedavg]}\n")
    ),
    "sweep-grid-unknown-key": M(
        sweep("s.yaml"),
        "unknown sweep key 'roundz'",
        text("s.yaml", "experiment: e\nbase: {task: lsq}\ngrid: {roundz: [1, 2]}\n"),
    ),
    "sweep-grid-unknown-algo": M(
        sweep("s.yaml"),
        "unknown algorithm 'fedpx'",
        text("s.yaml", "experiment: e\nbase: {task: lsq}\ngrid: {algo: [fedavg, fedpx]}\n"),
    ),
    "sweep-base-rounds-zero": M(
        sweep("s.yaml"),
        "train.rounds must be >= 1",
        text("s.yaml", "experiment: e\nbase: {task: lsq, rounds: 0}\n"),
    ),
    "sweep-spec-not-a-mapping": M(sweep("s.yaml"), "must be a mapping", text("s.yaml", "- fedavg\n")),
    "sweep-address-without-ray": M(
        sweep("--recipe", "fedopt-lsq", "--address", "auto"), "--address applies to --backend ray"
    ),
    "sweep-workers-zero": M(sweep("--recipe", "fedopt-lsq", "--workers", "0"), "'--workers'"),
    # --- evaluate
    "evaluate-no-store": M(("evaluate", "nosuchrun"), "tracking.store must be an existing results store"),
    "evaluate-unknown-run": M(
        ("evaluate", "nosuchrun", "--store", "sqlite:///{cwd}/" + STORE),
        "unknown run 'nosuchrun'",
        store=True,
    ),
    "evaluate-missing-checkpoint": M(
        ("evaluate", "{run}", "--checkpoint", "7", "--store", "sqlite:///{cwd}/" + STORE),
        "has no checkpoint of round 7",
        store=True,
    ),
    "evaluate-unknown-task": M(
        ("evaluate", "{run}", "--task", "lsqq", "--store", "sqlite:///{cwd}/" + STORE),
        "unknown task 'lsqq'",
        store=True,
    ),
    "evaluate-task-model-mismatch": M(
        ("evaluate", "{run}", "--task", "mnist", "--store", "sqlite:///{cwd}/" + STORE),
        "data.model must be one of",
        store=True,
    ),
    "evaluate-device-unknown": M(
        ("evaluate", "{run}", "--device", "tpu", "--store", "sqlite:///{cwd}/" + STORE),
        "train.device must be",
        store=True,
    ),
    "evaluate-ensemble-without-posterior": M(
        ("evaluate", "{run}", "--predictive", "ensemble", "--store", "sqlite:///{cwd}/" + STORE),
        "needs a posterior",
        store=True,
    ),
    "evaluate-store-is-directory": M(
        ("evaluate", "{run}", "--store", "sqlite:///{cwd}/trained"), "(a directory)", store=True
    ),
    "evaluate-samples-without-ensemble": M(
        ("evaluate", "{run}", "--samples", "32", "--store", "sqlite:///{cwd}/" + STORE),
        "--samples applies to --predictive ensemble",
        store=True,
    ),
    "evaluate-samples-zero": M(("evaluate", "{run}", "--samples", "0"), "'--samples'"),
    # --- report
    "report-no-store": M(("report",), "tracking.store must be an existing results store"),
    "report-output-proc": M(
        ("report", "--store", "sqlite:///{cwd}/" + STORE, "--output", "/proc/x"),
        "/proc/x: not writable",
        store=True,
    ),
    "report-output-directory": M(
        ("report", "--store", "sqlite:///{cwd}/" + STORE, "--output", "{cwd}/trained"),
        "which is a directory",
        store=True,
    ),
    "report-output-under-a-file": M(("report", "--output", "afile/r.md"), "not a directory", NOT_A_DIR),
    "report-disk-full": M(
        ("report", "--store", "sqlite:///{cwd}/" + STORE, "--format", "json", "--output", "r.json"),
        "no space left on device",
        store=True,
        patch="enospc",
    ),
    "report-output-permission-denied": M(
        ("report", "--output", "r.md"), "permission denied: r.md", patch="eacces"
    ),
    "report-output-on-full-disk": M(
        ("report", "--store", "sqlite:///{cwd}/" + STORE, "--output", "disk/r.md"),
        "no space left on device: disk/r.md",
        store=True,
        patch="full",
    ),
    "report-new-folder-on-full-disk": M(
        ("report", "--store", "sqlite:///{cwd}/" + STORE, "--format", "csv", "--output", "disk/sub/r.csv"),
        "no space left on device",
        store=True,
        patch="full",
    ),
    "report-thresholds-not-numbers": M(
        ("report", "--thresholds", "high"), "--thresholds must be comma-separated numbers"
    ),
    "report-thresholds-nan": M(("report", "--thresholds", "0.5,nan"), "--thresholds must be finite numbers"),
    "report-metric-empty": M(("report", "--metric", ""), "--metric must be a metric name"),
    "report-runs-empty": M(("report", "--runs", ","), "--runs must name at least one run"),
    "report-group-by-empty": M(
        ("report", "--group-by", " , "), "--group-by must name at least one config key"
    ),
    "report-at-zero": M(("report", "--at", "0"), "--at rounds must be >= 1"),
    "report-at-fraction": M(("report", "--at", "1.5"), "--at must be comma-separated integers"),
    "report-where-not-key-value": M(("report", "--where", "algo"), "--where must be KEY=VALUE"),
    "report-where-unknown-key": M(
        ("report", "--where", "algoo=fedavg", "--store", "sqlite:///{cwd}/" + STORE),
        "unknown config key 'algoo' (did you mean 'algo'?)",
        store=True,
    ),
    "report-group-by-unknown-key": M(
        ("report", "--group-by", "nosuch", "--store", "sqlite:///{cwd}/" + STORE),
        "unknown config key 'nosuch'",
        store=True,
    ),
    "report-unknown-run": M(
        ("report", "--runs", "nosuchrun", "--store", "sqlite:///{cwd}/" + STORE),
        "unknown run 'nosuchrun'",
        store=True,
    ),
    "report-unknown-experiment": M(
        ("report", "--experiment", "nosuch", "--store", "sqlite:///{cwd}/" + STORE),
        "unknown experiment 'nosuch'",
        store=True,
    ),
    "report-metric-not-logged": M(
        ("report", "--metric", "accuracy", "--store", "sqlite:///{cwd}/" + STORE),
        "is not logged by the selected runs",
        store=True,
    ),
    "report-format-unknown": M(("report", "--format", "xml"), "'--format'"),
    "report-window-zero": M(("report", "--window", "0"), "'--window'"),
    # --- list
    "list-unknown-what": M(("list", "runz"), "runz"),
    "list-algos-with-experiment": M(
        ("list", "algos", "--experiment", "demo"), "--experiment applies to `fedcli list runs` only"
    ),
    "list-store-missing": M(
        ("list", "runs", "--store", "sqlite:///{cwd}/missing.db"),
        "tracking.store must be an existing results store",
    ),
    "list-store-in-proc": M(
        ("list", "runs", "--store", "sqlite:////proc/x/fedcli.db"),
        "tracking.store must be an existing results store",
    ),
    "list-store-not-a-url": M(("list", "runs", "--store", "notaurl"), "not a valid SQLAlchemy URL"),
    "list-unknown-experiment": M(
        ("list", "runs", "--experiment", "nosuch", "--store", "sqlite:///{cwd}/" + STORE),
        "unknown experiment 'nosuch'",
        store=True,
    ),
    # --- ui
    "ui-port-zero": M(("ui", "--port", "0", "--root", ROOT), "'--port'"),
    "ui-tracking-uri-is-server": M(
        ("ui", "--tracking-uri", "http://127.0.0.1:5000", "--root", ROOT), "is already a server"
    ),
    "ui-no-mlflow-store": M(("ui", "--print-only", "--root", ROOT), "no MLflow store at"),
    "ui-store-missing": M(
        ("ui", "--print-only", "--store", "sqlite:///{cwd}/missing.db", "--root", ROOT),
        "tracking.store must be an existing results store",
    ),
    "ui-store-without-mlflow-runs": M(
        ("ui", "--print-only", "--store", "sqlite:///{cwd}/" + STORE, "--root", ROOT),
        "no MLflow store at",
        store=True,
    ),
    # --- the app
    "unknown-command": M(("trian",), "trian"),
    **LIMITS,
}

# Also run as a real process: stdout/stderr of the installed entry point, not CliRunner's capture.
SUBPROCESS_CASES = (
    "data-x-y-lengths",
    "partition-out-proc",
    "report-output-proc",  # tracebacks before
    "train-seed-2e63",
    "train-mlflow-env-garbage",
    "data-labels-1e12",
    "sweep-grid-1000x1000",
)


# ----------------------------------------------------------------------------- fixtures and checks


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A folder with a store holding one finished 1-round lsq run, and a valid lsq partition file.

    The run trains in this process; the store is then copied with SQLite's backup API, so the
    copy is one self-contained file (no -wal beside it) that no open connection touches.
    """
    folder = tmp_path_factory.mktemp("trained")
    source = folder / "train-root"
    result = CliRunner().invoke(
        app,
        [
            "-q",
            "train",
            "--task",
            "lsq",
            "--rounds",
            "1",
            "--clients-per-round",
            "2",
            "--no-mlflow",
            "--root",
            str(source),
            "--store",
            f"sqlite:///{source / 'a.db'}",
        ],
    )
    assert result.exit_code == 0, result.output
    run_id = result.stdout.strip().splitlines()[-1]
    with sqlite3.connect(source / "a.db") as src, sqlite3.connect(folder / "fedcli.db") as dst:
        src.backup(dst)
    src.close()
    dst.close()
    result = CliRunner().invoke(
        app,
        [
            "partition",
            "--dataset",
            "lsq",
            "--scheme",
            "iid",
            "--clients",
            "5",
            "--out",
            str(folder / "p.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    return folder, run_id


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.delenv("FEDCLI_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    yield tmp_path


def prepare(case: Mistake, cwd: Path, trained: tuple[Path, str]) -> list[str]:
    folder, run_id = trained
    if case.store:
        shutil.copytree(
            folder, cwd / "trained", ignore=shutil.ignore_patterns("train-root", "*.db-wal", "*.db-shm")
        )
    if case.make is not None:
        case.make(cwd)
    return [a.replace("{cwd}", str(cwd)).replace("{run}", run_id) for a in case.args]


def snapshot(cwd: Path) -> dict[str, tuple[int, int] | str]:
    """Every path under cwd: (size, mtime) for files, 'dir' for folders (their mtime moves with probes).
    SQLite's -wal/-shm beside a pre-existing store are left out (its content is compared instead)."""
    pre_existing = {p.name for p in cwd.rglob("*.db")}
    out: dict[str, tuple[int, int] | str] = {}
    for path in sorted(cwd.rglob("*")):
        if path.name.endswith(("-wal", "-shm")) and path.name[:-4] in pre_existing:
            continue
        stat = path.stat()
        out[str(path.relative_to(cwd))] = "dir" if path.is_dir() else (stat.st_size, stat.st_mtime_ns)
    return out


def store_content(cwd: Path) -> tuple[bytes, str] | None:
    path = cwd / STORE
    if not path.exists():
        return None
    with sqlite3.connect(path) as conn:
        dump = "\n".join(conn.iterdump())
    conn.close()
    return path.read_bytes(), dump


def check(
    case: Mistake,
    code: int,
    stdout: str,
    stderr: str,
    before: dict,
    after: dict,
    store_before: object,
    store_after: object,
) -> None:
    assert "Traceback" not in stdout + stderr, stderr
    assert code == 2, f"exit code {code}; stderr: {stderr!r}"
    assert case.needle in stderr, f"{case.needle!r} not in stderr {stderr!r}"
    assert stdout == "", f"stdout must be empty; got {stdout!r}"
    lines = [line for line in stderr.splitlines() if line.strip()]
    if len(lines) != 1 or not lines[0].startswith("error:"):
        raise PendingLead(f"stderr must be one 'error:' line; got {len(lines)} lines: {stderr!r}")
    changed = sorted(set(before) ^ set(after)) + sorted(
        k for k in before if k in after and before[k] != after[k]
    )
    if changed:
        raise PendingLead(f"a rejected command changed the working directory: {changed}")
    if store_before != store_after:
        raise PendingLead("a rejected command changed the pre-existing store")


@contextmanager
def tiny_disk(cwd: Path, kind: str) -> Iterator[None]:
    """Mount a 64 kB tmpfs at cwd/disk, filled to the last byte ("full") or read-only ("readonly")."""
    disk = cwd / "disk"
    disk.mkdir()
    options = "size=64k" + (",ro" if kind == "readonly" else "")
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(disk)], capture_output=True
    ).returncode:
        pytest.skip("mounting a tmpfs is not allowed here")
    try:
        if kind == "full":
            with open(disk / "fill", "wb") as fh, contextlib.suppress(OSError):
                fh.write(b"\0" * 128 * 1024)
        yield
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def failing(code: int) -> Callable[..., None]:
    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(code, os.strerror(code))

    return fail


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [pytest.param(n, marks=c.marks, id=n) for n, c in CASES.items()])
def test_mistake_is_one_line_exit_2_and_writes_nothing(
    name: str, workdir: Path, trained: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    case = CASES[name]
    args = prepare(case, workdir, trained)
    with tiny_disk(workdir, case.patch) if case.patch in ("full", "readonly") else contextlib.nullcontext():
        run_in_process(case, args, workdir, monkeypatch)


def run_in_process(case: Mistake, args: list[str], workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before, store_before = snapshot(workdir), store_content(workdir)
    for key, value in case.env:
        monkeypatch.setenv(key, value)
    if case.patch == "enospc":
        monkeypatch.setattr(os, "replace", failing(errno.ENOSPC))
    elif case.patch == "eacces":
        monkeypatch.setattr(tempfile, "mkstemp", failing(errno.EACCES))
    result = CliRunner().invoke(app, args)
    monkeypatch.undo()
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(
            f"{type(result.exception).__name__}: {result.exception}"
        )  # a bug: shown, not hidden
    check(
        case,
        result.exit_code,
        result.stdout,
        result.stderr,
        before,
        snapshot(workdir),
        store_before,
        store_content(workdir),
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [pytest.param(n, marks=CASES[n].marks, id=n) for n in SUBPROCESS_CASES])
def test_mistake_in_a_real_process(name: str, workdir: Path, trained: tuple[Path, str]) -> None:
    case = CASES[name]
    args = prepare(case, workdir, trained)
    before, store_before = snapshot(workdir), store_content(workdir)
    env = {k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")}
    proc = subprocess.run(
        [sys.executable, "-m", "fedcli", *args],
        capture_output=True,
        text=True,
        cwd=workdir,
        env={**env, "COLUMNS": "100", **dict(case.env)},
        timeout=110,
    )
    check(
        case,
        proc.returncode,
        proc.stdout,
        proc.stderr,
        before,
        snapshot(workdir),
        store_before,
        store_content(workdir),
    )


def test_catalog_covers_every_command() -> None:
    assert len(CASES) >= 60
    commands = {c.args[0] for c in CASES.values()}
    assert {"train", "partition", "sweep", "evaluate", "report", "list", "ui"} <= commands


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (errno.ENOSPC, "no space left on device: out/r.md"),
        (errno.EACCES, "permission denied: out/r.md"),
        (errno.EISDIR, "which is a directory"),
        (errno.EROFS, "out/r.md: not writable (Read-only file system)"),
    ],
)
def test_output_errors_say_what_happened_to_which_path(code: int, words: str) -> None:
    from fedcli.runs.outputs import output_error

    message = str(output_error(Path("out/r.md"), "--output", OSError(code, os.strerror(code))))
    assert words in message and "--output" in message and "\n" not in message


def test_a_sweep_dry_run_writes_nothing(workdir: Path) -> None:
    """`sweep --dry-run` on a fresh root prints the plan and creates no store (it used to create fedcli.db)."""
    before = snapshot(workdir)
    result = CliRunner().invoke(app, ["sweep", "--recipe", "fedopt-lsq", "--dry-run", "--root", ROOT])
    assert result.exit_code == 0, result.output
    assert "5 trials" in result.stderr and "to run" in result.stderr
    assert snapshot(workdir) == before


def test_the_longest_allowed_names_work_on_postgresql(tmp_path: Path, pg_database) -> None:  # noqa: ANN001
    """The one name limit (200 bytes of UTF-8) fits PostgreSQL and MLflow on PostgreSQL, where a 300-character
    experiment failed after SQLite had kept it: a run and a sweep at the limit train and end `finished`."""
    from fedcli.tracking.store.sql_store import SqlStore

    store_url, mlflow_url = pg_database(), pg_database()
    experiment, run_name = "é" * 100, "r" * 200  # 200 bytes each: the limit
    env = {k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            "--task",
            "lsq",
            "--rounds",
            "1",
            "--root",
            str(tmp_path),
            "--store",
            store_url,
            "--tracking-uri",
            mlflow_url,
            "--experiment",
            experiment,
            "--run-name",
            run_name,
        ],
        capture_output=True,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = SqlStore(store_url).list_runs(experiment=experiment)
    assert (run.run_name, run.status) == (run_name, "finished")
    too_long = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "train",
            "--task",
            "lsq",
            "--root",
            str(tmp_path),
            "--store",
            store_url,
            "--no-mlflow",
            "--experiment",
            experiment + "x",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert too_long.returncode == 2 and "at most 200 bytes" in too_long.stderr, too_long.stderr
