"""Stock torch layers under the cohort back ends (issue 37 item 1; docs/bring-your-own.md, "Stock layers").

In-process tests check datasets/stock_layers.py against PyTorch's own layers and per-client calls
against one vmapped call; the CLI tests run `python -m fedcli train` subprocesses on a small
HAR-shaped .npz (windows of 32 steps x 9 channels) with models written into the test's folder,
as a user writes them: a GRU, a Conv1d + BatchNorm + Dropout CNN, a model whose forward calls
`.item()` (vmap cannot run it) and one that packs its sequences.
"""

from __future__ import annotations

import math
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from fedcli.datasets.stock_layers import StockLayers, needs_stock_layers
from fedcli.datasets.yours.model import check_model, vmap_obstacle
from tests.byo.test_user_model import fedcli, final_params, reference_and_killed, store

MODELS = """
import torch
from torch import nn
import torch.nn.functional as F


class GRUNet(nn.Module):
    def __init__(self, num_classes, input_shape):
        super().__init__()
        self.gru = nn.GRU(input_shape[-1], 16, batch_first=True)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(16, num_classes)

    def forward(self, x):
        o, h = self.gru(x.reshape(len(x), *x.shape[-2:]))
        return self.out(self.drop(o[:, -1]))


class BNCNN(nn.Module):
    def __init__(self, num_classes, input_shape):
        super().__init__()
        self.conv = nn.Conv1d(input_shape[-1], 8, 5, padding=2)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(8, num_classes)

    def forward(self, x):
        h = x.reshape(len(x), *x.shape[-2:]).transpose(-1, -2)
        h = torch.relu(self.bn(self.conv(h)))
        return self.out(F.dropout(self.drop(h.mean(-1)), 0.1, self.training))


class ItemNet(nn.Module):
    def __init__(self, num_classes, input_shape):
        super().__init__()
        self.lin = nn.Linear(input_shape[-1], num_classes)

    def forward(self, x):
        h = x.reshape(len(x), *x.shape[-2:]).mean(1)
        return self.lin(h) * (2.0 if h.sum().item() > 0 else 1.0)


class WarmBN(nn.Module):
    # BatchNorm on batch statistics while it warms up, then on its running statistics

    def __init__(self, num_classes, input_shape):
        super().__init__()
        self.conv = nn.Conv1d(input_shape[-1], 8, 5, padding=2)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, num_classes)

    def forward(self, x):
        h = self.conv(x.reshape(len(x), *x.shape[-2:]).transpose(-1, -2))
        if self.training and self.bn.num_batches_tracked < 100:
            h = self.bn(h)
        else:
            h = F.batch_norm(h, self.bn.running_mean, self.bn.running_var, self.bn.weight, self.bn.bias, False)
        return self.out(torch.relu(h).mean(-1))


class PackedGRU(nn.Module):
    def __init__(self, num_classes, input_shape):
        super().__init__()
        self.gru = nn.GRU(input_shape[-1], 8, batch_first=True)
        self.out = nn.Linear(8, num_classes)

    def forward(self, x):
        seq = x.reshape(len(x), *x.shape[-2:])
        lengths = torch.full((len(x),), seq.shape[1], dtype=torch.int64)
        _, h = self.gru(nn.utils.rnn.pack_padded_sequence(seq, lengths, batch_first=True))
        return self.out(h[-1])
"""

SMALL = ["--rounds", "2", "--clients-per-round", "3", "--no-mlflow"]


def har(folder: Path, n: int = 240) -> Path:
    """HAR-shaped signals [N, 32, 9] float32, 6 classes, 10 clients."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 6, n)
    x = (rng.normal(size=(n, 32, 9)) + 0.5 * y[:, None, None]).astype(np.float32)
    path = folder / "har.npz"
    np.savez(path, x=x, y=y, client=np.arange(n) % 10)
    return path


def setup_folder(folder: Path) -> Path:
    (folder / "stocknets.py").write_text(MODELS)
    return har(folder)


def load_stocknets(folder: Path, name: str) -> types.ModuleType:
    """The test's MODELS written into `folder` and imported under `name` (not on sys.path: no clash between tests)."""
    import importlib.util

    (folder / "stocknets.py").write_text(MODELS)
    spec = importlib.util.spec_from_file_location(name, folder / "stocknets.py")
    assert spec is not None and spec.loader is not None
    nets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nets)
    return nets


