"""The client-state store out of RAM and incremental checkpoints (issue 32 item 2; fedcli/engine/clientstate.py,
fedcli/engine/checkpoint.py format 3). In-process, real files (a real tmpfs for the full disk); each test a
few seconds at most. The kill/resume and CLI tests are tests/reliability/test_state_store_resume.py."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree

from fedcli.algorithms import ALGORITHMS
from fedcli.algorithms.base import OptimConfig
from fedcli.config.build import build_config
from fedcli.config.checks import make_hyperparameters
from fedcli.config.sections import config_hash_of
from fedcli.engine import checkpoint as ckpt
from fedcli.engine.checkpoint_writer import CheckpointWriter
from fedcli.engine.clientstate import ClientStateStore, make_store
from fedcli.engine.slots import SlotLayout
from fedcli.errors import TrackingError


def states(name: str, seed: int) -> tuple[Any, Any]:
    """(server state, client state or None) of algorithm `name` on random parameters of a task it runs on."""
    generator = torch.Generator().manual_seed(seed)
    shapes = (
        {"lsa_theta": (4,)}
        if name in ("fedlsa", "scafflsa")
        else {"linear.weight": (2, 3), "linear.bias": (2,)}
    )
    params = {k: torch.randn(v, generator=generator) for k, v in shapes.items()}
    alg, hp = ALGORITHMS[name], make_hyperparameters(name, {})
    server = alg.server_init(params, hp, OptimConfig(client_lr=0.1))
    return server, None if alg.init_client_state is None else alg.init_client_state(params, hp)


class State(NamedTuple):
    dual: dict[str, torch.Tensor]
    count: torch.Tensor


SHAPES = {"w": (7, 5), "b": (5,)}


def fresh() -> State:
    return State({k: torch.zeros(s) for k, s in SHAPES.items()}, torch.zeros((), dtype=torch.int64))


def updated(gathered: State, generator: torch.Generator) -> State:
    """What a round's clients return: new duals (random) and visit counts + 1."""
    dual = {k: v + torch.randn(v.shape, generator=generator) for k, v in gathered.dual.items()}
    return State(dual, gathered.count + 1)


def run_rounds(
    stores: list[ClientStateStore], rounds: int, clients: int = 40, cohort: int = 6, on_round: Any = None
) -> None:
    """Drive every store through the same rounds, asserting they gather the same states bit for bit."""
    rng = np.random.default_rng(0)
    generator = torch.Generator().manual_seed(0)
    for round_idx in range(1, rounds + 1):
        ids = rng.choice(clients, size=cohort, replace=False)
        gathered = [s.gather(ids, torch.device("cpu")) for s in stores]
        for other in gathered[1:]:
            for x, y in zip(pytree.tree_leaves(gathered[0]), pytree.tree_leaves(other), strict=True):
                assert torch.equal(x, y) and x.dtype == y.dtype
        new = updated(gathered[0], generator)
        for s in stores:
            s.scatter(ids, new)
        if on_round is not None:
            on_round(round_idx)


def test_disk_store_with_a_tiny_cache_gives_the_ram_stores_states_bit_for_bit(tmp_path: Path) -> None:
    """A cache of 2 slots (most states written back and read again every round) against the dict."""
    ram = ClientStateStore(fresh)
    disk = ClientStateStore(fresh, folder=tmp_path / "cs", cache_mb=2 * 192 / 2**20)
    slot = disk.layout.slot_bytes  # type: ignore[union-attr]
    assert slot == 192  # 5 float32 (32 B aligned), 35 float32 (144 B), an int64 (16 B)
    run_rounds([ram, disk], rounds=12)
    assert len(disk._states) <= 6 and len(disk) == len(ram) > 6  # evicted to the file, not lost
    assert (tmp_path / "cs" / "slots.bin").stat().st_size <= 40 * slot
    got, want = disk.state_dict(), ram.state_dict()
    assert sorted(got) == sorted(want)
    for client, state in want.items():
        for x, y in zip(pytree.tree_leaves(state), pytree.tree_leaves(got[client]), strict=True):
            assert torch.equal(x, y)
    disk.close(remove=True)
    assert not (tmp_path / "cs").exists()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_rounds_the_same_in_ram_and_on_disk(tmp_path: Path, precision: str) -> None:
    """bf16/fp16 storage: half the slot for floating leaves, integers kept; both forms round alike."""
    ram = ClientStateStore(fresh, precision=precision)
    disk = ClientStateStore(fresh, folder=tmp_path / "cs", cache_mb=0, precision=precision)
    full = ClientStateStore(fresh)
    assert disk.layout.slot_bytes < full.layout.slot_bytes  # type: ignore[union-attr]
    run_rounds([ram, disk], rounds=5)
    run_rounds([full], rounds=5)
    narrow = torch.bfloat16 if precision == "bf16" else torch.float16
    for client, state in disk.state_dict().items():
        assert state.count.dtype == torch.int64 and state.dual["w"].dtype == torch.float32
        assert torch.equal(state.dual["w"], state.dual["w"].to(narrow).float())  # stored rounded
        assert not torch.equal(state.dual["w"], full.state_dict()[client].dual["w"])  # and it shows


