"""Text, tabular and sensor loaders on small real-format files (LEAF JSON, TFF h5, MULAN, HAR)."""

from __future__ import annotations

import gzip
import io
import json
import lzma
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcli.datasets.bundled.har import HAR
from fedcli.datasets.bundled.mulan import BIBTEX, load_mulan
from fedcli.datasets.bundled.sent140 import SENT140
from fedcli.datasets.bundled.shakespeare import ALL_LETTERS, SHAKESPEARE
from fedcli.datasets.bundled.stackoverflow import (
    BOS,
    EOS,
    OOV,
    PAD,
    STACKOVERFLOW_LR,
    STACKOVERFLOW_NWP,
    bag_of_words,
)
from fedcli.datasets.bundled.vehicle import VEHICLE
from fedcli.datasets.tasks import TaskOptions
from fedcli.errors import DataError
from tests.datasets._format_writers import SHARED_DATA, write_leaf, write_stackoverflow

WINDOW = "To be, or not to be: that is the question. Whether 'tis nobler in the mind to su"  # 80 chars


def test_bundled_shakespeare_has_ten_roles() -> None:
    """LEAF niid_023_keep_64 sample: 10 roles, 41,990 training and 3,881 test windows (README)."""
    data = SHAKESPEARE.load(TaskOptions())
    assert len(data.client_indices) == 10 and data.x.shape == (41990, 80) and data.test_x.shape == (3881, 80)
    assert sum(len(c) for c in data.client_indices) == 41990 and data.num_classes == len(ALL_LETTERS) == 80
    test_sizes = [len(c) for c in data.test_client_indices]  # per role, in client order
    assert sum(test_sizes) == 3881 and min(test_sizes) > 0


def test_shakespeare_encodes_with_leaf_alphabet(tmp_path: Path) -> None:
    """x chars -> ALL_LETTERS.find(c); the test file's num_samples is overstated by 79 as in LEAF."""
    write_leaf(
        tmp_path / "train" / "a.json", {"B_ROLE": ([WINDOW, WINDOW], ["m", "!"]), "A_ROLE": ([WINDOW], ["x"])}
    )
    write_leaf(tmp_path / "test" / "a.json.gz", {"B_ROLE": ([WINDOW], ["}"])}, num_samples_extra=79)
    data = SHAKESPEARE.load(TaskOptions(data_dir=tmp_path))
    assert data.client_names == ["A_ROLE", "B_ROLE"]
    assert data.x[0].tolist() == [ALL_LETTERS.find(c) for c in WINDOW]
    assert data.y.tolist() == [ALL_LETTERS.find(c) for c in "xm!"]
    assert data.test_y.tolist() == [ALL_LETTERS.find("}")]
    assert [c.tolist() for c in data.test_client_indices] == [[], [0]]  # A_ROLE has no test windows


def test_shakespeare_rejects_unknown_characters_and_truncated_files(tmp_path: Path) -> None:
    write_leaf(tmp_path / "train" / "a.json", {"R": ([WINDOW[:-1] + "é"], ["a"])})
    write_leaf(tmp_path / "test" / "a.json", {"R": ([WINDOW], ["a"])})
    with pytest.raises(DataError, match=r"character 'é' is not in LEAF's Shakespeare alphabet"):
        SHAKESPEARE.load(TaskOptions(data_dir=tmp_path))
    raw = gzip.compress(json.dumps({"users": ["R"], "num_samples": [1], "user_data": {}}).encode())
    (tmp_path / "train" / "a.json").unlink()
    (tmp_path / "train" / "a.json.gz").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError, match=r"is not valid \(gzipped\) JSON"):
        SHAKESPEARE.load(TaskOptions(data_dir=tmp_path))


