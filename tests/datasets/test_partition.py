"""Partitioners: coverage, determinism, the skew their parameter promises, clear errors.

Property tests draw label vectors with hypothesis; each partitioner must assign every
example to exactly one client (two-level: at most one, with a documented rounding loss),
return the requested number of non-empty clients, and give identical output for the same
seed. Skew tests fix the data and check the direction the parameter must move the
statistics (mean per-client label entropy, size spread) over several seeds.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fedcli.datasets.partition.files import load_partition, save_partition
from fedcli.datasets.partition.make import make_partition
from fedcli.datasets.partition.schemes import primary_tags
from fedcli.datasets.partition.spec import SCHEMES, PartitionSpec
from fedcli.datasets.partition.summary import label_histograms, partition_figure, plot_partition, summarize
from fedcli.errors import ConfigError

FAST = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def labelled_data(draw: st.DrawFn, max_classes: int = 6) -> np.ndarray:
    num_classes = draw(st.integers(2, max_classes))
    n = draw(st.integers(60, 300))
    seed = draw(st.integers(0, 2**16))
    labels = np.random.default_rng(seed).integers(0, num_classes, n)
    labels[:num_classes] = np.arange(num_classes)  # every class occurs
    return labels


def _exactly_once(clients: list[np.ndarray], n: int) -> None:
    assert np.array_equal(np.sort(np.concatenate(clients)), np.arange(n))


def _mean_entropy(clients: list[np.ndarray], labels: np.ndarray) -> float:
    return summarize(clients, labels, int(labels.max()) + 1).mean_entropy  # type: ignore[return-value]


SPECS = {
    "iid": lambda k, s: PartitionSpec("iid", k, seed=s),
    "dirichlet": lambda k, s: PartitionSpec("dirichlet", k, alpha=0.5, min_size=1, seed=s),
    "balanced": lambda k, s: PartitionSpec("dirichlet", k, alpha=0.5, balanced=True, seed=s),
    "labels": lambda k, s: PartitionSpec("labels", k, labels_per_client=2, seed=s),
    "quantity-dir": lambda k, s: PartitionSpec("quantity", k, alpha=5.0, min_size=1, seed=s),
    "quantity-lognormal": lambda k, s: PartitionSpec("quantity", k, sigma=0.5, min_size=1, seed=s),
}


@pytest.mark.parametrize("name", sorted(SPECS))
@FAST
@given(labels=labelled_data(), num_clients=st.integers(2, 6), seed=st.integers(0, 1000))
def test_every_example_exactly_once_and_seeded(
    name: str, labels: np.ndarray, num_clients: int, seed: int
) -> None:
    """Each scheme covers 0..N-1 exactly once with K non-empty clients; same seed, same output.
    (#labels gets K >= C clients, which guarantees every class a holder.)"""
    if name == "labels":
        num_clients = max(num_clients, int(labels.max()) + 1)
    spec = SPECS[name](num_clients, seed)
    clients = make_partition(spec, labels=labels, natural=None)
    again = make_partition(spec, labels=labels, natural=None)
    assert len(clients) == num_clients and all(len(c) > 0 for c in clients)
    _exactly_once(clients, len(labels))
    assert all(np.array_equal(a, b) for a, b in zip(clients, again, strict=True))


@FAST
@given(labels=labelled_data(), shards_per_client=st.integers(1, 3), seed=st.integers(0, 1000))
def test_shards_are_equal_label_sorted_slices(labels: np.ndarray, shards_per_client: int, seed: int) -> None:
    """McMahan shards: K*s shards of size N/(K*s) cut from the (stable) label-sorted order; each
    client's examples are exactly s whole shards, i.e. s aligned runs of sorted positions."""
    num_clients = 4
    n = len(labels) - len(labels) % (num_clients * shards_per_client)
    labels = labels[:n]
    assume(len(np.unique(labels)) == labels.max() + 1)
    clients = make_partition(
        PartitionSpec("shards", num_clients, shards_per_client=shards_per_client, seed=seed),
        labels=labels,
        natural=None,
    )
    _exactly_once(clients, n)
    size = n // (num_clients * shards_per_client)
    position = np.argsort(np.argsort(labels, kind="stable"))  # rank of each example in sorted order
    for c in clients:
        runs = np.sort(position[c]).reshape(shards_per_client, size)
        assert np.all(runs[:, 0] % size == 0) and np.all(np.diff(runs, axis=1) == 1)


@FAST
@given(labels=labelled_data(), per_client=st.integers(1, 2), seed=st.integers(0, 1000))
def test_labels_per_client_bounds_the_classes(labels: np.ndarray, per_client: int, seed: int) -> None:
    """noniid-#labelK: every client sees at most K distinct classes."""
    num_clients = int(labels.max()) + 1  # client i holds class i mod C, so every class has a holder
    clients = make_partition(
        PartitionSpec("labels", num_clients, labels_per_client=per_client, seed=seed),
        labels=labels,
        natural=None,
    )
    assert all(len(np.unique(labels[c])) <= per_client for c in clients)


@FAST
@given(labels=labelled_data(), num_clients=st.integers(2, 5), seed=st.integers(0, 1000))
def test_two_level_assigns_each_example_at_most_once(labels: np.ndarray, num_clients: int, seed: int) -> None:
    """Two-level rounding: round(n_c w_kc / sum_j w_jc) summed over k is within K/2 of n_c
    (plus the 1 -> 2 bumps, which only add), so at most C*K/2 examples stay unassigned."""
    spec = PartitionSpec("two-level", num_clients, alpha=0.5, min_size=1, seed=seed, max_tries=200)
    clients = make_partition(spec, labels=labels, natural=None)
    flat = np.concatenate(clients)
    assert len(np.unique(flat)) == len(flat) and flat.min() >= 0 and flat.max() < len(labels)
    num_classes = int(labels.max()) + 1
    assert len(labels) - len(flat) <= num_classes * num_clients / 2


def test_natural_keeps_owner_order_and_subsets() -> None:
    natural = [np.array([3, 0]), np.array([1]), np.array([2, 4])]
    labels = np.zeros(5, dtype=np.int64)
    clients = make_partition(PartitionSpec("natural"), labels=labels, natural=natural)
    assert [c.tolist() for c in clients] == [[0, 3], [1], [2, 4]]
    first_two = make_partition(PartitionSpec("natural", 2), labels=labels, natural=natural)
    assert [c.tolist() for c in first_two] == [[0, 3], [1]]


SKEW_DATA = np.repeat(np.arange(10), 200)  # 2,000 examples, 10 balanced classes


@pytest.mark.parametrize(
    "scheme, extra", [("dirichlet", {}), ("dirichlet", {"balanced": True}), ("two-level", {})]
)
def test_label_entropy_falls_as_alpha_falls(scheme: str, extra: dict[str, object]) -> None:
    """Smaller alpha = more label skew: mean client label entropy (3 seeds) strictly decreases
    along alpha = 100, 1, 0.1, and stays near log2(10) ≈ 3.32 bits for alpha = 100."""
    means = []
    for alpha in (100.0, 1.0, 0.1):
        runs = [
            _mean_entropy(
                make_partition(
                    PartitionSpec(scheme, 10, alpha=alpha, min_size=1, seed=s, **extra),
                    labels=SKEW_DATA,
                    natural=None,
                ),
                SKEW_DATA,
            )
            for s in range(3)
        ]
        means.append(float(np.mean(runs)))
    assert means[0] > means[1] > means[2]
    assert means[0] > 3.1


@pytest.mark.parametrize("field, values", [("alpha", (100.0, 1.0, 0.2)), ("sigma", (0.0, 0.5, 1.5))])
def test_quantity_skew_spreads_sizes_keeps_labels_iid(field: str, values: tuple[float, ...]) -> None:
    """Quantity skew: the coefficient of variation of client sizes grows as alpha falls / sigma
    grows (sigma = 0 gives equal sizes except FedLab's deficit fix on client 0), while labels stay IID
    (the size-weighted TV to the global mix stays small)."""
    spreads = []
    for value in values:
        cvs = []
        for seed in range(3):
            clients = make_partition(
                PartitionSpec("quantity", 10, min_size=1, seed=seed, **{field: value}),
                labels=SKEW_DATA,
                natural=None,
            )
            sizes = np.array([len(c) for c in clients])
            cvs.append(sizes.std() / sizes.mean())
            tv = summarize(clients, SKEW_DATA, 10).tv
            assert np.average(tv, weights=sizes) < 0.2  # tiny clients are noisy; weight by size
        spreads.append(np.mean(cvs))
    assert spreads[0] < spreads[1] < spreads[2]


def test_different_seed_gives_different_partition() -> None:
    for name, make in SPECS.items():
        a = make_partition(make(5, 0), labels=SKEW_DATA, natural=None)
        b = make_partition(make(5, 1), labels=SKEW_DATA, natural=None)
        assert any(not np.array_equal(x, y) for x, y in zip(a, b, strict=True)), name


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "spec, labels, message",
    [
        (
            PartitionSpec("iid", 11),
            np.zeros(10, np.int64),
            r"num_clients=11 exceeds the 10 training examples",
        ),
        (
            PartitionSpec("shards", 3, shards_per_client=2),
            np.arange(100) % 10,
            r"6 shards must divide the 100 examples",
        ),
        (
            PartitionSpec("labels", 2, labels_per_client=11),
            np.arange(100) % 10,
            r"labels_per_client must be <= the 10",
        ),
        (
            PartitionSpec("labels", 2, labels_per_client=1),
            np.arange(100) % 10,
            r"cannot cover the 10 classes",
        ),
        (PartitionSpec("natural"), np.zeros(10, np.int64), r"needs data with owners"),
        (
            PartitionSpec("dirichlet", 10, alpha=0.5, min_size=50, max_tries=3),
            np.arange(400) % 4,
            r"max_tries=3 attempts",
        ),
        (
            PartitionSpec("quantity", 10, alpha=0.1, min_size=30, max_tries=2),
            np.zeros(400, np.int64),
            r"max_tries=2 attempts",
        ),
        (PartitionSpec("dirichlet", 2, alpha=1.0), np.linspace(0, 1, 50), r"needs class labels.*real-valued"),
    ],
)
def test_impossible_requests_are_config_errors(spec: PartitionSpec, labels: np.ndarray, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_partition(spec, labels=labels, natural=None)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"scheme": "dirichlet", "num_clients": 3, "alpha": -0.5}, r"partition.alpha must be > 0; got -0.5"),
        ({"scheme": "dirichlet", "num_clients": 3}, r"partition.alpha must be set for scheme 'dirichlet'"),
        ({"scheme": "iid"}, r"partition.num_clients must be set for scheme 'iid'"),
        ({"scheme": "iid", "num_clients": 3, "alpha": 0.1}, r"partition.alpha is not used by scheme 'iid'"),
        (
            {"scheme": "quantity", "num_clients": 3, "alpha": 1.0, "sigma": 1.0},
            r"exactly one of partition.alpha",
        ),
        ({"scheme": "shards", "num_clients": 3}, r"shards_per_client must be set"),
        ({"scheme": "iid", "num_clients": 0}, r"num_clients must be an integer >= 1; got 0"),
        ({"scheme": "dirichlt", "num_clients": 3}, r"did you mean 'dirichlet'"),
        (
            {"scheme": "iid", "num_clients": 3, "balanced": True},
            r"balanced applies to scheme 'dirichlet' only",
        ),
    ],
)
def test_spec_validation_messages(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PartitionSpec(**kwargs)  # type: ignore[arg-type]


def test_schemes_match_the_config() -> None:
    from fedcli.config.sections import SCHEMES as CONFIG_SCHEMES

    assert SCHEMES == CONFIG_SCHEMES


# ----------------------------------------------------------------------------- multi-label, summaries


def test_primary_tag_is_the_most_frequent_tag_of_the_row() -> None:
    """Tag frequencies (column sums) are [1, 3, 2]; row [1,0,1] -> tag 2 (freq 2 > 1),
    row [1,1,1] -> tag 1, row [0,0,0] -> the extra class 3."""
    tags = np.array([[1, 0, 1], [0, 1, 0], [1 * 0, 1, 1], [0, 1, 0], [0, 0, 0]])
    tags[0] = [1, 0, 1]
    tags[2] = [0, 1, 1]
    assert primary_tags(tags).tolist() == [2, 1, 1, 1, 3]
    clients = make_partition(PartitionSpec("dirichlet", 2, alpha=1.0, min_size=1), labels=tags, natural=None)
    _exactly_once(clients, 5)


def test_summary_statistics_by_hand() -> None:
    """Clients {0,0} and {1,1} of a 50/50 mix: entropy 0 bits each, global 1 bit, TV 0.5 each;
    an IID client of the same mix has entropy 1 and TV 0."""
    labels = np.array([0, 0, 1, 1, 0, 1])
    summary = summarize([np.array([0, 1]), np.array([2, 3]), np.array([4, 5])], labels, 2)
    np.testing.assert_allclose(summary.entropy, [0.0, 0.0, 1.0])
    np.testing.assert_allclose(summary.tv, [0.5, 0.5, 0.0])
    assert summary.global_entropy == pytest.approx(1.0)
    assert (summary.size_min, summary.size_median, summary.size_max) == (2, 2.0, 2)
    assert label_histograms([np.array([0, 2])], labels).tolist() == [[1, 1]]


def test_summary_of_real_targets_has_no_label_rows() -> None:
    summary = summarize([np.array([0]), np.array([1])], np.array([0.5, 1.5]), None)
    assert summary.entropy is None and summary.mean_tv is None and summary.num_assigned == 2


# ----------------------------------------------------------------------------- files


def _write(tmp_path, seed: int, name: str = "p.json"):  # noqa: ANN001, ANN202
    spec = PartitionSpec("dirichlet", 4, alpha=0.3, min_size=5, seed=seed)
    clients = make_partition(spec, labels=SKEW_DATA, natural=None)
    path = tmp_path / name
    save_partition(path, clients, spec=spec, dataset="toy", fingerprint="f" * 64, labels=SKEW_DATA)
    return path, clients, spec


def test_partition_file_round_trip_and_byte_identity(tmp_path) -> None:  # noqa: ANN001
    path, clients, spec = _write(tmp_path, seed=7)
    again, _, _ = _write(tmp_path, seed=7, name="q.json")
    other, _, _ = _write(tmp_path, seed=8, name="r.json")
    assert path.read_bytes() == again.read_bytes()
    assert path.read_bytes() != other.read_bytes()
    loaded, loaded_spec = load_partition(path, dataset="toy", fingerprint="f" * 64)
    assert loaded_spec == spec
    assert all(np.array_equal(a, b) for a, b in zip(clients, loaded, strict=True))
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed away


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda text: text[: len(text) // 2], r"is not valid JSON"),
        (lambda text: text.replace('"clients":[[', '"clients":[[1,'), r"fails its content hash"),
        (lambda text: text.replace('"version":1', '"version":99'), r"format version 99"),
        (
            lambda text: text.replace('"format":"fedcli-partition"', '"format":"other"'),
            r"is not a fedcli partition",
        ),
    ],
)
def test_damaged_partition_files_are_rejected(tmp_path, damage, message: str) -> None:  # noqa: ANN001
    path, _, _ = _write(tmp_path, seed=1)
    path.write_text(damage(path.read_text()))
    with pytest.raises(ConfigError, match=message):
        load_partition(path, dataset="toy", fingerprint="f" * 64)


