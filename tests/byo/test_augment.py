"""data.augment (datasets/augment.py): batched crop / flip drawn from the step key, the same on every
back end and after a kill and resume; normalisation on training and evaluation; evaluation never
augmented; refusals (fused, non-image data, bad items) in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from fedcli.config.build import build_config
from fedcli.datasets import augment
from fedcli.datasets.yours.data import data_ref
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.evaluation import evaluate
from fedcli.engine.rounds import Timing, run_round
from fedcli.engine.setup import build
from fedcli.errors import ConfigError
from fedcli.tracking.store.sql_store import SqlStore


def images(n: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 256, (n, 3, 8, 8), generator=g, dtype=torch.uint8),
        torch.randint(0, 4, (n,), generator=g),
    )


def reference(x: torch.Tensor, key: torch.Tensor, pad: int) -> torch.Tensor:
    """The same crop and flip written one example at a time (what the batched version must equal)."""
    h = augment.draws(key, len(x))
    out = []
    for b in range(len(x)):
        dy, dx, mirror = int(h[b] % (2 * pad + 1)), int((h[b] >> 20) % (2 * pad + 1)), int((h[b] >> 40) & 1)
        padded = torch.nn.functional.pad(x[b], (pad, pad, pad, pad))
        crop = padded[:, dy : dy + x.shape[-2], dx : dx + x.shape[-1]]
        out.append(crop.flip(-1) if mirror else crop)
    return torch.stack(out)


def test_batched_crop_and_flip_equal_the_per_example_reference() -> None:
    x = torch.randn(32, 3, 8, 8)
    key = torch.tensor(123456789, dtype=torch.int64)
    got = augment.augmenter(augment.parse(["crop:2", "flip"]))(x, key)
    assert torch.equal(got, reference(x, key, 2))
    h = augment.draws(key, 32)
    assert len(set((h % 5).tolist())) > 1 and 0 < int(((h >> 40) & 1).sum()) < 32  # crops vary, some flipped


def test_draws_are_a_pure_function_of_the_key_and_the_slot_and_vmap_needs_no_randomness() -> None:
    key = torch.tensor(-987654321012345, dtype=torch.int64)
    assert torch.equal(augment.draws(key, 16), augment.draws(key, 16))
    assert torch.equal(
        augment.draws(key, 16)[:8], augment.draws(key, 8)
    )  # slot b's draw: not the batch size's
    assert not torch.equal(augment.draws(key, 16), augment.draws(key + 1, 16))
    assert bool((augment.draws(key, 16) >= 0).all())
    fn = augment.augmenter(augment.parse(["crop:3", "flip"]))
    xs, keys = torch.randn(5, 8, 3, 8, 8), torch.arange(5, dtype=torch.int64) * 7919
    batched = torch.func.vmap(fn)(xs, keys)
    assert torch.equal(batched, torch.stack([fn(xs[c], keys[c]) for c in range(5)]))


def rounds(ref: str, executor: str, aug: list[str] | None, n: int = 2) -> tuple[dict, dict]:
    overrides = {
        "data.file": ref,
        "data.model": "cnn",
        "algorithm.name": "fedavg",
        "train.clients_per_round": 3,
        "train.device": "cpu",
        "train.executor": executor,
        "train.workers": 2,
        "train.batch_size": 8,
    }
    setup = build(build_config(overrides={**overrides, "data.augment": aug}))
    try:
        state, store = setup.alg.server_init(setup.init_params, setup.hp, setup.opt), ClientStateStore(None)
        for round_idx in range(1, n + 1):
            state, _ = run_round(setup, state, store, round_idx, Timing())
        params = setup.alg.global_params(state)
        return params, evaluate(
            setup.task, setup.fns, setup.init_params, setup.data.test_x, setup.data.test_y
        )
    finally:
        setup.backend.close()


def test_torch_dataset_with_augmentation_is_the_same_on_loop_vmap_and_process() -> None:
    x, y = images()
    ref = data_ref(TensorDataset(x, y), name="pictures", client=np.arange(len(y)) % 6)
    aug = ["crop:2", "flip"]
    loop, loop_eval = rounds(ref, "loop", aug)
    process, _ = rounds(ref, "process", aug)
    vmap, _ = rounds(ref, "vmap", aug)
    plain, plain_eval = rounds(ref, "loop", None)
    for name, tensor in loop.items():
        assert torch.equal(process[name], tensor), name  # the same kernels in a worker: bit-equal
        torch.testing.assert_close(
            vmap[name], tensor, rtol=1e-5, atol=1e-6
        )  # batched kernels: float tolerance
    assert any(not torch.allclose(plain[k], loop[k]) for k in loop)  # the augmentation changed training
    assert plain_eval == loop_eval  # evaluation never augmented


def test_normalisation_applies_to_training_and_evaluation_inputs() -> None:
    x, y = images(40)
    ref = data_ref(TensorDataset(x, y), name="pictures-norm", client=np.arange(len(y)) % 4)
    base = {"data.file": ref, "data.model": "cnn", "train.clients_per_round": 2, "train.device": "cpu"}
    plain = build(build_config(overrides=base))
    normed = build(build_config(overrides={**base, "data.augment": ["normalize:0.5/0.4/0.3:0.25/0.2/0.1"]}))
    want = (plain.fns.prepare(x[:4]) - torch.tensor([0.5, 0.4, 0.3]).view(-1, 1, 1)) / torch.tensor(
        [0.25, 0.2, 0.1]
    ).view(-1, 1, 1)
    torch.testing.assert_close(normed.fns.prepare(x[:4]), want)
    assert normed.fns.augment is None and plain.fns.augment is None  # nothing random: the step is unchanged


def test_refusals_are_one_line() -> None:
    x, y = images(40)
    ref = data_ref(TensorDataset(x, y), name="pictures-refused", client=np.arange(len(y)) % 4)
    base = {
        "data.file": ref,
        "data.model": "mlp",
        "train.clients_per_round": 2,
        "train.device": "cpu",
        "data.augment": ["crop:2"],
    }
    with pytest.raises(ConfigError, match="fused gathers its own batches"):
        build(build_config(overrides={**base, "train.executor": "fused"}))
    assert build(build_config(overrides=base)).executor != "fused"  # auto picks one that augments
    for bad, message in (
        (["crop:0"], "padding of >= 1"),
        (["rotate"], "not an operation"),
        (["normalize:0.5:0"], "std > 0"),
    ):
        with pytest.raises(ConfigError, match=message):
            build_config(overrides={**base, "data.augment": bad})
    features = data_ref(
        TensorDataset(torch.randn(30, 5), torch.zeros(30).long()), name="flat", client=np.arange(30) % 3
    )
    with pytest.raises(ConfigError, match=r"needs images \[C, H, W\]"):
        build(build_config(overrides={**base, "data.file": features}))


def test_augmented_run_killed_and_resumed_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    """SIGKILL mid-run (a real process), then --resume in a new process: bit-exact final model.

    Rounds on 120 pictures take milliseconds: 150 of them so the kill at round >= 3 lands mid-run
    (12 rounds all finished before the poll saw round 3 in CI).
    """
    rounds = "150"
    x, y = images(120)
    torch.save({"x": x, "y": y}, tmp_path / "pictures.pt")
    (tmp_path / "pictures.py").write_text(
        "import numpy as np, torch\nfrom torch.utils.data import TensorDataset\n\n\n"
        "def load():\n    d = torch.load('pictures.pt', weights_only=True)\n"
        "    return {'data': TensorDataset(d['x'], d['y']), 'client': np.arange(len(d['y'])) % 8}\n"
    )
    (tmp_path / "run.yaml").write_text("data:\n  augment: [crop:2, flip]\n")
    args = [
        "-q",
        "train",
        "--data",
        "pictures.py:load",
        "--model",
        "mlp",
        "--config",
        "run.yaml",
        "--rounds",
        rounds,
        "--clients-per-round",
        "3",
        "--batch-size",
        "8",
        "--executor",
        "loop",
        "--no-mlflow",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def fedcli(root: Path, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "fedcli", *args, "--root", str(root), *extra],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    whole = fedcli(tmp_path / "ref")
    assert whole.wait(timeout=600) == 0, whole.stderr.read() if whole.stderr else ""
    ref_db = SqlStore(f"sqlite:///{tmp_path / 'ref' / 'fedcli.db'}")
    ref_id = ref_db.list_runs()[0].id

    root = tmp_path / "killed"
    victim = fedcli(root)
    deadline, run_id = time.monotonic() + 300, None
    while run_id is None and time.monotonic() < deadline:
        if (root / "fedcli.db").exists():
            db = SqlStore(f"sqlite:///{root / 'fedcli.db'}")
            run_id = next((r.id for r in db.list_runs() if (db.last_round(r.id) or 0) >= 3), None)
        time.sleep(0.05)
    assert run_id is not None, "the run never reached round 3"
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    db = SqlStore(f"sqlite:///{root / 'fedcli.db'}")
    assert (db.last_round(run_id) or 0) < int(rounds), "killed too late to test a resume"
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            "--root",
            str(root),
            "--resume",
            run_id[:8],
            "--data",
            "pictures.py:load",
        ],  # its data function named again (issue 35)
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr
    want = torch.load(tmp_path / "ref" / "runs" / ref_id / "model.pt", weights_only=True)["params"]
    got = torch.load(root / "runs" / run_id / "model.pt", weights_only=True)["params"]
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert db.get_run(run_id).config["data"]["augment"] == ["crop:2", "flip"]


def test_the_served_model_normalises_as_training_did(tmp_path: Path) -> None:
    """The MLflow model (tracking/served.py) of a run with normalize applies it: same inputs as evaluation."""
    from fedcli.engine.train import train
    from fedcli.tracking.served import load_served, read_model_file, write_served
    from fedcli.tracking.sinks import Tracker

    x, y = images(40)
    np.savez(tmp_path / "pictures.npz", x=x.numpy(), y=y.numpy(), client=np.arange(40) % 4)
    url = f"sqlite:///{tmp_path / 's.db'}"
    cfg = build_config(
        overrides={
            "data.file": str(tmp_path / "pictures.npz"),
            "data.model": "cnn",
            "train.rounds": 1,
            "train.clients_per_round": 2,
            "train.device": "cpu",
            "tracking.root": str(tmp_path),
            "tracking.store": url,
            "tracking.use_mlflow": False,
            "data.augment": ["normalize:0.5:0.25", "flip"],
        }
    )
    result = train(cfg, tracker=Tracker(SqlStore(url)))
    write_served(read_model_file(result.model_path), tmp_path / "served.pt")
    served = load_served(tmp_path / "served.pt")
    setup = build(cfg)
    torch.testing.assert_close(served.prepare(x[:4]), setup.fns.prepare(x[:4]))
    assert not torch.allclose(served.prepare(x[:4]), x[:4].float() / 255)  # normalised, not the raw scaling


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh runs it on a GPU)"
)
def test_crops_and_flips_on_cuda_equal_the_cpu_ones() -> None:
    """The int64 hash wraps the same way on the GPU: every back end on every device draws the same."""
    fn = augment.augmenter(augment.parse(["crop:4", "flip"]))
    x, keys = torch.randn(6, 16, 3, 12, 12), torch.arange(6, dtype=torch.int64) * 104729 - 3
    cpu = torch.func.vmap(fn)(x, keys)
    cuda = torch.func.vmap(fn)(x.cuda(), keys.cuda()).cpu()
    assert torch.equal(cpu, cuda)
