"""End to end: two short experiments (FedAvg, FedPA x two seeds on `lsq`) into a temporary store,
then `fedcli evaluate` and `fedcli report` on them, checked against the stored metrics.

Expected numbers are recomputed here with pandas straight from the store's long metric
table (rolling means, window filters, cumulative sums), independently of
fedcli.tracking.metric_defs, and compared with the text of the rendered cells.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from typer.testing import CliRunner

from fedcli.cli.main import app
from fedcli.tracking.store.sql_store import SqlStore

ROUNDS, SMOOTH, WINDOW, AT = 12, 3, 5, 10
RUNNER = CliRunner()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, dict[str, str]]]:
    """Store URL, root and run ids keyed "<algo>-<seed>" of four 12-round lsq runs."""
    root = tmp_path_factory.mktemp("e2e")
    url = f"sqlite:///{root / 'store.db'}"
    ids = {}
    for algo in ("fedavg", "fedpa"):
        for seed in (0, 1):
            extra = ["--hp", "burn_in_rounds=4"] if algo == "fedpa" else []
            extra += ["--checkpoint-every", "4"] if (algo, seed) == ("fedavg", 0) else []
            result = RUNNER.invoke(
                app,
                [
                    "-q",
                    "train",
                    "--algo",
                    algo,
                    "--task",
                    "lsq",
                    "--rounds",
                    str(ROUNDS),
                    "--clients-per-round",
                    "3",
                    "--local-epochs",
                    "2",
                    "--seed",
                    str(seed),
                    "--experiment",
                    f"lsq-{algo}",
                    "--no-mlflow",
                    "--store",
                    url,
                    "--root",
                    str(root),
                    *extra,
                ],
            )
            assert result.exit_code == 0, result.output
            ids[f"{algo}-{seed}"] = result.stdout.strip().splitlines()[-1]
    yield url, root, ids


def _frame(url: str, ids: dict[str, str]) -> pd.DataFrame:
    with SqlStore(url) as store:
        return store.metrics_frame(list(ids.values()))


def _series(frame: pd.DataFrame, run_id: str, key: str) -> pd.Series:
    rows = frame[(frame.run_id == run_id) & (frame.key == key)]
    return pd.Series(rows.value.to_numpy(), index=rows.round_idx.to_numpy())


def _expected_cells(frame: pd.DataFrame, ids: dict[str, str], algo: str, threshold: float) -> dict[str, str]:
    """Recompute one group's cells: metric@AT, rounds to threshold, bytes up to it, final."""
    at, hit, up, final = [], [], [], []
    for seed in (0, 1):
        run_id = ids[f"{algo}-{seed}"]
        dist = _series(frame, run_id, "eval/dist_to_opt")
        at.append(dist[(dist.index > AT - WINDOW) & (dist.index <= AT) & (dist.index >= 1)].mean())
        rolling = dist[dist.index >= 1].rolling(SMOOTH).mean()
        crossed = rolling[rolling <= threshold]
        hit.append(int(crossed.index[0]) if len(crossed) else None)
        bytes_up = _series(frame, run_id, "comm/bytes_up")
        up.append(bytes_up[bytes_up.index <= hit[-1]].sum() if hit[-1] is not None else None)
        final.append(dist.iloc[-1])

    def cell(values: list[float | None], fmt: str, scale: float = 1.0) -> str:
        present = np.array([v / scale for v in values if v is not None], dtype=np.float64)
        text = f"{present.mean():{fmt}}" + (f" ± {present.std(ddof=1):{fmt}}" if len(present) > 1 else "")
        return text + (f" ({len(present)}/{len(values)})" if len(present) < len(values) else "")

    return {
        "at": cell(at, ".4f"),
        "hit": cell(hit, ".0f") if any(h is not None for h in hit) else f"— ({ROUNDS} rounds)",
        "final": cell(final, ".4f"),
        "up_raw": up,
    }


def _table(markdown: str, heading: str) -> tuple[list[str], dict[str, list[str]]]:
    """Header cells and rows (group label -> cells, bold removed) of the table under `heading`."""
    block = markdown.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in block.splitlines() if line.startswith("|")]
    split = [[cell.strip().replace("**", "") for cell in line.strip("|").split("|")] for line in lines]
    return split[0], {row[0]: row[1:] for row in split[2:]}