@pytest.mark.parametrize("name", sorted(n for n in ALGORITHMS if ALGORITHMS[n].init_client_state is not None))
def test_every_stateful_algorithms_client_state_round_trips_through_a_slot(name: str) -> None:
    _, template = states(name, seed=1)
    _, state = states(name, seed=2)
    state = pytree.tree_map(
        lambda t: t + torch.randn(t.shape).to(t.dtype) if t.is_floating_point() else t + 3, state
    )
    layout = SlotLayout(template, "state")
    back = layout.widen(layout.unpack(bytearray(layout.pack(layout.round(state)).tobytes())))
    leaves, spec = pytree.tree_flatten(back)
    want, want_spec = pytree.tree_flatten(state)
    assert spec == want_spec and all(torch.equal(x, y) for x, y in zip(leaves, want, strict=True))


def writer(run_dir: Path, keep: int = 2) -> CheckpointWriter:
    return CheckpointWriter(
        run_dir, record=lambda r, p: None, forget=lambda rounds: None, existing=[], every=1, keep=keep
    )


def load(run_dir: Path, round_idx: int) -> Any:
    server = {"x": torch.zeros(3)}
    _, clients = ckpt.load_checkpoint(
        ckpt.checkpoint_path(run_dir, round_idx),
        f"round {round_idx}",
        server_template=server,
        client_template=fresh(),
        run_id=run_dir.name,
        config_hash=CONFIG_HASH,
        requested=None,
        round_idx=round_idx,
    )
    return clients


CONFIG: dict[str, Any] = build_config(overrides={"data.task": "lsq", "algorithm.name": "scaffold"}).to_dict()
CONFIG_HASH = config_hash_of(CONFIG)


def assert_same_states(got: dict[int, Any], want: dict[int, Any]) -> None:
    assert sorted(got) == sorted(want)
    for client, state in want.items():
        for x, y in zip(pytree.tree_leaves(state), pytree.tree_leaves(got[client]), strict=True):
            assert torch.equal(x, y) and x.dtype == y.dtype


def test_checkpoints_write_only_the_states_changed_since_the_last_one_and_read_back_exactly(
    tmp_path: Path,
) -> None:
    """Each checkpoint's .clients.npy holds the round's cohort (6 of up to 40 visited clients), not
    every visited client; each checkpoint reads back as the store was at its round; pruning keeps
    every file a kept checkpoint names; a store loaded from a manifest writes only new changes."""
    run_dir = tmp_path / "runs" / ("a" * 32)
    store = ClientStateStore(fresh, folder=run_dir / "client-state", cache_mb=0)
    w = writer(run_dir, keep=2)
    snapshots: dict[int, dict[int, Any]] = {}

    def checkpoint(round_idx: int) -> None:
        w.submit(
            round_idx, {"x": torch.full((3,), float(round_idx))}, store.take_changes(round_idx), CONFIG, 0
        )
        w.wait()
        snapshots[round_idx] = store.state_dict()

    run_rounds([store], rounds=9, on_round=checkpoint)
    slot = store.layout.slot_bytes  # type: ignore[union-attr]
    for round_idx in range(1, 10):
        npy = run_dir / "checkpoints" / f"round-{round_idx:06d}.clients.npy"
        written = w.bytes_written[round_idx]
        assert written < 6 * slot + 128 + 8000, (
            written
        )  # the cohort's slots, the header, the .pt (server + manifest)
        if npy.exists():
            assert npy.stat().st_size == 128 + 6 * slot  # one .npy header, then the 6 changed slots
    assert len(snapshots[9]) > 6 * 2  # many more clients visited than any checkpoint wrote
    kept = sorted(int(p.name[6:12]) for p in (run_dir / "checkpoints").glob("round-*.pt"))
    assert kept == [8, 9]
    for round_idx in kept:
        assert_same_states(load(run_dir, round_idx).to_dict(), snapshots[round_idx])
    named = set()
    for round_idx in kept:
        named |= set(ckpt.read_file(ckpt.checkpoint_path(run_dir, round_idx), "f")["client_index"]["files"])
    assert {p.name for p in (run_dir / "checkpoints").glob("*.clients.npy")} == named  # the rest pruned

    resumed = ClientStateStore(fresh, folder=run_dir / "client-state", cache_mb=0)
    stored = load(run_dir, 9)
    resumed.load_state_dict(stored, index=stored.index)
    assert_same_states(resumed.state_dict(), snapshots[9])
    assert resumed.take_changes(10).clients == []  # nothing changed since checkpoint 9
    w.close()


