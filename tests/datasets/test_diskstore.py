"""The disk data store (issue 32 item 1): same results as memory, streamed TFF files, safe builds.

Real files throughout: the bundled FEMNIST / MNIST, TFF h5 federations written by
`python -m fedcli.datasets.formats.generate`'s `generate`, stores built by real subprocesses (two at
once, one killed with SIGKILL), a 2 MiB tmpfs for the full disk (skipped where it cannot be
mounted) and the `fedcli` CLI for the one-line errors.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

from fedcli.config.build import build_config
from fedcli.datasets.bundled.stackoverflow import (
    BOS,
    EOS,
    LR_TAGS,
    LR_VOCAB,
    NWP_LENGTH,
    OOV,
    PAD,
    lr_rows,
    nwp_rows,
)
from fedcli.datasets.federated import DiskData, MemoryData
from fedcli.datasets.formats import diskstore
from fedcli.datasets.formats.generate import generate
from fedcli.datasets.registry import TASKS
from fedcli.datasets.tasks import TaskOptions
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.evaluation import evaluate
from fedcli.engine.rounds import Timing, run_round
from fedcli.engine.setup import build
from fedcli.errors import ConfigError, DataError
from tests.datasets._format_writers import write_leaf

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test builds its stores in its own cache folder (FEDCLI_DATA_CACHE)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("FEDCLI_DATA_CACHE", str(root))
    return root


def _run(task: str, store: str, executor: str, rounds: int = 3, **extra: object) -> dict[str, Any]:
    cfg = build_config(
        overrides={
            "algorithm.name": "fedavg",
            "data.task": task,
            "train.clients_per_round": 5,
            "train.batch_size": 10,
            "train.executor": executor,
            "train.rounds": rounds,
            "data.data_store": store,
            "train.device": "cpu",
            "train.threads": 1,
            **extra,
        }
    )
    setup = build(cfg)
    state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    rows = []
    for r in range(1, rounds + 1):
        state, metrics = run_round(setup, state, ClientStateStore(None), r, Timing())
        rows.append(metrics)
    params = setup.alg.global_params(state)
    scores = evaluate(setup.task, setup.fns, params, setup.data.test_x, setup.data.test_y)
    return {
        "fed": setup.fed,
        "rounds": rows,
        "eval": scores,
        "params": params,
        "fingerprint": setup.data.fingerprint,
    }


@pytest.mark.parametrize(
    ("task", "executor"),
    [("femnist", "loop"), ("femnist", "vmap"), ("mnist", "loop"), ("mnist", "vmap"), ("mnist", "fused")],
)
def test_disk_store_gives_the_in_memory_metrics_bit_for_bit(task: str, executor: str, cache: Path) -> None:
    memory = _run(task, "memory", executor)
    disk = _run(task, "disk", executor)
    assert isinstance(memory["fed"], MemoryData) and isinstance(disk["fed"], DiskData)
    assert len(list(cache.iterdir())) >= 1  # the store was built there
    assert disk["rounds"] == memory["rounds"]  # every round's metrics, as floats: bit for bit
    assert disk["eval"] == memory["eval"]
    assert all(torch.equal(disk["params"][k], memory["params"][k]) for k in memory["params"])
    assert disk["fingerprint"] == memory["fingerprint"]
    assert memory["rounds"][0] != memory["rounds"][-1]  # the rounds trained (not a constant to agree on)


def test_disk_plan_reads_only_the_cohort_and_remaps_its_indices(cache: Path) -> None:
    data = TASKS["femnist"].load(TaskOptions())
    stored = diskstore.store_task_data(data, "femnist")
    fed = DiskData(stored.x, stored.y, stored.client_indices, torch.device("cpu"))
    mem = MemoryData(data.x, data.y, data.client_indices, torch.device("cpu"))
    cohort = np.array([3, 7, 1])
    rngs = [np.random.default_rng(c) for c in cohort]
    plan = fed.plan(cohort, num_epochs=2, batch_size=16, rngs=rngs)
    ref = mem.plan(cohort, num_epochs=2, batch_size=16, rngs=[np.random.default_rng(c) for c in cohort])
    assert plan.data is not None and ref.data is None
    assert len(plan.data.x) == len({0, *np.concatenate([data.client_indices[c] for c in cohort]).tolist()})
    assert torch.equal(plan.data.x[plan.index], mem.x[ref.index])  # every slot, padding included
    assert torch.equal(plan.data.y[plan.index], mem.y[ref.index])
    assert torch.equal(plan.weight, ref.weight) and torch.equal(plan.step_mask, ref.step_mask)


def test_auto_picks_disk_above_the_stated_threshold() -> None:
    from fedcli.datasets.federated import AUTO_DISK_BYTES, choose_store

    assert AUTO_DISK_BYTES == 1 << 30  # docs/scaling.md states 1 GiB
    assert choose_store("auto", AUTO_DISK_BYTES, False) == "memory"
    assert choose_store("auto", AUTO_DISK_BYTES + 1, False) == "disk"
    assert choose_store("auto", 10, True) == "disk"  # a loader that streamed its files into a store
    assert choose_store("memory", AUTO_DISK_BYTES * 4, False) == "memory"
    assert choose_store("disk", 10, False) == "disk"


def test_auto_picks_memory_for_small_data_and_disk_runs_refuse_compiled_back_ends(cache: Path) -> None:
    assert isinstance(_run("mnist", "auto", "vmap", rounds=1)["fed"], MemoryData)
    with pytest.raises(ConfigError, match="disk data store .* --executor loop\\|vmap\\|fused"):
        _run("mnist", "disk", "process", rounds=1)


def test_cli_train_and_evaluate_take_data_store_recorded_with_the_run(tmp_path: Path, cache: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    root = tmp_path / "runs"
    trained = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            "--task",
            "mnist",
            "--data-store",
            "disk",
            "--rounds",
            "2",
            "--clients-per-round",
            "4",
            "--no-mlflow",
            "--root",
            str(root),
            "--run-name",
            "ondisk",
            "--executor",
            "vmap",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    assert trained.returncode == 0, trained.stderr
    assert [p for p in cache.iterdir() if not p.name.startswith(".")]  # the store the run read
    from fedcli.config.sections import config_hash_of
    from fedcli.tracking.store.sql_store import SqlStore

    with SqlStore(f"sqlite:///{root / 'fedcli.db'}") as db:
        record = db.get_run("ondisk")
    assert record.config["data"]["data_store"] == "disk"
    # a drawn partition (mnist: Dirichlet) is kept beside the run whatever the store
    assert (root / "runs" / record.id / "partition.json").is_file()
    plain = build_config(overrides={"data.task": "mnist"}).to_dict()
    assert config_hash_of({**plain, "data": {**plain["data"], "data_store": "disk"}}) == config_hash_of(plain)
    scores = {}
    for store in ("memory", "disk"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "fedcli",
                "-q",
                "evaluate",
                "ondisk",
                "--data-store",
                store,
                "--json",
                "--no-mlflow",
                "--root",
                str(root),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr
        scores[store] = json.loads(proc.stdout)["metrics"]
    assert scores["memory"] == scores["disk"] and scores["disk"]["test/accuracy"] > 0.0, scores


def test_a_natural_partition_on_the_disk_store_writes_no_partition_file(tmp_path: Path, cache: Path) -> None:
    """The natural clients of a disk-stored source are the store's own index: no JSON copy of every example
    index beside the run (206 MB for 20,000 StackOverflow clients), and the run still trains."""
    root = tmp_path / "runs"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            "--task",
            "femnist",
            "--data-store",
            "disk",
            "--rounds",
            "1",
            "--clients-per-round",
            "3",
            "--no-mlflow",
            "--root",
            str(root),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    run_id = proc.stdout.strip().splitlines()[-1]
    assert (root / "runs" / run_id).is_dir() and not (root / "runs" / run_id / "partition.json").exists()


# ----------------------------------------------------------------------------- TFF h5 streaming


def _leftovers(root: Path) -> list[str]:
    """What a failed build left in the cache root besides lock files (nothing, if it is absent)."""
    return [p.name for p in root.iterdir() if not p.name.endswith(".lock")] if root.exists() else []


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.to(torch.float64), b.to(torch.float64))


@pytest.mark.parametrize(
    ("task", "fmt"),
    [
        ("stackoverflow-nwp", "stackoverflow"),
        ("stackoverflow-lr", "stackoverflow"),
        ("emnist", "emnist"),
        ("cifar100", "cifar100"),
    ],
)
def test_tff_tasks_stream_into_a_store_with_the_in_memory_examples(
    task: str, fmt: str, tmp_path: Path, cache: Path
) -> None:
    generate(fmt, 25, tmp_path / fmt, seed=3, mean_size=6, sigma=1.0)
    memory = TASKS[task].load(TaskOptions(data_dir=tmp_path / fmt, data_store="memory"))
    disk = TASKS[task].load(TaskOptions(data_dir=tmp_path / fmt, data_store="disk"))
    assert memory.store is None and disk.store is not None and Path(disk.store).parent == cache
    for name in ("x", "y", "test_x", "test_y"):
        assert _equal(getattr(memory, name), getattr(disk, name)), name
    if task.startswith("stackoverflow"):
        assert disk.x.dtype == torch.int16 and memory.x.dtype == torch.int64  # compact token ids
    assert disk.fingerprint == memory.fingerprint and disk.client_names == memory.client_names
    assert [c.tolist() for c in disk.client_indices] == [c.tolist() for c in memory.client_indices]
    assert [c.tolist() for c in disk.test_client_indices] == [c.tolist() for c in memory.test_client_indices]
    again = TASKS[task].load(TaskOptions(data_dir=tmp_path / fmt, data_store="disk"))
    assert again.store == disk.store  # reused, not rebuilt
    assert json.loads((Path(disk.store) / "meta.json").read_text())["built_by"] == os.getpid()


def nwp_ids(tokens: str, vocab: dict[str, int]) -> np.ndarray:
    """The per-sentence reference: [BOS, w_1..w_20, EOS] padded to 21 ids (pad 0, words 1..V, OOV V+1)."""
    words = tokens.split(" ")[:NWP_LENGTH]
    ids = [BOS] + [vocab[w] + 1 if w in vocab else OOV for w in words] + [EOS]
    ids = ids[: NWP_LENGTH + 1]
    return np.array(ids + [PAD] * (NWP_LENGTH + 1 - len(ids)), dtype=np.int64)


def lr_example(
    tokens: str, title: str, tags: str, vocab: dict[str, int], tag_ids: dict[str, int]
) -> tuple[np.ndarray, np.ndarray]:
    """The per-example reference: token ids of "tokens title" (OOV = V) and the multi-hot of the known tags."""
    ids = np.array([vocab.get(w, LR_VOCAB) for w in f"{tokens} {title}".split(" ")], dtype=np.int64)
    target = np.zeros(LR_TAGS, dtype=np.float32)
    target[[tag_ids[t] for t in tags.split("|") if t in tag_ids]] = 1.0
    return ids, target


def test_vectorised_stackoverflow_preprocessing_matches_the_per_sentence_one() -> None:
    vocab = {"the": 0, "a": 1, "python": 2, "error": 3}
    tags = {"python": 0, "java": 1}
    texts = [
        "the python error",
        "a zebra",
        "",
        "the  a",
        " ".join(["python"] * 25),
        "x " * 19 + "x",
        "error the a python the a python the a python the a python the a python the a",
    ]
    got = nwp_rows([t.encode() for t in texts], vocab)
    assert got.dtype == np.int16
    assert np.array_equal(got, np.stack([nwp_ids(t, vocab) for t in texts]))
    titles, tag_text = (
        ["python", "", "the", "a a", "t", "u", "v"],
        ["python|java", "ruby", "", "java", "|", "x", "python"],
    )
    x, y = lr_rows(
        [t.encode() for t in texts], [t.encode() for t in titles], [t.encode() for t in tag_text], vocab, tags
    )
    rows = [lr_example(a, b, c, vocab, tags) for a, b, c in zip(texts, titles, tag_text, strict=True)]
    for i, (ids, target) in enumerate(rows):
        assert x[i, : len(ids)].tolist() == ids.tolist() and (x[i, len(ids) :] == -1).all()
        assert np.array_equal(y[i], target.astype(np.uint8))


def test_a_changed_source_file_rebuilds_its_store(tmp_path: Path, cache: Path) -> None:
    generate("emnist", 8, tmp_path / "em", seed=1, mean_size=5, sigma=0.2)
    options = TaskOptions(data_dir=tmp_path / "em", data_store="disk")
    first = TASKS["emnist"].load(options)
    with h5py.File(tmp_path / "em" / "fed_emnist_train.h5", "a") as h5:  # one more writer, same size class
        group = h5.create_group("examples/zz_new")
        group.create_dataset("pixels", data=np.zeros((3, 28, 28), np.float32))
        group.create_dataset("label", data=np.array([1, 2, 3], np.int32))
    second = TASKS["emnist"].load(options)
    assert second.store != first.store
    assert len(second.client_names) == len(first.client_names) + 1 and second.client_names[-1] == "zz_new"
    assert (
        second.fingerprint
        == TASKS["emnist"].load(TaskOptions(data_dir=tmp_path / "em", data_store="memory")).fingerprint
    )


def test_a_corrupt_h5_names_the_file_and_the_client(tmp_path: Path) -> None:
    path = tmp_path / "fed_emnist_train.h5"
    with h5py.File(path, "w") as h5:
        for cid in ("a", "b", "c"):
            group = h5.create_group(f"examples/{cid}")
            group.create_dataset(
                "pixels",
                data=np.random.default_rng(0).random((40, 28, 28), dtype=np.float32),
                compression="gzip",
                chunks=(40, 28, 28),
            )
            group.create_dataset("label", data=np.arange(40, dtype=np.int32))
    with h5py.File(path, "r") as h5:
        offset = h5["examples/b/pixels"].id.get_chunk_info(0).byte_offset
    with path.open("r+b") as fh:  # scribble over client b's compressed pixels
        fh.seek(offset + 16)
        fh.write(b"\xff" * 512)
    (tmp_path / "fed_emnist_test.h5").write_bytes(path.read_bytes())
    with pytest.raises(
        DataError, match=r"fed_emnist_train.h5 is truncated or corrupted: reading stopped at client 'b'"
    ):
        TASKS["emnist"].load(TaskOptions(data_dir=tmp_path, data_store="disk"))
    assert _leftovers(Path(os.environ["FEDCLI_DATA_CACHE"])) == []
    truncated = tmp_path / "cut"
    truncated.mkdir()
    (truncated / "fed_emnist_train.h5").write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    (truncated / "fed_emnist_test.h5").write_bytes(path.read_bytes())
    with pytest.raises(DataError, match=r"cut/fed_emnist_train.h5 cannot be read as HDF5 .*truncated"):
        TASKS["emnist"].load(TaskOptions(data_dir=truncated, data_store="disk"))


# ----------------------------------------------------------------------------- LEAF JSON streaming


def _tweets(k: int) -> list[object]:
    words = ["good", "bad", "day", "so", "meh", "!", "ok", "why"]
    return [
        ["1", "date", "NO_QUERY", "user", " ".join(words[(k + j) % 8] for j in range(k % 5 + 1))]
        for k in range(k)
    ]


@pytest.mark.parametrize(
    ("task", "fmt"), [("femnist", "leaf-femnist"), ("shakespeare", "leaf-shakespeare"), ("sent140", None)]
)
def test_leaf_tasks_stream_one_file_at_a_time_into_the_in_memory_arrays(
    task: str, fmt: str | None, tmp_path: Path
) -> None:
    folder = tmp_path / task
    if fmt is not None:
        generate(fmt, 30, folder, seed=2, mean_size=6, sigma=0.5)
    else:  # users spread over two files (and a .gz), in no sorted order; u9 has no test examples
        write_leaf(
            folder / "train" / "a.json", {"u5": (_tweets(4), [1, 0, 1, 0]), "u1": (_tweets(3), [0, 1, 1])}
        )
        write_leaf(
            folder / "train" / "b.json.gz", {"u3": (_tweets(5), [1, 1, 0, 0, 1]), "u9": (_tweets(2), [0, 0])}
        )
        write_leaf(folder / "test" / "t.json", {"u3": (_tweets(2), [1, 0]), "u1": (_tweets(1), [1])})
    max_clients = 3 if task != "femnist" else None
    memory = TASKS[task].load(TaskOptions(data_dir=folder, data_store="memory", max_clients=max_clients))
    disk = TASKS[task].load(TaskOptions(data_dir=folder, data_store="disk", max_clients=max_clients))
    assert memory.store is None and disk.store is not None
    for name in ("x", "y", "test_x", "test_y"):
        assert _equal(getattr(memory, name), getattr(disk, name)), name
    assert disk.fingerprint == memory.fingerprint and disk.client_names == memory.client_names
    assert disk.num_classes == memory.num_classes
    assert [c.tolist() for c in disk.client_indices] == [c.tolist() for c in memory.client_indices]
    assert [c.tolist() for c in disk.test_client_indices] == [c.tolist() for c in memory.test_client_indices]
    if max_clients is not None:
        assert len(disk.client_names) == max_clients


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_a_truncated_leaf_file_names_the_file_and_the_user_where_reading_stopped(
    suffix: str, tmp_path: Path
) -> None:
    users = {f"f{k:04d}": (_tweets(3), [0, 1, 0]) for k in range(6)}
    path = tmp_path / "train" / f"all{suffix}"
    write_leaf(path, users)
    write_leaf(tmp_path / "test" / "t.json", {"f0000": (_tweets(1), [1])})
    text = path.read_bytes() if suffix == ".json" else gzip.decompress(path.read_bytes())
    cut = text.index(b'"f0004": {') + 30  # inside user f0004's examples
    packed = gzip.compress(text)
    path.write_bytes(text[:cut] if suffix == ".json" else packed[: len(packed) * 2 // 3])
    if suffix == ".json.gz":  # the gzip stream ends early: where it stops depends on compression; find it
        partial = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(path.read_bytes())
        expected = sorted(u for u in users if f'"{u}": {{'.encode() in partial)[-1]
    else:
        expected = "f0004"
    with pytest.raises(
        DataError,
        match=rf"LEAF file .*all{suffix} is not valid .* reading stopped at user "
        rf"'{expected}'",
    ):
        TASKS["sent140"].load(TaskOptions(data_dir=tmp_path, data_store="disk"))
    assert _leftovers(Path(os.environ["FEDCLI_DATA_CACHE"])) == []


# ----------------------------------------------------------------------------- concurrent, killed, full disk

BUILDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import numpy as np
    from fedcli.datasets.formats import diskstore

    root, mode = Path(sys.argv[1]), sys.argv[2]

    def fill(writer):
        print("filling", flush=True)
        for k in range(20):
            writer.append("x", np.full((1000, 8), k, np.int64))
            writer.flush()
            time.sleep(0.05 if mode == "slow" else 10.0)
        return {"fingerprint": "f"}

    folder = diskstore.build_store("k" * 32, "the test data", fill, root)
    x = diskstore.open_store(folder).arrays["x"]
    print("read", x.shape[0], int(x[-1, 0]), flush=True)
""")


