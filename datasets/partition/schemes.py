"""The partitioners: pure, eager functions of (labels or natural owners, hyperparameters, `rng`).

Part of datasets/partition/ (`make.make_partition` dispatches to these functions); each scheme's reference and the deviations from the
reference code are in that module's docstring. Client k -> int64 example indices; randomness
only through the `rng` argument.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fedcli.errors import ConfigError

# ----------------------------------------------------------------------------- labels


def class_labels(labels: np.ndarray, scheme: str) -> np.ndarray:
    """Return one class id per example for label-based schemes (primary tag if multi-label)."""
    labels = np.asarray(labels)
    if labels.ndim == 1 and np.issubdtype(labels.dtype, np.integer):
        if len(labels) and labels.min() < 0:
            raise ConfigError(f"scheme {scheme!r} needs class labels >= 0; got a label {int(labels.min())}.")
        return labels.astype(np.int64)
    if labels.ndim == 2 and np.isin(labels, (0, 1)).all():
        return primary_tags(labels)
    kind = "real-valued" if labels.ndim == 1 else f"{labels.ndim}-D sequence"
    raise ConfigError(
        f"partition.scheme={scheme!r} needs class labels, but this task's targets are {kind}; "
        "use --scheme iid, quantity or natural."
    )


def primary_tags(multi_hot: np.ndarray) -> np.ndarray:
    """Return each row's most globally frequent tag (ties -> lower index); no tag -> C."""
    multi_hot = np.asarray(multi_hot) > 0
    num_tags = multi_hot.shape[1]
    rank = np.argsort(-multi_hot.sum(axis=0), kind="stable")  # rank[0] = most frequent tag
    ranked = multi_hot[:, rank]  # columns in frequency order
    first = ranked.argmax(axis=1)
    return np.where(ranked.any(axis=1), rank[first], num_tags).astype(np.int64)


# ----------------------------------------------------------------------------- partitioners