def test_sent140_tokenises_like_leaf(tmp_path: Path) -> None:
    """Words = [\\w']+ or punctuation; vocabulary = training words by count (ties alphabetical);
    first 25 ids, UNK = len(vocab) for unknown words and padding."""
    tweet = lambda text: ["1", "Mon Apr 06", "NO_QUERY", "user", text]  # noqa: E731
    write_leaf(
        tmp_path / "train" / "t.json",
        {"u2": ([tweet("good good day!")], [1]), "u1": ([tweet("bad day")], [0])},
    )
    write_leaf(tmp_path / "test" / "t.json", {"u1": ([tweet("good zebra")], [1])})
    data = SENT140.load(TaskOptions(data_dir=tmp_path))
    vocab = {"day": 0, "good": 1, "!": 2, "bad": 3}  # counts 2, 2, 1, 1 -> ties alphabetical
    unk = len(vocab)
    assert data.client_names == ["u1", "u2"] and data.y.tolist() == [0, 1]
    assert data.x[0].tolist() == [vocab["bad"], vocab["day"]] + [unk] * 23
    assert data.test_x[0].tolist()[:3] == [vocab["good"], unk, unk]


def test_stackoverflow_nwp_ids_follow_tff(tmp_path: Path) -> None:
    """[BOS, the, python, error, EOS, PAD...]: words 1..V, OOV V+1; x = ids[:20], y = ids[1:21]."""
    write_stackoverflow(tmp_path)
    data = STACKOVERFLOW_NWP.load(TaskOptions(data_dir=tmp_path))
    assert data.x.shape == (4, 20) and data.client_names == ["u1", "u9"]
    assert data.x[0, :5].tolist() == [BOS, 1, 3, 4, EOS] and data.y[0, :4].tolist() == [1, 3, 4, EOS]
    assert data.x[1, :4].tolist() == [BOS, 2, OOV, EOS] and data.y[1, 3:].eq(PAD).all()


def test_stackoverflow_lr_bag_of_words_and_tags(tmp_path: Path) -> None:
    """x = mean one-hot of "tokens title" over the 10k vocabulary (OOV counted, then dropped);
    y = multi-hot of the 500 most frequent tags (unknown tags dropped)."""
    write_stackoverflow(tmp_path)
    data = STACKOVERFLOW_LR.load(TaskOptions(data_dir=tmp_path))
    bow = bag_of_words(data.x[:2])
    expected = torch.zeros(2, 10000)
    expected[0, [0, 2, 3]] = torch.tensor([1.0, 2.0, 1.0]) / 4  # the python error python
    expected[1, [1, 0]] = 1.0 / 3  # a zebra the  (zebra = OOV)
    torch.testing.assert_close(bow, expected)
    assert data.y.shape == (4, 500) and data.y[0, :2].tolist() == [1.0, 1.0] and data.y[1].sum() == 0


def test_missing_stackoverflow_names_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"StackOverflow data not found.*stackoverflow_train.h5.*--download"):
        STACKOVERFLOW_NWP.load(TaskOptions(data_dir=tmp_path))


def test_mulan_sparse_arff(tmp_path: Path) -> None:
    arff = (
        "@relation t\n@attribute w0 {0,1}\n@attribute w1 {0,1}\n@attribute TAG_a {0,1}\n@attribute TAG_b {0,1}\n"
        "@data\n{0 1,3 1}\n{1 1,2 1,3 1}\n{}\n"
    )
    (tmp_path / "t.arff").write_text(arff)
    (tmp_path / "t.xml").write_text(
        '<labels xmlns="http://mulan.sourceforge.net/labels">'
        '<label name="TAG_a"></label><label name="TAG_b"></label></labels>'
    )
    x, y, names = load_mulan(tmp_path / "t.arff", tmp_path / "t.xml")
    assert x.tolist() == [[1, 0], [0, 1], [0, 0]] and y.tolist() == [[0, 1], [1, 1], [0, 0]]
    assert names == ["TAG_a", "TAG_b"]
    (tmp_path / "t.arff").write_text(arff.replace("{1 1,2 1,3 1}", "{1 1,2 1"))
    with pytest.raises(DataError, match=r"t.arff:8: expected a sparse row"):
        load_mulan(tmp_path / "t.arff", tmp_path / "t.xml")