def _report(url: str, out: Path, *extra: str) -> str:
    result = RUNNER.invoke(
        app,
        [
            "report",
            "--experiment",
            "lsq-fedavg",
            "--experiment",
            "lsq-fedpa",
            "--metric",
            "dist_to_opt",
            "--at",
            str(AT),
            "--window",
            str(WINDOW),
            "--smooth",
            str(SMOOTH),
            "--store",
            url,
            "--output",
            str(out),
            *extra,
        ],
    )
    assert result.exit_code == 0, result.output
    return out.read_text(encoding="utf-8")


@pytest.mark.slow
def test_report_tables_match_metrics_recomputed_from_the_store(
    trained: tuple[str, Path, dict[str, str]],
) -> None:
    url, root, ids = trained
    frame = _frame(url, ids)
    reference = _series(frame, ids["fedavg-0"], "eval/dist_to_opt")
    threshold = round(float(reference[reference.index >= 1].rolling(SMOOTH).mean().iloc[-1]), 3) + 0.001

    markdown = _report(url, root / "out" / "report.md", "--thresholds", f"{threshold},0.0001")

    header, rows = _table(markdown, "eval/dist_to_opt (Table 3 layout)")
    assert sorted(rows) == ["fedavg", "fedpa"]
    assert header[2] == f"dist_to_opt @{AT}R (↓)"
    for algo in ("fedavg", "fedpa"):
        want = _expected_cells(frame, ids, algo, threshold)
        cells = rows[algo]
        assert cells[0] == "2"  # seeds
        assert cells[1] == want["at"]
        assert cells[2] == want["hit"]
        assert cells[3] == f"— ({ROUNDS} rounds)"  # 0.0001 is never reached
        assert cells[5] == want["final"]
    comm_header, comm = _table(markdown, "Communication: bytes to each threshold and in total")
    scale = {"B": 1.0, "kB": 1e3, "MB": 1e6}[re.search(r"\((\w+), ↓\)", comm_header[2]).group(1)]
    ups = [u for u in _expected_cells(frame, ids, "fedavg", threshold)["up_raw"] if u is not None]
    assert comm["fedavg"][1].startswith(f"{np.mean(ups) / scale:.2f}")


@pytest.mark.slow
def test_report_is_byte_identical_and_draws_valid_pngs(trained: tuple[str, Path, dict[str, str]]) -> None:
    url, root, _ = trained
    first = _report(url, root / "a" / "report.md", "--thresholds", "2.0")
    second = _report(url, root / "b" / "report.md", "--thresholds", "2.0")

    assert first.replace("/a/", "/b/") == second  # only the --output path in the header differs
    pngs = sorted(p.name for p in (root / "a").glob("*.png"))
    assert pngs == [
        "report-eval_dist_to_opt-vs-bytes.png",
        "report-eval_dist_to_opt-vs-time.png",
        "report-eval_dist_to_opt.png",
        "report-eval_loss.png",
    ]
    for name in pngs:
        assert f"]({name})" in first
        with Image.open(root / "a" / name) as image:
            image.verify()
            assert image.format == "PNG" and image.size[0] > 100
            assert round(image.info["dpi"][0]) >= 200
        assert (root / "a" / name).read_bytes() == (root / "b" / name).read_bytes()
        svg = name.replace(".png", ".svg")
        assert (root / "a" / svg).read_bytes() == (root / "b" / svg).read_bytes()
        assert b"<dc:date>" not in (root / "a" / svg).read_bytes()
    for run_id in _frame(url, trained[2]).run_id.unique():
        assert f"`{run_id}`" in first


@pytest.mark.slow
def test_report_json_and_csv_carry_the_same_numbers(trained: tuple[str, Path, dict[str, str]]) -> None:
    url, root, ids = trained
    frame = _frame(url, ids)
    doc = json.loads(_report(url, root / "r.json", "--format", "json"))
    csv = pd.read_csv(root / "r.csv") if (root / "r.csv").exists() else None
    text = _report(url, root / "r.csv", "--format", "csv")

    group = next(g for g in doc["groups"] if g["label"] == "fedpa")
    finals = [_series(frame, ids[f"fedpa-{s}"], "eval/dist_to_opt").iloc[-1] for s in (0, 1)]
    assert group["columns"]["final"]["mean"] == pytest.approx(np.mean(finals), abs=1e-12)
    assert group["seeds"] == [0, 1] and csv is None
    assert "fedpa,,,main,final,mean," in text


