"""Issue 35, part 5: input that was silently cast, merged, truncated or defaulted, and input that gave a traceback.

Each case runs the real CLI in a fresh working directory and must exit 2 with one "error:" line
naming the problem, no traceback, nothing on stdout and nothing written (test_bad_input.check).
The Python API gets the same input and must raise a fedcli.errors exception whose message is that
line (after "error: "). A model whose output is NaN from round 0 is the documented divergence:
one line, exit 2, the run marked `failed` with diverged_at_round 0 (docs/operations.md,
"Run lifecycle", Failures).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import fedcli
from fedcli.cli.main import app
from fedcli.errors import ConfigError, DataError, FedcliError
from tests.reliability.test_bad_input import (  # noqa: F401 - workdir is a fixture
    ROOT,
    SPEC,
    Mistake,
    byo,
    check,
    npz,
    snapshot,
    store_content,
    sweep,
    text,
    train,
    workdir,
)

M = Mistake
X20 = np.random.default_rng(0).normal(size=(20, 3)).astype(np.float32)
Y20 = np.arange(20) % 2


def partition(**edits: object) -> Callable[[Path], None]:
    """A valid-looking lsq partition file (p.json) with `edits` applied and its content hash recomputed,
    so the check under test is the one that fires (an edited file otherwise fails its hash first)."""

    def make(d: Path) -> None:
        from fedcli.datasets.partition.files import _canonical

        doc: dict = {
            "format": "fedcli-partition",
            "version": 1,
            "dataset": "lsq",
            "fingerprint": "0" * 64,
            "spec": {"scheme": "iid", "num_clients": 2},
            "num_examples": 20,
            "num_clients": 2,
            "clients": [[0, 1, 2], [3, 4, 5]],
            "label_histograms": None,
            **edits,
        }
        doc["content_sha256"] = hashlib.sha256(_canonical(doc).encode()).hexdigest()
        (d / "p.json").write_text(json.dumps(doc))

    return make


def deep_json(d: Path) -> None:
    (d / "p.json").write_text(
        '{"format": "fedcli-partition", "clients": ' + "[" * 100_000 + "]" * 100_000 + "}"
    )


def leaf(body: str) -> Callable[[Path], None]:
    """A vehicle data folder v/ whose one LEAF training file is `body`."""

    def make(d: Path) -> None:
        (d / "v" / "train").mkdir(parents=True)
        (d / "v" / "train" / "a.json").write_text(body)

    return make


LEAF_OK_USER = '{"x": [[0.5]], "y": [1]}'
VEHICLE = ("--task", "vehicle", "--data-dir", "v", "--no-mlflow")


def natural(file: str, *args: str) -> tuple[str, ...]:
    return train("--data", file, "--scheme", "natural", "--clients-per-round", "2", "--no-mlflow", *args)


PART = ("--task", "lsq", "--partition", "p.json", "--no-mlflow")
CASES: dict[str, Mistake] = {
    # a YAML key given twice: the last won
    "config-key-twice": M(
        train("--config", "c.yaml"),
        "gives key 'train' twice (lines 1 and 2)",
        text("c.yaml", "train: {rounds: 2}\ntrain: {rounds: 3}\n"),
    ),
    "config-nested-key-twice": M(
        train("--config", "c.yaml"),
        "gives key 'rounds' twice (lines 2 and 3)",
        text("c.yaml", "train:\n  rounds: 2\n  rounds: 3\n"),
    ),
    "sweep-key-twice": M(
        sweep("s.yaml", "--dry-run"),
        "gives key 'seeds' twice (lines 3 and 4)",
        text("s.yaml", SPEC + "seeds: [0]\nseeds: [1]\n"),
    ),
    "hp-value-key-twice": M(train("--task", "lsq", "--hp", "x={a: 1, a: 2}"), "gives key 'a' twice"),
    # YAML nested past the parser's recursion: a RecursionError traceback
    "config-nested-too-deep": M(
        train("--config", "c.yaml"),
        "is nested too deeply to read",
        text("c.yaml", "train: {rounds: 2}\nx: " + "[" * 5000 + "]" * 5000 + "\n"),
    ),
    # the algorithm section's other keys were dropped, its name str()-cast
    "config-algorithm-stray-key": M(
        train("--config", "c.yaml"),
        "unknown config key 'algorithm.rho'",
        text("c.yaml", "algorithm: {name: fedpa, rho: 0.1}\n"),
    ),
    "config-algorithm-name-number": M(
        train("--config", "c.yaml"),
        "algorithm.name must be an algorithm name",
        text("c.yaml", "algorithm: {name: 5}\n"),
    ),
    # --resume "$RUN" with RUN empty trained a fresh run from scratch
    "resume-empty": M(train("--resume", "", "--task", "lsq"), "--resume must name a run"),
    "resume-blank": M(train("--resume", "  ", "--task", "lsq"), "--resume must name a run"),
    "data-empty": M(train("--data", "", "--no-mlflow"), "data.file '' does not exist"),
    # partition indices: truncated (12.5), cast ("3", true), OverflowError (1e30), RecursionError (deep)
    "partition-index-fraction": M(
        train(*PART), "example index 12.5 in client 0 (not an integer)", partition(clients=[[0, 12.5], [3]])
    ),
    "partition-index-text": M(
        train(*PART), 'example index "3" in client 0 (not an integer)', partition(clients=[[0, "3"], [4]])
    ),
    "partition-index-bool": M(
        train(*PART), "example index true in client 0 (not an integer)", partition(clients=[[0, True], [4]])
    ),
    "partition-index-huge": M(
        train(*PART),
        "example index 1000000000000000000000000000000 in client 1 (outside 0..19)",
        partition(clients=[[0], [3, 10**30]]),
    ),
    "partition-index-nested": M(
        train(*PART), "example index [1] in client 0 (not an integer)", partition(clients=[[0, [1]], [4]])
    ),
    "partition-nested-too-deep": M(train(*PART), "is nested too deeply to be a partition file", deep_json),
    # client ids: float ids became clients named "0.5", "1.5" (or 1.0 a name); now refused
    "data-client-float": M(
        natural("c.npz"),
        "c.npz: client must hold integer ids or names; got dtype float64 (e.g. 0.5 at row 0)",
        npz("c.npz", x=X20, y=Y20, client=np.array([0.5, 1.5] * 10)),
    ),
    "data-client-float-whole": M(
        natural("c.npz"),
        "client must hold integer ids or names; got dtype float64",
        npz("c.npz", x=X20, y=Y20, client=np.array([1.0, 2.0] * 10)),
    ),
    "data-client-bool": M(
        natural("c.npz"),
        "client must hold integer ids or names; got dtype bool",
        npz("c.npz", x=X20, y=Y20, client=np.array([True, False] * 10)),
    ),
    "data-csv-client-float": M(
        natural("c.csv"),
        "c.csv: client must hold integer ids or names; got dtype float64 (e.g. 1.5 at row 1)",
        text(
            "c.csv", "a,b,y,client\n" + "".join(f"{i},{i % 3},{i % 2},{1 + (i % 2) / 2}\n" for i in range(20))
        ),
    ),
    # CSV headers pandas renames: a second `y` became the feature `y.1`, to_csv's unnamed index a feature
    "data-csv-column-twice": M(
        byo("c.csv"),
        "c.csv: column 'y' appears twice in the header",
        text("c.csv", "a,y,y\n" + "".join(f"{i},{i % 2},{i % 3}\n" for i in range(20))),
    ),
    "data-csv-unnamed-index": M(
        byo("c.csv"),
        "c.csv: column 1 of the header has no name",
        text("c.csv", ",a,y\n" + "".join(f"{i},{i * 2},{i % 2}\n" for i in range(20))),
    ),
    # an empty path (`--data-dir "$DIR"` with DIR unset): Typer made it ".", the working folder
    "empty-data-dir": M(
        train("--task", "lsq", "--data-dir", "", "--no-mlflow"), "data.data_dir must be a folder; got ''."
    ),
    "empty-root": M(
        ("train", "--task", "lsq", "--no-mlflow", "--root", ""), "tracking.root must be a folder; got ''."
    ),
    "blank-root-equals": M(
        ("train", "--task", "lsq", "--no-mlflow", "--root= "), "tracking.root must be a folder; got ' '."
    ),
    "empty-partition": M(
        train("--task", "lsq", "--partition", "", "--no-mlflow"),
        "partition.file must be a partition file; got ''.",
    ),
    "list-empty-root": M(("list", "runs", "--root", ""), "tracking.root must be a folder; got ''."),
    "evaluate-empty-root": M(("evaluate", "abc", "--root", ""), "tracking.root must be a folder; got ''."),
    "sync-empty-root": M(("sync", "--root", ""), "tracking.root must be a folder; got ''."),
    "list-empty-store": M(
        ("list", "runs", "--store", ""), "tracking.store must be a SQLAlchemy URL; got ''."
    ),
    "report-empty-store": M(("report", "--store", " "), "tracking.store must be a SQLAlchemy URL; got ' '."),
    # an in-memory SQLite store: the run trained, then failed with "no such table: runs" (list showed no runs)
    "store-in-memory": M(
        train("--task", "lsq", "--store", "sqlite://", "--no-mlflow"),
        "tracking.store must be a database that outlives the command; got 'sqlite://'",
    ),
    "store-memory-file": M(
        train("--task", "lsq", "--store", "sqlite:///:memory:", "--no-mlflow"),
        "tracking.store must be a database that outlives the command",
    ),
    "tracking-uri-in-memory": M(
        train("--task", "lsq", "--tracking-uri", "sqlite:///"),
        "tracking.tracking_uri must be a database that outlives the command",
    ),
    "list-store-in-memory": M(
        ("list", "runs", "--store", "sqlite:///"),
        "tracking.store must be a database that outlives the command",
    ),
    # report filters and lists: the last --where of a key won; a repeated column, group key or run was kept twice
    "report-where-key-twice": M(
        ("report", "--root", ROOT, "--where", "algo=fedavg", "--where", "algo=fedprox"),
        "--where algo must be given once; got algo=fedavg and 'algo=fedprox'",
    ),
    "report-column-twice": M(
        ("report", "--root", ROOT, "--columns", "loss,loss"), "--columns names metric key 'loss' twice"
    ),
    "report-group-key-twice": M(
        ("report", "--root", ROOT, "--group-by", "algo, algo"), "--group-by names config key 'algo' twice"
    ),
    "report-run-twice": M(
        ("report", "--root", ROOT, "--runs", "abc", "--runs", "abc"), "--runs names run 'abc' twice"
    ),
    "report-empty-output": M(
        ("report", "--output", "", "--root", ROOT), "--output must name a file; got ''."
    ),
    "sweep-empty-spec": M(("sweep", "", "--root", ROOT), "the sweep spec must name a file; got ''."),
    "partition-empty-out": M(
        ("partition", "--dataset", "lsq", "--scheme", "iid", "--clients", "2", "--out", ""),
        "--out must name a file; got ''.",
    ),
    "partition-empty-data-dir": M(
        (
            "partition",
            "--dataset",
            "lsq",
            "--scheme",
            "iid",
            "--clients",
            "2",
            "--out",
            "p.json",
            "--data-dir",
            "",
        ),
        "data.data_dir must be a folder; got ''.",
    ),
    # LEAF JSON: RecursionError / TypeError / AttributeError tracebacks; users and keys given twice kept the last
    "leaf-nested-too-deep": M(
        train(*VEHICLE),
        "LEAF file v/train/a.json is nested too deeply to read",
        leaf("[" * 100_000 + "]" * 100_000),
    ),
    "leaf-truncated": M(
        train(*VEHICLE),
        "LEAF file v/train/a.json is not valid (gzipped) JSON",
        leaf('{"users": ["a"], "num_samples": [1], "user_data": {"a": {"x": [[0.5'),
    ),
    "leaf-users-not-a-list": M(
        train(*VEHICLE),
        "LEAF file v/train/a.json: users must be a list of user names",
        leaf('{"users": 5, "num_samples": [1], "user_data": {}}'),
    ),
    "leaf-user-not-a-name": M(
        train(*VEHICLE),
        "LEAF file v/train/a.json: users must be a list of user names",
        leaf('{"users": [["a"]], "num_samples": [1], "user_data": {}}'),
    ),
    "leaf-user-data-list": M(
        train(*VEHICLE),
        "LEAF file v/train/a.json: user_data must be an object",
        leaf('{"users": ["a"], "num_samples": [1], "user_data": []}'),
    ),
    "leaf-count-text": M(
        train(*VEHICLE),
        "LEAF file v/train/a.json: num_samples must be a list of example counts",
        leaf('{"users": ["a"], "num_samples": ["1"], "user_data": {"a": ' + LEAF_OK_USER + "}}"),
    ),
    "leaf-user-twice": M(
        train(*VEHICLE),
        "LEAF file v/train/a.json lists user 'a' twice",
        leaf('{"users": ["a", "a"], "num_samples": [1, 1], "user_data": {"a": ' + LEAF_OK_USER + "}}"),
    ),
    "leaf-key-twice": M(
        train(*VEHICLE),
        "LEAF file v/train/a.json gives key 'a' twice in one object",
        leaf(
            '{"users": ["a"], "num_samples": [1], "user_data": {"a": '
            + LEAF_OK_USER
            + ', "a": '
            + LEAF_OK_USER
            + "}}"
        ),
    ),
}


def run_cli(case: Mistake, cwd: Path) -> str:
    """Run one case through the CLI, check it (exit 2, one line, nothing written); return the message."""
    if case.make is not None:
        case.make(cwd)
    before, store_before = snapshot(cwd), store_content(cwd)
    result = CliRunner().invoke(app, list(case.args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"{type(result.exception).__name__}: {result.exception}")
    check(
        case,
        result.exit_code,
        result.stdout,
        result.stderr,
        before,
        snapshot(cwd),
        store_before,
        store_content(cwd),
    )
    return result.stderr.strip().removeprefix("error: ")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CASES))
def test_coercion_is_one_line_exit_2_and_writes_nothing(name: str, workdir: Path) -> None:  # noqa: F811
    run_cli(CASES[name], workdir)


# The same input from Python: (CLI case, fedcli.train keyword arguments).
SAME_AS_CLI = {
    "config-key-twice": dict(config="c.yaml", task="lsq"),
    "config-algorithm-stray-key": dict(config="c.yaml"),
    "resume-empty": dict(resume="", task="lsq"),
    "partition-index-fraction": dict(task="lsq", partition="p.json", no_mlflow=True),
    "partition-index-huge": dict(task="lsq", partition="p.json", no_mlflow=True),
    "data-client-float": dict(data="c.npz", scheme="natural", clients_per_round=2, no_mlflow=True),
    "leaf-nested-too-deep": dict(task="vehicle", data_dir="v", no_mlflow=True),
    "empty-data-dir": dict(task="lsq", data_dir="", no_mlflow=True),
    "store-in-memory": dict(task="lsq", store="sqlite://", no_mlflow=True),
    "empty-root": dict(task="lsq", root="", no_mlflow=True),
    "blank-root-equals": dict(task="lsq", root=" ", no_mlflow=True),
    "empty-partition": dict(task="lsq", partition="", no_mlflow=True),
    "leaf-truncated": dict(task="vehicle", data_dir="v", no_mlflow=True),
    "leaf-user-data-list": dict(task="vehicle", data_dir="v", no_mlflow=True),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(SAME_AS_CLI))
def test_python_api_raises_the_cli_line(name: str, workdir: Path) -> None:  # noqa: F811
    line = run_cli(CASES[name], workdir)
    before = snapshot(workdir)
    with pytest.raises(FedcliError) as info:
        fedcli.train(**{"root": ROOT, **SAME_AS_CLI[name]})
    assert str(info.value) == line
    assert snapshot(workdir) == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # a bare "dictionary update sequence element #0 has length 1; 2 is required" ValueError
        (dict(hp="rho=0.1"), "hp must be a mapping such as hp={'rho': 0.1}; got str 'rho=0.1'."),
        # "'str' object is not callable" after the run had started
        (
            dict(progress="yes"),
            "progress must be True, False or a function f(round, metrics); got str 'yes'.",
        ),
        # truthy: MLflow was switched off
        (dict(no_mlflow="no"), "no_mlflow must be True or False; got str 'no'."),
        (dict(mlflow_optional="yes"), "mlflow_optional must be True or False; got str 'yes'."),
        (dict(data_options=["client"]), "data_options must be a mapping such as"),
        (
            dict(config=3),
            "config must be a YAML file, a shipped config's name or a mapping of sections; got int 3.",
        ),
        (dict(resume=5), "resume must be a run id, id prefix or name (str), or a Run; got int 5."),
        (dict(train=5), "train= must be a mapping of the train section's config keys"),
        (dict(algo=["fedavg"]), "algo must be a name (str); got list ['fedavg']."),
        # truthy: a resumed run's stored code was trusted
        (dict(trust_code="no"), "trust_code must be True or False; got str 'no'."),
        # str()-ed into "x.db", then refused by SQLAlchemy as "not a valid SQLAlchemy URL"
        (
            dict(store=Path("x.db")),
            "store must be str (a URL such as sqlite:////abs/path/fedcli.db), not a path; got "
            "PosixPath 'x.db'.",
        ),
        (dict(device=Path("cpu")), "device must be str, not a path; got PosixPath 'cpu'."),
    ],
)
def test_python_api_argument_types(kwargs: dict, message: str, workdir: Path) -> None:  # noqa: F811
    before = snapshot(workdir)
    with pytest.raises(ConfigError) as info:
        fedcli.train(**{"task": "lsq", "rounds": 1, "root": ROOT, **kwargs})
    assert message in str(info.value) and "\n" not in str(info.value)
    assert snapshot(workdir) == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(at=[2.5]),
            "at must be a list of round numbers (integers >= 1); got float 2.5",
        ),  # int() truncated it
        (dict(at=[True]), "at must be a list of round numbers (integers >= 1); got bool True"),
        (
            dict(thresholds=["high"]),
            "thresholds must be a list of finite numbers; got str 'high'",
        ),  # ValueError
        (dict(window=0), "window must be an integer number of rounds >= 1; got int 0."),
        (dict(smooth=1.5), "smooth must be an integer number of rounds >= 1; got float 1.5."),
        (
            dict(runs=[5]),
            "runs must be a list of runs (Run) or run references (str); got int 5.",
        ),  # str(5) looked up
        (dict(experiment=5), "experiment must be a name (str) or a list of names; got int 5."),  # TypeError
        (dict(experiment=["e", 5]), "experiment must be a name (str) or a list of names; got int 5."),
        (
            dict(group_by=[5]),
            "group_by must be a name (str) or a list of names; got int 5.",
        ),  # AttributeError
        (dict(columns=[5]), "columns must be a name (str) or a list of names; got int 5."),
        (
            dict(metric=5),
            "metric must be a metric name (str) such as 'accuracy'; got int 5.",
        ),  # AttributeError
        (
            dict(where="algo=fedpa"),
            "where must be a mapping such as where={'algo': 'fedpa'}; got str",
        ),  # AttributeError
        (dict(where={5: "x"}), "where keys must be config keys (str) such as 'algo'; got int 5."),
        (
            dict(where={"algo": ["fedpa"]}),
            "where['algo'] must be a str or a number; got list ['fedpa'].",
        ),  # str()-ed
        (dict(include_unfinished="no"), "include_unfinished must be True or False; got str 'no'."),  # truthy
        (dict(partition_heatmap="no"), "partition_heatmap must be True or False; got str 'no'."),
        (dict(output=5), "output must be a path (str or pathlib.Path); got int 5."),  # TypeError
        (dict(output=""), "--output must name a file; got ''."),  # was "got '.', which is a directory"
        (dict(root=5), "root must be a path (str or pathlib.Path); got int 5."),  # str()-ed: the folder "5"
        (dict(root=""), "tracking.root must be a folder; got ''."),  # the working folder's store
        (dict(store=""), "tracking.store must be a SQLAlchemy URL; got ''."),  # the default store
        (dict(store=Path("x.db")), "store must be a SQLAlchemy URL (str) such as"),
        (dict(columns="loss,loss"), "columns names metric key 'loss' twice"),
    ],
)
def test_python_report_argument_types(kwargs: dict, message: str, workdir: Path) -> None:  # noqa: F811
    with pytest.raises(ConfigError) as info:
        fedcli.report(**{"root": ROOT, **kwargs})
    assert message in str(info.value)
    assert snapshot(workdir) == {}


@pytest.mark.parametrize("ref", [None, 5, " "])
def test_load_run_needs_a_reference(ref: object, workdir: Path) -> None:  # noqa: F811
    """load_run(None) returned some run of the store; load_run(5) was an AttributeError."""
    assert (
        CliRunner()
        .invoke(app, ["-q", "train", "--task", "lsq", "--rounds", "1", "--no-mlflow", "--root", ROOT])
        .exit_code
        == 0
    )
    with pytest.raises(ConfigError, match=r"^ref must be a run id, id prefix or name \(str\); got "):
        fedcli.load_run(ref, root=ROOT)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(root=5), "root must be a path (str or pathlib.Path); got int 5."),
        (dict(root=""), "tracking.root must be a folder; got ''."),
        (dict(store=""), "tracking.store must be a SQLAlchemy URL; got ''."),
        (dict(store=Path("runs/fedcli.db")), "store must be a SQLAlchemy URL (str) such as"),
        (dict(trust_code="no"), "trust_code must be True or False; got str 'no'."),
    ],
)
def test_load_run_argument_types(kwargs: dict, message: str, workdir: Path) -> None:  # noqa: F811
    """Checked before the store is looked up: root=5 read the folder "5", store="" the default store."""
    assert (
        CliRunner()
        .invoke(app, ["-q", "train", "--task", "lsq", "--rounds", "1", "--no-mlflow", "--root", ROOT])
        .exit_code
        == 0
    )
    with pytest.raises(ConfigError) as info:
        fedcli.load_run("x", **{"root": ROOT, **kwargs})
    assert message in str(info.value) and "\n" not in str(info.value)


class Pairs(torch.utils.data.Dataset):
    """A map-style dataset returning (x, label) with the labels as given (Python values)."""

    def __init__(self, labels: list) -> None:
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, object]:
        return torch.from_numpy(X20[i]), self.labels[i]


TENSORS = torch.utils.data.TensorDataset(torch.from_numpy(X20), torch.from_numpy(Y20))


@pytest.mark.parametrize(
    ("data", "options", "message"),
    [
        # client ids [1, "1"] became one client; [True, 1] too; 0.5 / 0.7 were cast to 0..K-1
        (
            TENSORS,
            dict(client=[1, "1"] * 10),
            "client ids must all be integers or all be names (str); got str '1' at "
            "example 1 (example 0: int 1)",
        ),
        (TENSORS, dict(client=[True, 1] * 10), "got bool True at example 0"),
        (TENSORS, dict(client=[0.5, 0.7] * 10), "got float 0.5 at example 0"),
        (
            TENSORS,
            dict(client=np.array([1.0, 2.0] * 10)),
            "client must hold integer ids or names; got dtype float64",
        ),
        # partition indices 2.5 were truncated to 2
        (
            TENSORS,
            dict(partition=[[0, 1, 2.5], [3]]),
            "partition client 0 must be integer example indices; got dtype float64 (e.g. 2.5)",
        ),
        # labels [0, 1, 0.5, ...] became float regression targets; [True, 2, ...] integers
        (
            Pairs([0, 1, 0.5] + [1] * 17),
            {},
            "labels must all be integers (classes) or all floats (regression targets); "
            "got float 0.5 at example 2 (example 0: int 0)",
        ),
        (Pairs([True, 2] + [1] * 18), {}, "got bool True at example 0"),
    ],
)
def test_python_data_objects_are_not_cast(data: object, options: dict, message: str, workdir: Path) -> None:  # noqa: F811
    with pytest.raises(DataError) as info:
        fedcli.train(
            data=data, data_options=options, scheme="iid", clients=2, rounds=1, root=ROOT, no_mlflow=True
        )
    assert message in str(info.value) and "\n" not in str(info.value)
    assert snapshot(workdir) == {}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(name=5), "name must be a non-empty name (str) for the data; got int 5."),  # str()-ed to "5"
        (dict(name=Path("d")), "name must be a non-empty name (str) for the data; got PosixPath"),
        (
            dict(name=""),
            "name must be a non-empty name (str) for the data; got str ''.",
        ),  # defaulted silently
        (dict(y=5), "y must be the name (str) of a Hugging Face label column; got int 5."),
        (dict(x=[5]), "x must be a column name (str) or a list of column names; got int 5."),
    ],
)
def test_data_ref_argument_types(options: dict, message: str, workdir: Path) -> None:  # noqa: F811
    from fedcli.datasets.yours.data import data_ref

    with pytest.raises(ConfigError) as info:
        data_ref(TENSORS, **options)
    assert message in str(info.value)
    with pytest.raises(ConfigError) as info:  # the same through fedcli.train's data_options
        fedcli.train(
            data=TENSORS, data_options=options, scheme="iid", clients=2, rounds=1, root=ROOT, no_mlflow=True
        )
    assert message in str(info.value)
    assert snapshot(workdir) == {}


@pytest.mark.slow
def test_integer_client_ids_and_names_still_work(workdir: Path) -> None:  # noqa: F811
    """The refusals above leave the documented forms alone: integer ids and names, as an .npz and in Python."""
    np.savez(workdir / "ok.npz", x=X20, y=Y20, client=np.array(["a", "b"] * 10))
    result = CliRunner().invoke(app, ["-q", *natural("ok.npz", "--rounds", "1")])
    assert result.exit_code == 0, result.output
    run = fedcli.train(
        data=TENSORS,
        data_options=dict(client=[3, 7] * 10),
        scheme="natural",
        clients_per_round=2,
        rounds=1,
        root=ROOT,
        no_mlflow=True,
    )
    assert run.status == "finished"


NAN_MODEL = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x) * float("nan")
"""


