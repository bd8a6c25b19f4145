"""Paper-scale recipes (issue 32 item 4): the papers' settings, --data-dir, and --dry-run's measured estimates."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from fedcli.datasets.formats.generate import generate
from fedcli.engine.evaluation import resolve_eval_sample
from fedcli.recipes import read_recipe
from fedcli.recipes.reproduce import paper_recipes
from fedcli.sweep.spec import expand, load_spec

PAPER_SCALE = (
    "fedpa-table3-emnist",
    "fedpa-table3-cifar100",
    "fedpa-table3-stackoverflow-nwp",
    "fedpa-table3-stackoverflow-lr",
    "fedsparse-femnist-full",
    "bayesadmm-mnist100",
)


def _fedcli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "fedcli", *args], capture_output=True, text=True, timeout=900, env=env, cwd=cwd
    )


def test_recipes_carry_table_6_settings_and_say_where_the_data_comes_from() -> None:
    for name in PAPER_SCALE:
        body = read_recipe(name)
        assert body["data"]["source"] and body["paper"], name
        assert name not in paper_recipes()  # `make reproduce` does not start them without their files
    by_label = {t.name: t.config for t in expand(load_spec(None, "fedpa-table3-emnist"))}
    pa = by_label["FedPA-ME s0"]
    assert (
        pa.train.rounds,
        pa.train.clients_per_round,
        pa.train.local_epochs,
        pa.train.client_lr,
        pa.train.server_lr,
        pa.train.server_opt,
    ) == (1500, 100, 5, 0.01, 0.5, "momentum")
    assert (pa.algorithm.hp["rho"], pa.algorithm.hp["burn_in_rounds"]) == (
        0.1,
        100,
    ) and pa.data.model == "cnn"
    nwp = {t.name: t.config for t in expand(load_spec(None, "fedpa-table3-stackoverflow-nwp"))}["FedPA-ME s0"]
    assert (nwp.train.server_opt, nwp.train.server_lr, nwp.train.client_lr, nwp.train.client_momentum) == (
        "adam",
        1.0,
        0.1,
        0.0,
    )
    assert (nwp.algorithm.hp["burn_in_rounds"], nwp.algorithm.hp["rho"]) == (800, 0.01)
    assert resolve_eval_sample(nwp.train.eval_sample, nwp.data.task) == 10_000  # the paper's fixed sample
    lr = expand(load_spec(None, "fedpa-table3-stackoverflow-lr"))[0].config
    assert (lr.train.server_opt, lr.train.server_lr, lr.train.client_lr, lr.train.batch_size) == (
        "adagrad",
        5.0,
        50.0,
        100,
    )
    cifar = {t.name: t.config for t in expand(load_spec(None, "fedpa-table3-cifar100"))}["FedPA-ME s0"]
    assert (
        cifar.train.local_epochs,
        cifar.train.clients_per_round,
        cifar.algorithm.hp["burn_in_rounds"],
    ) == (10, 20, 400)


def test_dry_run_probes_each_trial_on_the_data_dir(tmp_path: Path) -> None:
    summary = generate("emnist", 17, tmp_path / "emnist", seed=2, mean_size=6)
    out = _fedcli(
        "sweep",
        "--recipe",
        "fedpa-table3-emnist",
        "--smoke",
        "--dry-run",
        "--data-dir",
        str(tmp_path / "emnist"),
        "--root",
        str(tmp_path / "runs"),
        "--no-mlflow",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr + out.stdout
    lines = {line.split(":", 1)[0]: line for line in out.stdout.splitlines() if "host peak (est.)" in line}
    assert set(lines) == {"FedAvg-1E s0", "FedPA-ME s0"}
    train, test = summary["examples"]["fed_emnist_train.h5"], summary["examples"]["fed_emnist_test.h5"]
    for line in lines.values():
        assert "clients 17;" in line and f"examples (train/test) {train} / {test};" in line
        assert "params 1,206,590;" in line  # Reddi et al.'s CNN
        peak = re.search(r"host peak \(est\.\) ([\d.]+) (MiB|GiB)", line)
        per_round = re.search(r"s/round ([\d.]+);", line)
        assert peak and per_round and float(per_round.group(1)) > 0
        assert 50 < float(peak.group(1)) * (1024 if peak.group(2) == "GiB" else 1) < 16 * 1024  # MiB
    assert not (tmp_path / "runs" / "fedcli.db").exists()  # a dry run stores nothing
    assert "fed_emnist.tar.bz2" in out.stdout + out.stderr  # where the files come from


def test_dry_run_without_the_files_says_which_are_missing(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    out = _fedcli(
        "sweep",
        "--recipe",
        "fedpa-table3-cifar100",
        "--smoke",
        "--dry-run",
        "--data-dir",
        str(tmp_path / "empty"),
        "--root",
        str(tmp_path / "runs"),
        "--no-mlflow",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    failed = [line for line in out.stdout.splitlines() if "probe failed" in line]
    assert failed and "fed_cifar100_train.h5" in failed[0] and "not found" in failed[0]
