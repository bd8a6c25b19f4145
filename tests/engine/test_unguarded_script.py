"""A user's script that calls fedcli.train at its top level, with no `if __name__ == "__main__":` guard.

`auto` picks process workers for a convolutional model on a CPU with 2+ cores, and `spawn` re-runs
the main script in each worker. Without a guard, that re-run trains again inside the worker, which
dies ("worker process exited unexpectedly") after the run was already written. Now, for such a
script:
- `auto` stays in one process and says why in the run's executor reason;
- `executor="process"` is refused in one line before anything is written;
- a guarded script still gets process workers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedcli.engine.backends.process import unguarded_main_script
from fedcli.tracking.store.sql_store import SqlStore

NET = """
import torch
from torch import nn


class ConvNet(nn.Module):
    def __init__(self, num_classes, input_shape):
        super().__init__()
        self.conv = nn.Conv1d(input_shape[-1], 4, 3, padding=1)
        self.out = nn.Linear(4, num_classes)

    def forward(self, x):
        h = torch.relu(self.conv(x.reshape(len(x), *x.shape[-2:]).transpose(-1, -2)))
        return self.out(h.mean(-1))
"""

CALL = (
    'fedcli.train("fedavg", model="convnet.py:ConvNet", data="signals.npz", rounds=1, clients_per_round=4, '
    'no_mlflow=True, root="runs"{extra})'
)


def script(folder: Path, *, guarded: bool, extra: str = "") -> Path:
    (folder / "convnet.py").write_text(NET)
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 120)
    x = (rng.normal(size=(120, 8, 5)) + y[:, None, None]).astype(np.float32)
    np.savez(folder / "signals.npz", x=x, y=y, client=np.arange(120) % 6)
    body = CALL.format(extra=extra)
    text = "import fedcli\n\n" + (f'if __name__ == "__main__":\n    {body}\n' if guarded else f"{body}\n")
    path = folder / "train_it.py"
    path.write_text(text)
    return path


def run_script(path: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")},
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, path.name], cwd=path.parent, env=env, capture_output=True, text=True, timeout=600
    )


def executors(folder: Path) -> list[tuple[str, str, str]]:
    db = folder / "runs" / "fedcli.db"
    runs = SqlStore(f"sqlite:///{db}").list_runs() if db.exists() else []
    return [
        (r.status, r.tags.get("fedcli.executor", ""), r.tags.get("fedcli.executor_reason", "")) for r in runs
    ]


@pytest.mark.timeout(900)
def test_auto_keeps_an_unguarded_script_in_one_process_and_process_is_refused(tmp_path: Path) -> None:
    done = run_script(script(tmp_path, guarded=False))
    assert done.returncode == 0, done.stderr
    ((status, executor, reason),) = executors(tmp_path)
    assert status == "finished" and executor != "process"
    if (
        os.cpu_count() or 1
    ) >= 2:  # auto would have taken process workers here: the reason says why it did not
        assert 'no `if __name__ == "__main__":` guard' in reason
    refused = tmp_path / "refused"
    refused.mkdir()
    done = run_script(script(refused, guarded=False, extra=', executor="process"'))
    assert done.returncode != 0
    assert "re-run" in done.stderr and "train_it.py" in done.stderr and "--executor loop" in done.stderr
    assert executors(refused) == []  # nothing written


@pytest.mark.timeout(900)
def test_a_guarded_script_keeps_its_process_workers(tmp_path: Path) -> None:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("auto takes process workers on 2+ cores only")
    done = run_script(script(tmp_path, guarded=True))
    assert done.returncode == 0, done.stderr
    ((status, executor, _),) = executors(tmp_path)
    assert (status, executor) == ("finished", "process")


def test_the_guard_is_read_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """unguarded_main_script reads the main file with ast: a guard written either way round counts, a guard
    inside a function does not, and a main module run with -m (a spec name) never counts."""
    import types

    for text, expected in [
        ('if __name__ == "__main__":\n    pass\n', False),
        ("if '__main__' == __name__:\n    pass\n", False),
        ("def f():\n    if __name__ == '__main__':\n        pass\nf()\n", True),
        ("import fedcli\nfedcli.train('fedavg')\n", True),
    ]:
        path = tmp_path / "s.py"
        path.write_text(text)
        main = types.ModuleType("__main__")
        main.__file__ = str(path)
        main.__spec__ = None
        monkeypatch.setitem(sys.modules, "__main__", main)
        assert (unguarded_main_script() == str(path)) is expected, text
        main.__spec__ = types.SimpleNamespace(name="fedcli.__main__")  # type: ignore[assignment]
        assert unguarded_main_script() is None