def metrics(root: Path, run_id: str) -> dict[tuple[int, str], float]:
    frame = store(root).metrics_frame([run_id])
    return {
        (int(r), k): float(v)
        for r, k, v in zip(frame.round_idx, frame.key, frame.value, strict=True)
        if k.startswith(("eval/", "train/loss"))
    }


Runs = dict[tuple[str, int], tuple[dict[tuple[int, str], float], dict[str, torch.Tensor]]]


def twice_on_loop_and_vmap(tmp_path: Path, data: Path, model_ref: str, seed: str) -> Runs:
    """`fedcli train --model model_ref` twice on the loop and twice on vmap (SMALL, the seed): each
    (executor, 1 | 2) -> (metrics, final parameters); asserts the two runs of each executor are bit-identical."""
    runs: Runs = {}
    for executor in ("loop", "vmap"):
        for i in (1, 2):
            root = tmp_path / f"{executor}{i}"
            done = fedcli(
                root,
                "--data",
                str(data),
                "--model",
                model_ref,
                "--executor",
                executor,
                "--seed",
                seed,
                *SMALL,
                cwd=tmp_path,
            )
            assert done.returncode == 0, done.stderr
            (run,) = store(root).list_runs()
            runs[executor, i] = metrics(root, run.id), final_params(root, run.id)
    for executor in ("loop", "vmap"):
        (m1, p1), (m2, p2) = runs[executor, 1], runs[executor, 2]
        assert m1 and m1 == m2, executor
        assert all(torch.equal(p1[k], p2[k]) for k in p1), executor
    return runs


# ---- in process -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.GRU(9, 16, batch_first=True),
        lambda: nn.GRU(9, 8, num_layers=2, bidirectional=True),
        lambda: nn.LSTM(9, 8, num_layers=2, bidirectional=True, batch_first=True),
        lambda: nn.LSTM(9, 8, proj_size=4),
        lambda: nn.RNN(9, 8, nonlinearity="relu", num_layers=2),
        lambda: nn.RNN(9, 8, bias=False),
    ],
)
def test_functional_recurrence_matches_pytorch_kernels(make) -> None:  # type: ignore[no-untyped-def]
    """The recurrence the mode runs under torch.func transforms (here vmap over one client) equals
    PyTorch's kernel within float rounding (1e-5), outputs and final states, with the module's own
    weights; outside them (the loop's autograd) the mode leaves PyTorch's kernel: bit-equal."""
    torch.manual_seed(0)
    rnn = make().eval()
    x = torch.randn(5, 7, 9)
    ref = rnn(x)

    def call(xb: torch.Tensor):  # type: ignore[no-untyped-def]
        with StockLayers(torch.tensor(3)):
            return rnn(xb)

    eager = call(x)
    assert torch.equal(eager[0], ref[0])
    got = torch.func.vmap(call)(x.unsqueeze(0))
    got = pytree.tree_map(lambda t: t[0], got)
    refs = [ref[0], *(ref[1] if isinstance(ref[1], tuple) else (ref[1],))]
    gots = [got[0], *(got[1] if isinstance(got[1], tuple) else (got[1],))]
    for a, b in zip(refs, gots, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


DROPOUTS = {
    "Dropout": lambda h: nn.Dropout(0.4)(h),
    "Dropout1d": lambda h: nn.Dropout1d(0.4)(h),
    "Dropout2d": lambda h: nn.Dropout2d(0.4)(h.unsqueeze(-1)).squeeze(-1),
    "Dropout3d": lambda h: nn.Dropout3d(0.4)(h.unsqueeze(-1).unsqueeze(-1)).flatten(2),
    "AlphaDropout": lambda h: nn.AlphaDropout(0.4)(h),
    "FeatureAlphaDropout": lambda h: nn.FeatureAlphaDropout(0.4)(h.unsqueeze(-1)).squeeze(-1),
    "F.dropout": lambda h: F.dropout(h, 0.4, True),
    "torch.dropout": lambda h: torch.dropout(h, 0.4, True),
    "F.alpha_dropout": lambda h: F.alpha_dropout(h, 0.4, True),
    "sdpa": lambda h: F.scaled_dot_product_attention(h, h, h, dropout_p=0.4),
    "MultiheadAttention": lambda h: MHA(h, h, h)[0],
}
MHA = nn.MultiheadAttention(16, 2, dropout=0.4, batch_first=True)


@pytest.mark.parametrize("name", list(DROPOUTS))
def test_every_dropout_is_keyed_and_runs_under_vmap_alike(name: str) -> None:
    """Each dropout: the same key gives the same output, another key another one; torch's global
    generator is not drawn from; vmapped over three clients' keys it equals the three calls one by one."""
    torch.manual_seed(0)
    h = torch.randn(4, 6, 16)
    fn = DROPOUTS[name]

    def call(key: torch.Tensor) -> torch.Tensor:
        with StockLayers(key):
            return fn(h)

    state = torch.get_rng_state()
    one, again, other = call(torch.tensor(5)), call(torch.tensor(5)), call(torch.tensor(6))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(one, again) and not torch.equal(one, other)
    keys = torch.tensor([5, 6, 7])
    batched = torch.func.vmap(call)(keys)
    for c in range(3):
        torch.testing.assert_close(batched[c], call(keys[c]), atol=1e-6, rtol=1e-6)


def test_dropout_masks_drop_the_right_share_and_keep_the_mean() -> None:
    """Elementwise masks zero about p of the entries and rescale by 1/(1-p); channel masks zero whole channels."""
    h = torch.ones(64, 32, 10)
    with StockLayers(torch.tensor(11)):
        out = F.dropout(h, 0.3, True)
        channels = F.dropout1d(h, 0.5, True)
    assert abs((out == 0).float().mean().item() - 0.3) < 0.02
    assert abs(out.mean().item() - 1.0) < 0.05
    per_channel = (channels == 0).all(-1) | (channels != 0).all(-1)
    assert per_channel.all() and 0.4 < (channels[..., 0] == 0).float().mean().item() < 0.6


def test_eval_mode_and_no_key_leave_dropout_off() -> None:
    drop = nn.Dropout(0.5).eval()
    h = torch.randn(8, 8)
    with StockLayers(torch.tensor(1)):
        assert torch.equal(drop(h), h)
        assert torch.equal(F.dropout(h, 0.5, False), h)


def test_builtin_models_run_without_the_mode_user_models_with_it() -> None:
    from fedcli.datasets.models import MLP

    assert not needs_stock_layers(MLP(4, (8,), 2))
    assert needs_stock_layers(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)))
    assert needs_stock_layers(nn.GRU(4, 4))

    class Own(nn.Module):  # code of its own: may call F.dropout in forward
        pass

    assert needs_stock_layers(Own())