def test_a_checkpoint_of_the_old_format_still_loads_and_the_next_one_writes_every_state(
    tmp_path: Path,
) -> None:
    """Format 2 (every client state in the .pt: what fedcli wrote before) loads into the store; the
    first format-3 checkpoint after it then holds every state (nothing earlier to build on)."""
    run_dir = tmp_path / "runs" / ("b" * 32)
    ram = ClientStateStore(fresh)
    run_rounds([ram], rounds=4)
    old = ckpt.checkpoint_payload(
        round_idx=4,
        server_state={"x": torch.ones(3)},
        client_states=ram.state_dict(),
        config=CONFIG,
        seed=0,
        run_id=run_dir.name,
    )
    assert old["format_version"] == 2
    ckpt.atomic_save(ckpt.plain_payload(old), ckpt.checkpoint_path(run_dir, 4))
    states_read = load(run_dir, 4)
    assert isinstance(states_read, dict)
    disk = ClientStateStore(fresh, folder=run_dir / "client-state", cache_mb=0)
    disk.load_state_dict(states_read)
    assert_same_states(disk.state_dict(), ram.state_dict())
    delta = disk.take_changes(5)
    assert delta.clients == sorted(ram.state_dict()) and delta.full is False
    w = writer(run_dir, keep=3)
    w.submit(5, {"x": torch.ones(3)}, delta, CONFIG, 0)
    w.close()
    assert_same_states(load(run_dir, 5).to_dict(), ram.state_dict())


def test_auto_keeps_small_federations_in_ram_and_puts_large_ones_on_disk(tmp_path: Path) -> None:
    small = make_store(fresh, num_clients=100, folder=tmp_path / "a", cache_mb=1)
    large = make_store(fresh, num_clients=100_000, folder=tmp_path / "b", cache_mb=1)
    assert not small.on_disk and large.on_disk and not (tmp_path / "a").exists()
    assert not make_store(None, num_clients=10**6, folder=tmp_path / "c", kind="disk").on_disk


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MB tmpfs (root only; skipped where mounting is not allowed)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({made.stderr.strip() or 'not root'}); the disk-full tests need root"
        )
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(folder: Path) -> None:
    handle = os.open(folder / "fill", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        chunk = 1 << 16
        while chunk:
            try:
                os.write(handle, b"\0" * chunk)
            except OSError:
                chunk //= 2
    finally:
        os.close(handle)


def test_a_full_disk_during_a_checkpoint_is_one_line_naming_the_folder_and_keeps_the_previous_one(
    tiny_disk: Path,
) -> None:
    run_dir = tiny_disk / "runs" / ("c" * 32)
    store = ClientStateStore(fresh)
    w = writer(run_dir, keep=3)
    run_rounds([store], rounds=1)
    w.submit(1, {"x": torch.ones(3)}, store.take_changes(1), CONFIG, 0)
    w.wait()
    at_one = store.state_dict()
    fill(tiny_disk)
    run_rounds([store], rounds=1)
    w.submit(2, {"x": torch.ones(3)}, store.take_changes(2), CONFIG, 0)
    with pytest.raises(TrackingError) as err:
        w.wait()
    message = str(err.value)
    assert (
        "no space left on device" in message
        and str(run_dir / "checkpoints") in message
        and "\n" not in message
    )
    w.close()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "round-000001.clients.npy",
        "round-000001.pt",
    ]  # no temp file
    assert_same_states(load(run_dir, 1).to_dict(), at_one)


def test_a_full_disk_under_the_disk_store_is_one_line_naming_its_folder(tiny_disk: Path) -> None:
    def big() -> dict[str, torch.Tensor]:
        return {"w": torch.zeros(64, 1024)}  # 256 KiB a client

    store = ClientStateStore(big, folder=tiny_disk / "client-state", cache_mb=0)
    ids = np.arange(8)
    with pytest.raises(TrackingError) as err:
        store.scatter(ids, {"w": torch.ones(8, 64, 1024)})
    message = str(err.value)
    assert "no space left on device" in message and str(tiny_disk / "client-state") in message
    assert "\n" not in message