def _builder(root: Path, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", BUILDER, str(root), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def test_two_builds_of_one_store_at_once_build_it_once(tmp_path: Path) -> None:
    root = tmp_path / "root"
    procs = [_builder(root, "slow"), _builder(root, "slow")]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1] for o in outs]
    fills = sum(out.count("filling") for out, _ in outs)
    assert fills == 1  # the second waited on the lock, then reused the store
    assert all("read 20000 19" in out for out, _ in outs)  # neither read a half store
    assert sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) == ["k" * 32]


def test_a_killed_build_leaves_nothing_a_later_run_uses(tmp_path: Path) -> None:
    root = tmp_path / "root"
    proc = _builder(root, "hang")
    assert proc.stdout is not None and proc.stdout.readline().strip() == "filling"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    leftovers = [p for p in root.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")]
    assert leftovers and not (root / ("k" * 32)).exists()  # a half build, never renamed into place
    out, err = _builder(root, "slow").communicate(timeout=120)
    assert "filling" in out and "read 20000 19" in out, err  # rebuilt whole, not the half one
    assert not [p for p in root.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")]


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "tmpfs"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=False)


def test_a_full_disk_is_one_line_naming_the_folder_exit_2(tiny_tmpfs: Path, tmp_path: Path) -> None:
    env = {**os.environ, "FEDCLI_DATA_CACHE": str(tiny_tmpfs), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            "--task",
            "mnist",
            "--data-store",
            "disk",
            "--rounds",
            "1",
            "--no-mlflow",
            "--root",
            str(tmp_path / "runs"),
            "--executor",
            "vmap",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"no space left in {tiny_tmpfs}" in lines[0]
    assert [p.name for p in tiny_tmpfs.iterdir() if not p.name.endswith(".lock")] == []  # no half store