def test_partition_for_other_data_is_rejected(tmp_path) -> None:  # noqa: ANN001
    path, _, _ = _write(tmp_path, seed=1)
    with pytest.raises(ConfigError, match=r"made for dataset 'toy', not 'mnist'"):
        load_partition(path, dataset="mnist", fingerprint="f" * 64)
    with pytest.raises(ConfigError, match=r"made for different 'toy' data \(fingerprint"):
        load_partition(path, dataset="toy", fingerprint="0" * 64)
    with pytest.raises(ConfigError, match=r"cannot read partition file"):
        load_partition(tmp_path / "missing.json", dataset="toy", fingerprint="f" * 64)


@pytest.mark.slow
def test_plot_writes_a_png(tmp_path) -> None:  # noqa: ANN001
    clients = make_partition(PartitionSpec("labels", 10, labels_per_client=2), labels=SKEW_DATA, natural=None)
    plot_partition(clients, SKEW_DATA, 10, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_ticks_are_whole_numbers() -> None:
    """Clients, labels, sizes and counts are integers: a 3-client plot once showed client 2.5 and
    0.5 clients. Every tick inside each axis' range (heatmap, colorbar, histogram) is whole."""
    labels = np.array([0, 1, 0, 1, 1, 0, 1, 0, 0, 1])
    fig = partition_figure([np.arange(0, 3), np.arange(3, 8), np.arange(8, 10)], labels, 2)
    fig.canvas.draw()
    checked = 0
    for ax in fig.axes:
        for axis, (low, high) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            ticks = [t for t in axis.get_majorticklocs() if min(low, high) <= t <= max(low, high)]
            assert ticks == [round(t) for t in ticks], (ax.get_title(), ticks)
            checked += len(ticks)
    assert len(fig.axes) == 3 and checked >= 8


def test_labels_with_fewer_clients_than_classes_covers_every_class() -> None:
    """5 clients x 2 labels on 10 classes (the Bayes-ADMM toy's class pairs): every class has
    exactly one holder, so every example is assigned once and each client has 2 classes."""
    for seed in range(5):
        clients = make_partition(
            PartitionSpec("labels", 5, labels_per_client=2, seed=seed), labels=SKEW_DATA, natural=None
        )
        _exactly_once(clients, len(SKEW_DATA))
        assert [len(np.unique(SKEW_DATA[c])) for c in clients] == [2] * 5
