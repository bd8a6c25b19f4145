"""Image loaders on small files in the publishers' formats (IDX, CIFAR pickles, TFF h5)."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcli.datasets.bundled.femnist import verify_checksums
from fedcli.datasets.bundled.mnist import BUNDLED_DIR, MNIST, read_idx
from fedcli.datasets.bundled.tff_images import CIFAR100, EMNIST
from fedcli.datasets.bundled.torchvision_sources import CIFAR10, FASHION_MNIST, read_cifar_batch
from fedcli.datasets.formats.tff_h5 import read_tff_h5
from fedcli.datasets.tasks import TaskOptions
from fedcli.errors import DataError
from tests.datasets._format_writers import write_cifar_batch, write_idx, write_mnist_folder, write_tff_h5


@pytest.mark.parametrize("gz", [True, False])
def test_idx_round_trip(tmp_path: Path, gz: bool) -> None:
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    floats = np.array([1.5, -2.0], dtype=np.float32)
    np.testing.assert_array_equal(read_idx(write_idx(tmp_path / "a", images, gz=gz)), images)
    np.testing.assert_array_equal(read_idx(write_idx(tmp_path / "b", floats, gz=gz)), floats)


def test_idx_truncated_corrupt_and_foreign_files_fail_clearly(tmp_path: Path) -> None:
    raw = write_idx(tmp_path / "x", np.zeros((3, 28, 28), np.uint8), gz=False).read_bytes()
    (tmp_path / "short").write_bytes(raw[:-5])
    with pytest.raises(DataError, match=r"holds 2347 data bytes but its header \(3, 28, 28\) needs 2352"):
        read_idx(tmp_path / "short")
    gz = write_idx(tmp_path / "x.gz", np.zeros((3, 28, 28), np.uint8)).read_bytes()
    (tmp_path / "cut.gz").write_bytes(gz[: len(gz) // 2])
    with pytest.raises(DataError, match=r"cannot be read or un-gzipped"):
        read_idx(tmp_path / "cut.gz")
    (tmp_path / "text").write_bytes(b"hello world")
    with pytest.raises(DataError, match=r"is not an IDX file"):
        read_idx(tmp_path / "text")


def test_bundled_mnist_is_a_fixed_8000_2000_split() -> None:
    """The 10,000 test images (per-class counts 980, 1135, ... in the README) split 8,000/2,000."""
    data = MNIST.load(TaskOptions())
    assert data.x.shape == (8000, 28, 28) and data.x.dtype == torch.uint8
    assert data.test_x.shape == (2000, 28, 28) and data.num_classes == 10
    counts = np.bincount(np.concatenate([data.y.numpy(), data.test_y.numpy()]))
    assert counts.tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert data.client_indices == [] and data.fingerprint == MNIST.load(TaskOptions(seed=5)).fingerprint
    batch = MNIST.prepare(data.x[:2])
    assert batch.shape == (2, 1, 28, 28) and float(batch.max()) <= 1.0


def test_full_mnist_from_torchvision_layout(tmp_path: Path) -> None:
    x, y = write_mnist_folder(tmp_path / "MNIST" / "raw")
    data = MNIST.load(TaskOptions(data_dir=tmp_path))
    np.testing.assert_array_equal(data.x.numpy(), x)
    np.testing.assert_array_equal(data.y.numpy(), y)
    assert data.test_x.shape == (4, 28, 28)


def test_missing_data_names_folder_and_fix(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=rf"MNIST data not found in {tmp_path}.*--download"):
        MNIST.load(TaskOptions(data_dir=tmp_path))
    with pytest.raises(DataError, match=r"FashionMNIST data not found"):
        FASHION_MNIST.load(TaskOptions(data_dir=tmp_path))
    with pytest.raises(DataError, match=r"CIFAR-10 data not found.*data_batch_1"):
        CIFAR10.load(TaskOptions(data_dir=tmp_path))
    with pytest.raises(DataError, match=r"EMNIST data not found.*fed_emnist_train.h5"):
        EMNIST.load(TaskOptions(data_dir=tmp_path))


def test_bundled_checksums_catch_a_flipped_byte(tmp_path: Path) -> None:
    copy = tmp_path / "mnist"
    shutil.copytree(BUNDLED_DIR, copy)
    verify_checksums(copy)
    labels = copy / "t10k-labels-idx1-ubyte.gz"
    data = bytearray(labels.read_bytes())
    data[100] ^= 0xFF
    labels.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"fails its SHA-256 check"):
        verify_checksums(copy)


def test_emnist_torchvision_images_are_transposed_upright(tmp_path: Path) -> None:
    """NIST stores EMNIST images transposed; the loader returns image.T of the file's array."""
    raw = tmp_path / "EMNIST" / "raw"
    x, _ = write_mnist_folder(raw, prefix_train="emnist-byclass-train", prefix_test="emnist-byclass-test")
    data = EMNIST.load(TaskOptions(data_dir=tmp_path))
    np.testing.assert_array_equal(data.x.numpy(), x.transpose(0, 2, 1))
    assert data.num_classes == 62 and data.client_indices == []


