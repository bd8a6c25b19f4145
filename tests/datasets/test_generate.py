"""datasets/formats/generate.py: synthetic federations in the real formats load with fedcli's own loaders."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedcli.datasets.formats.generate import DEFAULTS, Joiner, client_sizes, generate
from fedcli.datasets.registry import TASKS
from fedcli.datasets.tasks import TaskOptions

pytest.importorskip("h5py")


def _sizes(indices: list[np.ndarray]) -> list[int]:
    return [len(i) for i in indices]


def _h5_sizes(path: Path, field: str) -> dict[str, int]:
    import h5py

    with h5py.File(path, "r") as h5:
        return {cid: len(h5["examples"][cid][field]) for cid in h5["examples"]}


def test_stackoverflow_loads_with_the_tff_loaders(tmp_path: Path) -> None:
    summary = generate("stackoverflow", 57, tmp_path, seed=3, mean_size=12)
    written = _h5_sizes(tmp_path / "stackoverflow_train.h5", "tokens")
    assert len(written) == 57 and sum(written.values()) == summary["examples"]["stackoverflow_train.h5"]
    assert (tmp_path / "stackoverflow_held_out.h5").exists()
    nwp = TASKS["stackoverflow-nwp"].load(TaskOptions(data_dir=tmp_path))
    assert len(nwp.client_names) == 57
    assert _sizes(nwp.client_indices) == [written[c] for c in sorted(written)]
    assert nwp.x.shape == (sum(written.values()), 20)
    # Zipf words over a 20,000-word vocabulary: frequent words get ids, some are OOV (10001)
    assert (nwp.x[:, 1] <= 10000).float().mean() > 0.5 and (nwp.x == 10001).any()
    test = _h5_sizes(tmp_path / "stackoverflow_test.h5", "tokens")
    assert nwp.test_x.shape[0] == sum(test.values()) > 0
    lr = TASKS["stackoverflow-lr"].load(TaskOptions(data_dir=tmp_path, max_clients=20))
    assert len(lr.client_names) == 20 and lr.y.shape[1] == 500 and lr.y.sum() > 0


def test_stackoverflow_sizes_are_skewed_and_seeded(tmp_path: Path) -> None:
    sizes = client_sizes(np.random.default_rng(0), 20000, DEFAULTS["stackoverflow"])
    assert abs(sizes.mean() / DEFAULTS["stackoverflow"].mean - 1) < 0.15
    assert np.median(sizes) < sizes.mean() / 3  # heavy tail: median far below the mean
    a = generate("stackoverflow", 9, tmp_path / "a", seed=5, mean_size=4)
    b = generate("stackoverflow", 9, tmp_path / "b", seed=5, mean_size=4)
    c = generate("stackoverflow", 9, tmp_path / "c", seed=6, mean_size=4)
    train = "stackoverflow_train.h5"
    assert (tmp_path / "a" / train).read_bytes() == (tmp_path / "b" / train).read_bytes()
    assert a["examples"] == b["examples"]
    assert _h5_sizes(tmp_path / "a" / train, "tokens") != _h5_sizes(tmp_path / "c" / train, "tokens")
    assert c["clients"] == 9


def test_emnist_and_cifar100_load_with_the_tff_loaders(tmp_path: Path) -> None:
    generate("emnist", 23, tmp_path / "emnist", seed=1, mean_size=15)
    written = _h5_sizes(tmp_path / "emnist" / "fed_emnist_train.h5", "pixels")
    data = TASKS["emnist"].load(TaskOptions(data_dir=tmp_path / "emnist"))
    assert len(data.client_names) == 23 and _sizes(data.client_indices) == [
        written[c] for c in sorted(written)
    ]
    assert data.x.dtype.is_floating_point is False and data.x.shape[1:] == (28, 28)
    assert int(data.y.max()) < 62 and len(set(data.y.tolist())) > 10
    assert (
        data.test_client_indices is not None and sum(_sizes(data.test_client_indices)) == len(data.test_y) > 0
    )
    generate("cifar100", 12, tmp_path / "cifar", seed=1, mean_size=7)
    cifar = TASKS["cifar100"].load(TaskOptions(data_dir=tmp_path / "cifar"))
    assert len(cifar.client_names) == 12 and _sizes(cifar.client_indices) == [7] * 12
    assert cifar.x.shape[1:] == (3, 32, 32) and int(cifar.y.max()) < 100


def test_leaf_femnist_and_shakespeare_load_with_the_leaf_loaders(tmp_path: Path) -> None:
    generate("leaf-femnist", 14, tmp_path / "femnist", seed=2, mean_size=6)
    doc = json.loads(next((tmp_path / "femnist" / "train").glob("*.json")).read_text())
    data = TASKS["femnist"].load(TaskOptions(data_dir=tmp_path / "femnist"))
    assert len(data.client_names) == 14
    assert _sizes(data.client_indices) == [
        doc["num_samples"][doc["users"].index(u)] for u in data.client_names
    ]
    assert data.x.shape[1:] == (28, 28)
    generate("leaf-shakespeare", 6, tmp_path / "shakespeare", seed=2, mean_size=5)
    text = TASKS["shakespeare"].load(TaskOptions(data_dir=tmp_path / "shakespeare"))
    assert (
        len(text.client_names) == 6
        and text.x.shape[1] == 80
        and sum(_sizes(text.client_indices)) == len(text.y)
    )


def test_joiner_matches_python_join() -> None:
    words = [b"a", b"bb", b"ccc", b""]
    ids = np.array([2, 0, 1, 3, 1, 1])
    got = Joiner(words, b", ").join(ids, np.array([1, 3, 2]))
    assert got == [b"ccc", b"a, bb, ", b"bb, bb"]


def test_cli_writes_files_and_rejects_bad_input(tmp_path: Path) -> None:
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli.datasets.formats.generate",
            "emnist",
            "--clients",
            "5",
            "--out",
            str(tmp_path / "e"),
            "--mean-size",
            "3",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["clients_per_split"]["fed_emnist_train.h5"] == 5
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli.datasets.formats.generate",
            "emnist",
            "--clients",
            "0",
            "--out",
            str(tmp_path / "z"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--clients" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "z").exists()