def iid_partition(num_examples: int, *, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """NIID-Bench `homo`: split a random permutation into num_clients near-equal parts."""
    return list(np.array_split(rng.permutation(num_examples), num_clients))


def dirichlet_label_skew(
    labels: np.ndarray,
    *,
    num_clients: int,
    alpha: float,
    min_size: int,
    max_tries: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Split each class's examples across clients with shares p ~ Dir(alpha 1_K) (NIID-Bench).

    Balance step: a client already holding >= N/K examples gets p_j = 0 for later classes.
    Split points are (cumsum(p) * n_c).astype(int). The whole draw repeats until every client
    has >= min_size examples, at most max_tries times.
    """
    n = len(labels)
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    smallest = 0
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for members in by_class:
            members = rng.permutation(members)
            p = rng.dirichlet(np.full(num_clients, alpha)) * (sizes < n / num_clients)
            p = p / p.sum() if p.sum() > 0 else (sizes < n / num_clients) / (sizes < n / num_clients).sum()
            cuts = (np.cumsum(p) * len(members)).astype(int)[:-1]
            for k, piece in enumerate(np.split(members, cuts)):
                parts[k].append(piece)
                sizes[k] += len(piece)
        smallest = int(sizes.min())
        if smallest >= min_size:
            return [np.concatenate(p) for p in parts]
    raise ConfigError(
        f"scheme 'dirichlet' found no draw with every client >= min_size={min_size} examples in "
        f"max_tries={max_tries} attempts (smallest client: {smallest}); raise --alpha, lower "
        "--clients or lower --min-size."
    )


def balanced_dirichlet(
    labels: np.ndarray, *, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Equal-size clients whose class mix follows a prior q_k ~ Dir(alpha 1_C) (FedLab).

    Repeatedly pick a non-full client uniformly and draw a class from its prior restricted
    to classes with examples left; take one example of that class.
    """
    classes = np.unique(labels)
    pools = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
    left = np.array([len(p) for p in pools])
    priors = rng.dirichlet(np.full(len(classes), alpha), size=num_clients)  # [K, C]
    room = np.array([len(s) for s in np.array_split(np.arange(len(labels)), num_clients)])
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for _ in range(len(labels)):
        open_clients = np.flatnonzero(room > 0)
        k = int(open_clients[rng.integers(len(open_clients))])
        weights = priors[k] * (left > 0)
        if weights.sum() <= 0:  # the prior puts no mass on the classes left (underflow)
            weights = (left > 0).astype(float)
        c = int(np.searchsorted(np.cumsum(weights), rng.random() * weights.sum(), side="right"))
        c = min(c, len(classes) - 1)
        left[c] -= 1
        room[k] -= 1
        parts[k].append(int(pools[c][left[c]]))
    return [np.asarray(p, dtype=np.int64) for p in parts]


def shard_partition(
    labels: np.ndarray, *, num_clients: int, shards_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """McMahan et al.: sort by label, cut K*s equal shards, give each client s random shards."""
    n, num_shards = len(labels), num_clients * shards_per_client
    if num_shards > n or n % num_shards:
        valid = [
            d // shards_per_client for d in range(shards_per_client, n + 1, shards_per_client) if n % d == 0
        ]
        near = sorted(valid, key=lambda k: abs(k - num_clients))[:3]
        raise ConfigError(
            f"partition.num_clients={num_clients} x shards_per_client={shards_per_client} = "
            f"{num_shards} shards must divide the {n} examples into equal shards; remainder "
            f"{n % num_shards if num_shards <= n else n}. Valid --clients for this data and "
            f"--shards-per-client: {', '.join(map(str, sorted(near))) or 'none'}."
        )
    size = n // num_shards
    order = np.argsort(labels, kind="stable")
    shard_ids = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return [np.concatenate([order[s * size : (s + 1) * size] for s in row]) for row in shard_ids]


def labels_per_client_partition(
    labels: np.ndarray, *, num_clients: int, labels_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """NIID-Bench noniid-#labelK: client i holds class i mod C and K-1 other random classes;
    each class is split evenly (array_split) among its holders.

    With fewer clients than classes the K-1 extra classes are drawn from the classes no client
    holds yet while any remain (NIID-Bench would crash on a class without holder).
    """
    classes = np.unique(labels)
    num_classes = len(classes)
    if labels_per_client > num_classes:
        raise ConfigError(
            f"partition.labels_per_client must be <= the {num_classes} classes of this data; "
            f"got {labels_per_client}."
        )
    if num_clients * labels_per_client < num_classes:
        raise ConfigError(
            f"partition.num_clients={num_clients} x labels_per_client={labels_per_client} cannot "
            f"cover the {num_classes} classes; raise --clients or --labels-per-client."
        )
    holds: list[list[int]] = []
    for i in range(num_clients):
        held = [i % num_classes]
        while len(held) < labels_per_client:
            unheld = (
                [
                    c
                    for c in range(num_classes)
                    if c not in held and all(c not in h for h in holds) and c >= num_clients
                ]
                if num_clients < num_classes
                else []
            )
            c = int(unheld[rng.integers(len(unheld))]) if unheld else int(rng.integers(num_classes))
            if c not in held:
                held.append(c)
        holds.append(held)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(num_classes):
        holders = [i for i in range(num_clients) if c in holds[i]]
        members = rng.permutation(np.flatnonzero(labels == classes[c]))
        for i, piece in zip(holders, np.array_split(members, len(holders)), strict=True):
            parts[i].append(piece)
    return [np.concatenate(p) for p in parts]


def quantity_skew(
    num_examples: int,
    *,
    num_clients: int,
    alpha: float | None,
    sigma: float | None,
    min_size: int,
    max_tries: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """IID labels, skewed sizes: p ~ Dir(alpha) (NIID-Bench) or LogNormal(log(N/K), sigma) (FedLab)."""
    n = num_examples
    perm = rng.permutation(n)
    smallest = 0.0
    for _ in range(max_tries):
        if alpha is not None:  # NIID-Bench iid-diff-quantity: check min(p * N) before truncation
            p = rng.dirichlet(np.full(num_clients, alpha))
            smallest = float(np.min(p * n))
            cuts = (np.cumsum(p / p.sum()) * n).astype(int)[:-1]
        else:  # FedLab lognormal_unbalance_partition, its deficit fix included
            assert sigma is not None  # PartitionSpec: quantity takes alpha or sigma
            sizes = rng.lognormal(mean=math.log(int(n / num_clients)), sigma=sigma, size=num_clients)
            if not np.isfinite(sizes).all():
                raise ConfigError(
                    f"partition.sigma={sigma!r} draws client sizes too large for a float (exp of "
                    "sigma x N(0, 1)); use a sigma below 10 (FedLab's examples use 0.1 to 1)."
                )
            sizes = (sizes / sizes.sum() * n).astype(int)
            diff = int(sizes.sum()) - n  # <= 0
            if diff:
                sizes[int(np.flatnonzero(sizes > diff)[0])] -= diff
            smallest = float(sizes.min())
            cuts = np.cumsum(sizes)[:-1]
        if smallest >= min_size:
            return list(np.split(perm, cuts))
    raise ConfigError(
        f"scheme 'quantity' found no draw with every client >= min_size={min_size} examples in "
        f"max_tries={max_tries} attempts (smallest client: {smallest:.0f}); raise --alpha / lower "
        "--sigma, lower --clients or lower --min-size."
    )


def two_level_dirichlet(
    labels: np.ndarray,
    *,
    num_clients: int,
    alpha: float,
    size_alpha: float,
    min_size: int,
    max_tries: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Bayesian-ADMM split: p ~ Dir(size_alpha 1_K), q_k ~ Dir(alpha 1_C); client k gets
    round(n_c p_k q_kc / sum_j p_j q_jc) examples of class c (1 -> 2), sliced in turn from a
    shuffled class list (so a class can run short for the last clients)."""
    classes = np.unique(labels)
    smallest = 0
    for _ in range(max_tries):
        share = rng.dirichlet(np.full(num_clients, size_alpha))  # [K]
        mix = rng.dirichlet(np.full(len(classes), alpha), size=num_clients)  # [K, C]
        weight = share[:, None] * mix  # [K, C]
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c, label in enumerate(classes):
            members = rng.permutation(np.flatnonzero(labels == label))
            counts = np.round(len(members) * weight[:, c] / weight[:, c].sum()).astype(int)
            counts[counts == 1] = 2
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
            for k in range(num_clients):
                parts[k].append(members[starts[k] : starts[k] + counts[k]])
        sizes = [sum(len(p) for p in client) for client in parts]
        smallest = min(sizes)
        if smallest >= min_size:
            return [np.concatenate(p) for p in parts]
    raise ConfigError(
        f"scheme 'two-level' found no draw with every client >= min_size={min_size} examples in "
        f"max_tries={max_tries} attempts (smallest client: {smallest}); raise --size-alpha, lower "
        "--clients or lower --min-size."
    )


def natural_partition(natural: Sequence[np.ndarray] | None, *, num_clients: int | None) -> list[np.ndarray]:
    """The data's own owners in sorted-id order; num_clients keeps the first num_clients."""
    if not natural:
        raise ConfigError(
            "partition.scheme='natural' needs data with owners (writers, users, subjects); this "
            "task has none. Use --scheme iid, dirichlet, shards, labels, quantity or two-level."
        )
    if num_clients is not None and num_clients > len(natural):
        raise ConfigError(
            f"partition.num_clients={num_clients} exceeds the {len(natural)} natural clients of "
            "this data; lower --clients or omit it to use them all."
        )
    return [np.asarray(ix) for ix in natural[: num_clients or len(natural)]]