@pytest.mark.slow
def test_report_says_which_keys_differ_inside_a_forced_group(
    trained: tuple[str, Path, dict[str, str]],
) -> None:
    url, root, _ = trained
    markdown = _report(url, root / "one" / "report.md", "--group-by", "task")

    assert "| task=lsq | 4 |" in markdown
    assert "mixes runs whose configs differ in more than the seed (" in markdown
    assert "algorithm.name: fedavg, fedpa)" in markdown
    assert "differ between runs and do not change results: `train.checkpoint_every`: 4, None." in markdown


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--metric", "accuracy"], "metric 'eval/accuracy' is not logged"),
        (["--thresholds", "0.8,x"], "--thresholds must be comma-separated numbers"),
        (["--group-by", "algoo"], "unknown config key 'algoo' (did you mean 'algo'?)"),
        (["--experiment", "nope"], "unknown experiment 'nope'"),
    ],
)
def test_report_mistakes_exit_2_with_one_line(
    trained: tuple[str, Path, dict[str, str]], args: list[str], message: str
) -> None:
    url, _, _ = trained
    result = RUNNER.invoke(app, ["report", "--store", url, *args])

    assert result.exit_code == 2
    assert message in result.stderr
    assert "Traceback" not in result.output


def _evaluate(url: str, *args: str) -> dict:
    result = RUNNER.invoke(app, ["evaluate", *args, "--json", "--store", url])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_evaluate_final_model_and_checkpoint_match_the_training_metrics(
    trained: tuple[str, Path, dict[str, str]],
) -> None:
    """The final model re-evaluated on the test split gives the round-12 eval metrics the
    training loop logged; checkpoint 4 gives round 4's. Both are stored against the run."""
    url, _, ids = trained
    frame = _frame(url, ids)
    run_id = ids["fedavg-0"]

    final = _evaluate(url, run_id[:10])
    at_4 = _evaluate(url, run_id, "--checkpoint", "4")

    for doc, round_idx in ((final, ROUNDS), (at_4, 4)):
        assert doc["round_idx"] == round_idx
        for key in ("loss", "dist_to_opt"):
            logged = _series(frame, run_id, f"eval/{key}")[round_idx]
            assert doc["metrics"][f"test/{key}"] == pytest.approx(logged, rel=1e-6)
    with SqlStore(url) as store:
        stored = store.evaluations_frame([run_id])
    assert {4, ROUNDS} <= set(stored.round_idx)
    assert "test/dist_to_opt" in set(stored.key)


def test_evaluate_per_client_on_training_examples(trained: tuple[str, Path, dict[str, str]]) -> None:
    """lsq has no per-client test data: --per-client uses each of its 20 clients' training data."""
    url, _, ids = trained

    doc = _evaluate(url, ids["fedpa-1"], "--split", "train", "--per-client")

    metrics = doc["metrics"]
    assert metrics["train/clients/clients"] == 20
    assert metrics["train/clients/loss_worst10"] >= metrics["train/clients/loss_mean"]
    assert doc["client_split"] == "train"