def _check(model: nn.Module, **options: object) -> str | None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 1, 32, 9), torch.randint(0, 6, (8,))
    check_model(
        "test:model",
        model,
        kind="classification",
        num_classes=6,
        x=x,
        y=y,
        loss=lambda out, xb, yb: F.cross_entropy(out, yb, reduction="none"),
        **options,  # type: ignore[arg-type]
    )
    return vmap_obstacle(model)


def test_model_check_runs_a_vmapped_cohort_step(tmp_path: Path) -> None:
    """The check vmaps one training step of a cohort (own data and key per client): the GRU, the
    BatchNorm + Dropout CNN and a transformer encoder pass; `.item()` in forward and packed
    sequences are found and recorded; BatchNorm's buffers are left as they were."""
    nets = load_stocknets(tmp_path, "stocknets_check")
    shape = [1, 32, 9]
    assert _check(nets.GRUNet(6, shape)) is None
    bn = nets.BNCNN(6, shape)
    assert _check(bn) is None
    assert bn.bn.track_running_stats and torch.equal(bn.bn.running_mean, torch.zeros(8))
    encoder = _Encoder()
    assert _check(encoder) is None
    assert "does not run under torch.func.vmap" in (_check(nets.ItemNet(6, shape)) or "")
    assert "does not run under torch.func.vmap" in (_check(nets.PackedGRU(6, shape)) or "")


