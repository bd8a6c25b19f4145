"""auto's memory estimate (engine/footprint.py): a vmapped cohort that would not fit runs on the loop (issue 32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedcli.datasets.formats.generate import generate
from fedcli.engine.footprint import VMAP_CPU_BUDGET, client_step_bytes, vmap_too_big
from fedcli.engine.setup import build
from fedcli.runs.request import TrainOptions
from fedcli.runs.run import resolve_config


@pytest.fixture(scope="module")
def so_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small StackOverflow-format federation in the TFF h5 layout (the repo's generator)."""
    out = tmp_path_factory.mktemp("so")
    generate("stackoverflow", 60, out, 0, quiet=True, mean_size=8, tokens_only=True)
    return out


def _setup(so_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **options: object):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("FEDCLI_DATA_CACHE", str(tmp_path / "cache"))
    cfg = resolve_config(
        TrainOptions(
            task="stackoverflow-nwp",
            data_dir=str(so_dir),
            data_store="disk",
            no_mlflow=True,
            root=str(tmp_path / "runs"),
            **options,  # type: ignore[arg-type]
        )
    )[0]
    return build(cfg)


@pytest.mark.slow
def test_large_lstm_cohort_runs_on_the_loop_and_says_why(
    so_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = _setup(so_dir, tmp_path, monkeypatch, clients_per_round=50)
    per_client = client_step_bytes(big.fns, big.init_params, big.cfg.train.batch_size)
    assert per_client * 50 > VMAP_CPU_BUDGET  # the next-word LSTM: ~100 MiB a client's step
    assert big.backend.name == "loop"
    assert "vmap would hold" in big.executor_reason and "50 clients" in big.executor_reason
    small = _setup(so_dir, tmp_path, monkeypatch, clients_per_round=4)  # 4 clients fit: vmap, as before
    assert small.backend.name == "vmap" and "would hold" not in small.executor_reason
    asked = _setup(so_dir, tmp_path, monkeypatch, clients_per_round=50, executor="vmap")  # a request is kept
    assert asked.backend.name == "vmap"


@pytest.mark.slow
def test_estimate_grows_with_the_batch_and_leaves_the_rng_alone(
    so_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = _setup(so_dir, tmp_path, monkeypatch, clients_per_round=4)
    params = s.init_params
    param_bytes = sum(t.numel() * t.element_size() for t in params.values())
    state = torch.get_rng_state()
    one, many = client_step_bytes(s.fns, params, 1), client_step_bytes(s.fns, params, 40)
    assert torch.equal(state, torch.get_rng_state())
    # activations: the logits of 40 sequences of 20 tokens over 10,004 words dominate (32 MB each copy)
    assert one > 4 * param_bytes and many - 4 * param_bytes > 20 * (one - 4 * param_bytes)
    assert many - 4 * param_bytes > 2 * 40 * 20 * 10004 * 4


def test_budget_applies_to_cpus_only() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert vmap_too_big(VMAP_CPU_BUDGET // 10, 10, cpu) is None
    why = vmap_too_big(VMAP_CPU_BUDGET // 10, 11, cpu)
    assert why is not None and "11 clients" in why and "loop" in why
    assert vmap_too_big(VMAP_CPU_BUDGET, 50, cuda) is None


def test_the_round_loop_can_give_the_c_heaps_free_pages_back_on_glibc() -> None:
    """release_free_memory (called once a round) is glibc's malloc_trim where the C library is glibc,
    not a silent no-op there."""
    import platform

    from fedcli.engine.machine import libc_trim, release_free_memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc: release_free_memory is a no-op here")
    assert libc_trim() is not None
    release_free_memory()