def test_bundled_bibtex_statistics() -> None:
    """7,395 entries, 1,836 words, 159 tags, label cardinality 2.402 (README); 80/20 split."""
    data = BIBTEX.load(TaskOptions())
    assert data.x.shape == (5916, 1836) and data.test_x.shape == (1479, 1836) and data.y.shape[1] == 159
    cardinality = float(torch.cat([data.y, data.test_y]).sum(dim=1).mean())
    assert cardinality == pytest.approx(2.402, abs=5e-4)


needs_shared = pytest.mark.skipif(
    not SHARED_DATA.exists(), reason=f"shared data folder {SHARED_DATA} is absent"
)


@needs_shared
def test_har_per_subject_files() -> None:
    """Subjects 1 and 2: 260 + 226 train windows, 87 + 76 test windows (data README)."""
    data = HAR.load(TaskOptions(data_dir=SHARED_DATA / "uci-har-subjects", max_clients=2))
    assert [len(c) for c in data.client_indices] == [260, 226] and data.x.shape[1:] == (128, 9)
    assert len(data.test_y) == 87 + 76 and data.client_names == ["subject_01", "subject_02"]


def test_har_uci_text_layout_and_corrupt_file(tmp_path: Path) -> None:
    """UCI layout: subject_<split>.txt picks the client; labels 1-6 become 0-5."""
    root = tmp_path / "UCI HAR Dataset"
    for split, subjects in (("train", [3, 1, 3]), ("test", [2])):
        signals = root / split / "Inertial Signals"
        signals.mkdir(parents=True)
        for k, channel in enumerate(
            (
                "body_acc_x",
                "body_acc_y",
                "body_acc_z",
                "body_gyro_x",
                "body_gyro_y",
                "body_gyro_z",
                "total_acc_x",
                "total_acc_y",
                "total_acc_z",
            )
        ):
            np.savetxt(signals / f"{channel}_{split}.txt", np.full((len(subjects), 128), float(k)))
        np.savetxt(root / split / f"subject_{split}.txt", subjects, fmt="%d")
        np.savetxt(root / split / f"y_{split}.txt", [1 + i for i in range(len(subjects))], fmt="%d")
    data = HAR.load(TaskOptions(data_dir=tmp_path))
    assert data.client_names == ["subject_01", "subject_03"] and [len(c) for c in data.client_indices] == [
        1,
        2,
    ]
    assert data.y.tolist() == [1, 0, 2] and data.x[0, 5].tolist() == list(range(9))
    buffer = io.BytesIO()
    np.savez(
        buffer,
        x_train=np.zeros((2, 128, 9), np.float32),
        y_train=np.zeros(2),
        x_test=np.zeros((1, 128, 9)),
        y_test=np.zeros(1),
    )
    packed = lzma.compress(buffer.getvalue())
    (tmp_path / "subject_01.npz.xz").write_bytes(packed[: len(packed) // 2])
    with pytest.raises(DataError, match=r"HAR file .*subject_01.npz.xz cannot be read"):
        HAR.load(TaskOptions(data_dir=tmp_path))


@needs_shared
def test_vehicle_sensors_hold_out_without_test_file() -> None:
    """23 sensors, 1,860 samples; no test file -> 20 % of each sensor held out."""
    data = VEHICLE.load(TaskOptions(data_dir=SHARED_DATA / "vehicle-sensor-subset"))
    assert len(data.client_indices) == 23 and len(data.y) + len(data.test_y) == 1860
    assert set(data.y.unique().tolist()) == {0, 1}


def test_vehicle_with_test_file_and_bad_labels(tmp_path: Path) -> None:
    rows = [[0.1] * 100, [0.2] * 100]
    write_leaf(tmp_path / "mytrain.json", {"f_1": (rows, [[1], [-1]])})
    write_leaf(tmp_path / "mytest.json", {"f_1": (rows[:1], [[-1]])})
    data = VEHICLE.load(TaskOptions(data_dir=tmp_path))
    assert data.y.tolist() == [1, 0] and data.test_y.tolist() == [0]
    write_leaf(tmp_path / "mytrain.json", {"f_1": (rows, [[2], [-1]])})
    with pytest.raises(DataError, match=r"labels in \{-1, 1\}"):
        VEHICLE.load(TaskOptions(data_dir=tmp_path))