def test_model_check_carries_batchnorm_statistics_as_training_does(tmp_path: Path) -> None:
    """The check's steps carry BatchNorm's running statistics as training does (train.bn_stats
    aggregate/local): a forward that branches on its BatchNorm's `num_batches_tracked` runs while
    they are unbatched constants, but not under vmap once each client carries its own copy, as
    training does; the check finds it (it passed the model before, and the run then failed in round
    1). A momentum=None BatchNorm (its factor set per step, as CarryingStats does) and --precision
    bf16 (autocast, BatchNorm's input in float32) pass; the buffers are left as they were."""
    nets = load_stocknets(tmp_path, "stocknets_carry")
    shape = [1, 32, 9]
    warm = nets.WarmBN(6, shape)
    assert _check(warm, carry_stats=False) is None  # what the check ran before: no statistics carried
    obstacle = _check(warm) or ""
    assert "does not run under torch.func.vmap" in obstacle and "data-dependent" in obstacle, obstacle
    assert int(warm.bn.num_batches_tracked) == 0 and torch.equal(warm.bn.running_mean, torch.zeros(8))
    cumulative = nets.BNCNN(6, shape)
    cumulative.bn.momentum = None
    assert _check(cumulative) is None
    assert cumulative.bn.momentum is None and cumulative.bn.track_running_stats
    assert _check(nets.BNCNN(6, shape), precision="bf16") is None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_model_that_fails_only_when_carrying_statistics_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """WarmBN (above) with --executor vmap: one line, exit 2, nothing written (it crashed in round 1
    with a traceback, the run half-written); `auto` sends it to the loop, which trains it, and
    --bn-stats estimate (nothing carried) runs it on vmap."""
    data = setup_folder(tmp_path)
    base = ["--data", str(data), "--model", "stocknets.py:WarmBN", *SMALL]
    refused = fedcli(tmp_path / "refused", *base, "--executor", "vmap", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    line = refused.stderr.strip()
    assert len(line.splitlines()) == 1 and "--executor vmap cannot run this model" in line, line
    assert "Traceback" not in line and "--executor loop" in line
    assert not (tmp_path / "refused").exists()
    auto = fedcli(tmp_path / "auto", *base, cwd=tmp_path)
    assert auto.returncode == 0, auto.stderr
    (run,) = store(tmp_path / "auto").list_runs()
    assert run.config["train"]["executor"] == "loop"
    assert "cannot run under vmap" in run.tags["fedcli.executor_reason"], run.tags["fedcli.executor_reason"]
    estimate = fedcli(tmp_path / "est", *base, "--executor", "vmap", "--bn-stats", "estimate", cwd=tmp_path)
    assert estimate.returncode == 0, estimate.stderr
    (run,) = store(tmp_path / "est").list_runs()
    assert run.config["train"]["executor"] == "vmap"


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(9, 16)
        self.enc = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True), 1
        )
        self.out = nn.Linear(16, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.enc(self.inp(x.reshape(len(x), 32, 9))).mean(1))