@pytest.mark.timeout(300)
def test_nan_from_round_0_is_the_documented_divergence(workdir: Path) -> None:  # noqa: F811
    """A model whose output is NaN before any training: the divergence line, exit 2, the run `failed` at
    round 0 (was an 85-line NonFiniteMetricsError traceback from the store's write of round 0)."""
    from fedcli.engine.rounds import DivergenceError
    from fedcli.tracking.store.sql_store import SqlStore

    (workdir / "nan_model.py").write_text(NAN_MODEL)
    np.savez(workdir / "d.npz", x=X20, y=Y20)
    args = [
        "-q",
        "train",
        "--data",
        "d.npz",
        "--model",
        "nan_model.py:Net",
        "--scheme",
        "iid",
        "--clients",
        "2",
        "--clients-per-round",
        "2",
        "--rounds",
        "2",
        "--no-mlflow",
        "--root",
        ROOT,
    ]
    result = CliRunner().invoke(app, args)
    assert "Traceback" not in result.output
    assert result.exit_code == 2, result.output
    line = (
        "run diverged at round 0: eval/loss not finite for the initial model, before any training; check the "
        "model's forward pass, its initialisation and the data. The run is marked failed."
    )
    assert result.stderr.strip() == f"error: {line}", result.stderr
    (run,) = SqlStore(f"sqlite:///{workdir / ROOT / 'fedcli.db'}").list_runs()
    assert (run.status, run.diverged_at_round) == ("failed", 0)
    with pytest.raises(DivergenceError) as info:
        fedcli.train(
            data="d.npz",
            model="nan_model.py:Net",
            scheme="iid",
            clients=2,
            clients_per_round=2,
            rounds=2,
            no_mlflow=True,
            root=ROOT,
        )
    assert str(info.value) == line