def _cifar_rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 3072), dtype=np.uint8)


def test_cifar10_batches_decode_channel_major(tmp_path: Path) -> None:
    """A CIFAR row is 1024 red, 1024 green, 1024 blue values: x[i, c] = row[1024c : 1024(c+1)]."""
    root = tmp_path / "cifar-10-batches-py"
    rows = [_cifar_rows(3, seed) for seed in range(6)]
    for i in range(5):
        write_cifar_batch(root / f"data_batch_{i + 1}", rows[i], [i, i + 1, 9])
    write_cifar_batch(root / "test_batch", rows[5], [0, 1, 2])
    data = CIFAR10.load(TaskOptions(data_dir=tmp_path))
    assert data.x.shape == (15, 3, 32, 32) and data.test_x.shape == (3, 3, 32, 32)
    np.testing.assert_array_equal(data.x[0, 1].numpy().ravel(), rows[0][0, 1024:2048])
    assert data.y.tolist()[:3] == [0, 1, 9]


def test_cifar_pickle_truncated_or_hostile_is_refused(tmp_path: Path) -> None:
    write_cifar_batch(tmp_path / "good", _cifar_rows(2, 0), [1, 2])
    raw = (tmp_path / "good").read_bytes()
    (tmp_path / "cut").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError, match=r"cannot be unpickled.*truncated or corrupted"):
        read_cifar_batch(tmp_path / "cut", "labels")
    (tmp_path / "evil").write_bytes(pickle.dumps({"data": Path("/")}))  # needs a non-numpy global
    with pytest.raises(DataError, match=r"is not allowed in a CIFAR batch"):
        read_cifar_batch(tmp_path / "evil", "labels")


def test_cifar100_tff_h5_has_natural_clients(tmp_path: Path) -> None:
    """TFF CIFAR-100: /examples/<id>/image uint8 [n, 32, 32, 3] (HWC) -> stored CHW."""
    rng = np.random.default_rng(0)
    images = {cid: rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8) for cid, n in (("7", 2), ("12", 3))}
    clients = {
        cid: {"image": img, "label": np.arange(len(img)), "coarse_label": np.zeros(len(img))}
        for cid, img in images.items()
    }
    write_tff_h5(tmp_path / "fed_cifar100_train.h5", clients)
    write_tff_h5(tmp_path / "fed_cifar100_test.h5", {"7": clients["7"]})
    data = CIFAR100.load(TaskOptions(data_dir=tmp_path))
    assert data.client_names == ["12", "7"]  # sorted ids
    assert [len(c) for c in data.client_indices] == [3, 2]
    np.testing.assert_array_equal(data.x[0].numpy(), images["12"][0].transpose(2, 0, 1))
    assert data.test_x.shape == (2, 3, 32, 32)
    assert [c.tolist() for c in data.test_client_indices] == [[], [0, 1]]  # only client "7" has test data


def test_federated_emnist_h5_inverts_pixels_and_limits_clients(tmp_path: Path) -> None:
    """TFF EMNIST pixels are floats with 1.0 = background; stored as uint8 ink = round(255(1-p))."""
    pixels = np.full((2, 28, 28), 1.0, np.float32)
    pixels[0, 0, 0] = 0.0
    clients = {
        "f0001": {"pixels": pixels, "label": np.array([3, 61])},
        "f0000": {"pixels": pixels[:1], "label": np.array([5])},
        "f0002": {"pixels": pixels[:1], "label": np.array([7])},
    }
    write_tff_h5(tmp_path / "fed_emnist_train.h5", clients)
    write_tff_h5(tmp_path / "fed_emnist_test.h5", clients)
    data = EMNIST.load(TaskOptions(data_dir=tmp_path, max_clients=2))
    assert data.client_names == ["f0000", "f0001"] and data.y.tolist() == [5, 3, 61]
    assert int(data.x[0, 0, 0]) == 255 and int(data.x[0, 1, 1]) == 0


def test_truncated_h5_is_a_data_error(tmp_path: Path) -> None:
    write_tff_h5(tmp_path / "f.h5", {"a": {"label": np.arange(1000)}})
    raw = (tmp_path / "f.h5").read_bytes()
    (tmp_path / "f.h5").write_bytes(raw[: len(raw) // 3])
    with pytest.raises(DataError, match=r"cannot be read as HDF5"):
        read_tff_h5(tmp_path / "f.h5", ("label",))
    write_tff_h5(tmp_path / "g.h5", {"a": {"label": np.arange(3)}})
    with pytest.raises(DataError, match=r"client 'a' lacks field\(s\) pixels"):
        read_tff_h5(tmp_path / "g.h5", ("pixels", "label"))