# ---- the CLI, as a user runs it ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", ["GRUNet", "BNCNN"])
def test_same_seed_twice_bit_identical_on_loop_and_vmap(tmp_path: Path, model: str) -> None:
    """Same command, same seed, twice, on the loop and on vmap: bit-identical metrics and model;
    loop and vmap agree within 1e-5 (the loop's GRU is PyTorch's kernel, vmap's the recurrence;
    vmap's batched convolution rounds differently)."""
    data = setup_folder(tmp_path)
    runs = twice_on_loop_and_vmap(tmp_path, data, f"stocknets.py:{model}", "3")
    (ml, pl), (mv, pv) = runs["loop", 1], runs["vmap", 1]
    assert set(ml) == set(mv)
    for k in pl:
        torch.testing.assert_close(pv[k], pl[k], atol=1e-5, rtol=1e-4)
    for k, value in ml.items():
        assert mv[k] == pytest.approx(value, rel=1e-4, abs=1e-5), k


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bf16_batchnorm_trains_on_vmap_as_on_the_loop(tmp_path: Path) -> None:
    """--precision bf16, the Conv1d + BatchNorm + Dropout CNN: vmap trains it (it crashed with a
    traceback, "expected scalar type BFloat16 but found Float", in BatchNorm's carried statistics
    step) and agrees with the loop to bfloat16's rounding; the stored statistics stay float32."""
    data = setup_folder(tmp_path)
    runs = {}
    for executor in ("loop", "vmap"):
        root = tmp_path / executor
        done = fedcli(
            root,
            "--data",
            str(data),
            "--model",
            "stocknets.py:BNCNN",
            "--executor",
            executor,
            "--precision",
            "bf16",
            "--seed",
            "3",
            *SMALL,
            cwd=tmp_path,
        )
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        (run,) = store(root).list_runs()
        assert run.config["train"]["executor"] == executor
        runs[executor] = (
            metrics(root, run.id),
            torch.load(root / "runs" / run.id / "model.pt", weights_only=True),
        )
    (ml, saved_loop), (mv, saved_vmap) = runs["loop"], runs["vmap"]
    assert set(ml) == set(mv) and (2, "eval/accuracy") in mv
    assert all(math.isfinite(v) for v in mv.values())
    for k, value in ml.items():
        assert mv[k] == pytest.approx(value, rel=5e-2, abs=5e-2), k
    stats = {k: v for k, v in saved_vmap["buffers"].items() if "running" in k}
    assert stats and all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in stats.values())
    for k, v in stats.items():
        torch.testing.assert_close(v, saved_loop["buffers"][k], atol=5e-2, rtol=5e-2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_auto_picks_before_the_run_and_sends_what_vmap_cannot_run_to_the_loop(tmp_path: Path) -> None:
    """auto: the GRU runs client by client on a CPU (PyTorch's kernel) and says so; `.item()` in forward
    goes to the loop before the run starts, with the reason recorded; --executor vmap on that model is
    one line, exit 2, nothing written."""
    data = setup_folder(tmp_path)
    gru = fedcli(
        tmp_path / "gru", "--data", str(data), "--model", "stocknets.py:GRUNet", *SMALL, cwd=tmp_path
    )
    assert gru.returncode == 0, gru.stderr
    (run,) = store(tmp_path / "gru").list_runs()
    assert run.config["train"]["executor"] == "loop"
    assert "RNNs run PyTorch's fused kernel" in run.tags["fedcli.executor_reason"]

    item = fedcli(
        tmp_path / "item", "--data", str(data), "--model", "stocknets.py:ItemNet", *SMALL, cwd=tmp_path
    )
    assert item.returncode == 0, item.stderr
    (run,) = store(tmp_path / "item").list_runs()
    assert run.config["train"]["executor"] == "loop"
    assert "cannot run under vmap" in run.tags["fedcli.executor_reason"], run.tags["fedcli.executor_reason"]

    refused = fedcli(
        tmp_path / "refused",
        "--data",
        str(data),
        "--model",
        "stocknets.py:ItemNet",
        "--executor",
        "vmap",
        *SMALL,
        cwd=tmp_path,
    )
    assert refused.returncode == 2, refused.stderr
    line = refused.stderr.strip()
    assert len(line.splitlines()) == 1 and "--executor vmap cannot run this model" in line, line
    assert "Traceback" not in line and "--executor loop" in line
    assert not (tmp_path / "refused").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("model", "executor"), [("BNCNN", "vmap"), ("GRUNet", "loop")])
def test_sigkill_then_resume_equals_the_uninterrupted_run(tmp_path: Path, model: str, executor: str) -> None:
    """The BatchNorm + Dropout CNN on vmap, the GRU + Dropout on the loop (PyTorch's kernel): SIGKILL with
    round 3 logged, then --resume: the same model, bit for bit, as the uninterrupted run (dropout masks come
    from the run's keys, not torch's generator; BatchNorm's statistics from the checkpoint)."""
    data = setup_folder(tmp_path)
    args = [
        "--data",
        str(data),
        "--model",
        f"./stocknets.py:{model}",
        "--executor",
        executor,
        "--rounds",
        "12",
        "--clients-per-round",
        "3",
        "--checkpoint-every",
        "1",
        "--no-mlflow",
    ]
    ref_id, root, run_id = reference_and_killed(tmp_path, args, rounds=12)

    resumed = fedcli(root, "--resume", run_id[:8], "--model", f"{tmp_path / 'stocknets.py'}:{model}", cwd="/")
    assert resumed.returncode == 0, resumed.stderr
    for name, tensor in final_params(tmp_path / "ref", ref_id).items():
        assert torch.equal(final_params(root, run_id)[name], tensor), name
    assert metrics(root, run_id) == metrics(tmp_path / "ref", ref_id)


def test_a_model_whose_training_step_fails_is_one_config_error() -> None:
    """A forward that passes the no-grad check but cannot be trained (its output cut from the
    parameters) is refused by the check's training step, with one line naming it."""
    from fedcli.errors import ConfigError

    class Detached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(9, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x.reshape(len(x), 32, 9).mean(1)).detach()

    with pytest.raises(ConfigError, match=r"a training step \(forward and gradient, train mode\)") as err:
        _check(Detached())
    assert "\n" not in str(err.value)