def test_a_full_disk_while_a_round_spills_its_new_states_is_one_line_naming_the_folder(
    tiny_disk: Path,
) -> None:
    """stream_cohort writes each group's new client states to an unlinked file beside the slots
    (SpilledStates); a disk that fills up there is the same one line as the store's, not a traceback."""
    from fedcli.engine.cohort import SpilledStates

    spill = SpilledStates(tiny_disk / "client-state")
    spill.write(np.arange(2), {"w": torch.ones(2, 64, 1024)})  # 512 KiB: fits
    with pytest.raises(TrackingError) as err:
        spill.write(np.arange(2, 6), {"w": torch.ones(4, 64, 1024)})  # 1 MiB more: does not
    message = str(err.value)
    assert "no space left on device" in message and str(tiny_disk / "client-state") in message
    assert "\n" not in message


def test_a_checkpoint_spills_the_evicted_changed_states_and_writes_them_as_they_were(tmp_path: Path) -> None:
    """cache_mb=0: every changed state is evicted to its slot, so take_changes copies the slots into the
    checkpoint's spill file (one slot in memory at a time) instead of holding them all. The next rounds
    overwrite the slots before the write; the checkpoint still holds the states as they were at
    take_changes, bit for bit, and the spill file is gone once written (and on close(remove=True))."""
    from fedcli.engine.slots import SpilledSlot, spill_name

    run_dir, ram = tmp_path / "runs" / ("d" * 32), ClientStateStore(fresh)
    disk = ClientStateStore(fresh, folder=run_dir / "client-state", cache_mb=0)
    run_rounds([ram, disk], rounds=3)
    at_three = ram.state_dict()
    delta = disk.take_changes(3)
    assert delta.clients and all(isinstance(s, SpilledSlot) for s in delta.states)
    spill = run_dir / "client-state" / spill_name(3)
    assert spill.stat().st_size == len(delta.clients) * disk.layout.slot_bytes  # type: ignore[union-attr]
    run_rounds([ram, disk], rounds=2)  # the slots change before the write
    w = writer(run_dir, keep=3)
    w.submit(3, {"x": torch.ones(3)}, delta, CONFIG, 0)
    w.close()
    assert not spill.exists()
    assert_same_states(load(run_dir, 3).to_dict(), at_three)
    disk.take_changes(5)
    assert (run_dir / "client-state" / spill_name(5)).exists()  # never written: removed on close
    disk.close(remove=True)
    assert not (run_dir / "client-state").exists()


@pytest.mark.parametrize("compact", [True, False])
def test_checkpoint_files_stay_within_twice_the_live_states_by_compaction(
    tmp_path: Path, compact: bool
) -> None:
    """40 clients, 6 a round, a checkpoint every round, 1 kept: without compaction the .clients.npy files
    the kept checkpoint names hold ever more superseded rows (a file stays while one client's latest state
    is in it); with it (compact_min_bytes 0) a checkpoint also rewrites the live states of the most
    superseded files once the files hold more than COMPACT_FACTOR rows per live state, so they stay within
    COMPACT_FACTOR x live + one checkpoint's file, no checkpoint writes every state (each writes at most
    2 cohorts' rows, O(cohort) not O(clients)), and every checkpoint still reads back as the store was at
    its round."""
    from fedcli.engine.clientstate import COMPACT_FACTOR

    run_dir = tmp_path / "runs" / ("e" * 32)
    store = ClientStateStore(fresh, folder=run_dir / "client-state", cache_mb=0)
    store.compact_min_bytes = 0 if compact else 1 << 62
    w = writer(run_dir, keep=1)
    worst, full, written, cleaned = 0.0, 0, 0, 0

    def checkpoint(round_idx: int) -> None:
        nonlocal worst, full, written, cleaned
        delta = store.take_changes(round_idx)
        full += len(delta.clients) == len(delta.index) > 6
        written = max(written, len(delta.clients))
        cleaned += len(delta.clients) > 6  # rewrote states that did not change this round
        at = store.state_dict()
        w.submit(round_idx, {"x": torch.ones(3)}, delta, CONFIG, 0)
        w.wait()
        assert_same_states(load(run_dir, round_idx).to_dict(), at)
        rows = sum(
            np.load(p, mmap_mode="r").shape[0] for p in (run_dir / "checkpoints").glob("round-*.clients.npy")
        )
        worst = max(worst, (rows - len(delta.clients)) / len(delta.index))  # the files before this one's

    run_rounds([store], rounds=60, on_round=checkpoint)
    w.close()
    assert full == 0
    if compact:
        assert cleaned >= 5 and written <= 2 * 6 and worst <= COMPACT_FACTOR + 1e-9, (cleaned, written, worst)
    else:
        assert cleaned == 0 and worst > COMPACT_FACTOR + 0.2