def test_evaluate_finds_a_run_by_mlflow_id_under_root(
    trained: tuple[str, Path, dict[str, str]], tmp_path: Path
) -> None:
    """`--root R` reads R/fedcli.db; the run is named by the id MLflow shows for it."""
    import sqlite3
    from contextlib import closing

    url, _, ids = trained
    with (
        closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as source,
        closing(sqlite3.connect(tmp_path / "fedcli.db")) as copy,
    ):
        source.backup(copy)  # the store may be in WAL mode: a file copy can miss rows
    mlflow_id = "0123456789abcdef0123456789abcdef"
    with SqlStore(f"sqlite:///{tmp_path / 'fedcli.db'}") as store:
        store.set_run_fields(ids["fedavg-1"], mlflow_run_id=mlflow_id)

    result = RUNNER.invoke(app, ["evaluate", mlflow_id, "--json", "--no-mlflow", "--root", str(tmp_path)])

    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["id"] == ids["fedavg-1"] and doc["round_idx"] == ROUNDS


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--checkpoint", "5"], "has no checkpoint of round 5; it has rounds [4, 8, 12]"),
        (
            ["--predictive", "ensemble"],
            "--predictive ensemble needs a posterior, and algorithm 'fedavg' keeps none",
        ),
    ],
)
def test_evaluate_mistakes_exit_2_with_one_line(
    trained: tuple[str, Path, dict[str, str]], args: list[str], message: str
) -> None:
    url, _, ids = trained
    result = RUNNER.invoke(app, ["evaluate", ids["fedavg-0"], *args, "--store", url])

    assert result.exit_code == 2
    assert message in result.stderr
    assert "Traceback" not in result.output


def test_ensemble_predictor_of_a_bayesian_algorithm() -> None:
    """For an algorithm whose `posterior` returns (mean, var): with var = 0 every sample equals
    the mean, so the K-sample predictive is softmax(mean model) exactly; with var > 0 the
    predictive averages softmax over theta_k = mean + sqrt(var) eps_k (seeded)."""
    from types import SimpleNamespace

    import torch

    from fedcli.algorithms import ALGORITHMS
    from fedcli.cli.evaluate import make_predictor
    from fedcli.datasets.tasks import Task
    from fedcli.engine.evaluation import sample_posterior

    def posterior(state: dict) -> tuple[dict, dict]:
        return state["mean"], state["var"]

    bayes = ALGORITHMS["fedavg"]._replace(name="toy-bayes", posterior=posterior)
    task = Task(
        name="toy",
        description="",
        source="",
        offline=True,
        kind="classification",
        models={},
        default_model="",
        load=lambda options: None,
    )
    setup = SimpleNamespace(alg=bayes, task=task, fns=SimpleNamespace(apply_fn=lambda p, x: x @ p["w"]))
    mean = {"w": torch.tensor([[1.0, -1.0], [0.5, 2.0]], dtype=torch.float64)}
    x = torch.tensor([[1.0, 0.0], [0.3, -0.7]], dtype=torch.float64)

    exact = make_predictor(
        setup, {"mean": mean, "var": {"w": torch.zeros(2, 2, dtype=torch.float64)}}, mean, 4, 0
    )
    noisy = make_predictor(
        setup, {"mean": mean, "var": {"w": torch.full((2, 2), 0.25, dtype=torch.float64)}}, mean, 3, 5
    )

    torch.testing.assert_close(
        torch.softmax(exact(x), -1), torch.softmax(x @ mean["w"], -1), rtol=0, atol=1e-12
    )
    members = sample_posterior(
        mean, {"w": torch.full((2, 2), 0.25, dtype=torch.float64)}, 3, torch.Generator().manual_seed(5)
    )
    expected = torch.stack([torch.softmax(x @ m["w"], -1) for m in members]).mean(0)
    torch.testing.assert_close(torch.softmax(noisy(x), -1), expected, rtol=0, atol=1e-12)


@pytest.mark.slow
def test_ui_prints_the_loopback_url_and_refuses_missing_stores(tmp_path: Path) -> None:
    (tmp_path / "mlflow.db").touch()

    shown = RUNNER.invoke(app, ["ui", "--root", str(tmp_path), "--port", "5123", "--print-only"])
    missing = RUNNER.invoke(app, ["ui", "--root", str(tmp_path / "nothing"), "--print-only"])
    server = RUNNER.invoke(app, ["ui", "--tracking-uri", "http://example.org:5000", "--print-only"])

    assert shown.exit_code == 0, shown.output
    assert shown.stdout.splitlines()[0].startswith("http://127.0.0.1:5123")
    assert (
        f"--backend-store-uri sqlite:///{tmp_path / 'mlflow.db'} --host 127.0.0.1 --port 5123 --workers 1"
        in shown.stdout
    )
    assert (
        missing.exit_code == 2
        and "no MLflow store at" in missing.stderr
        and "Traceback" not in missing.output
    )
    assert server.exit_code == 2 and "already a server" in server.stderr
