"""Partitioners: split a data set's examples into federated clients (docs/style.md rule 16).

Every partitioner is a pure, eager function of (labels or natural owners, hyperparameters,
`rng`) that returns `list[np.ndarray]`, client k -> sorted int64 example indices. They are
seeded only through the `rng` argument; `make_partition` draws it from `PartitionSpec.seed`
(`np.random.default_rng(seed)`), so the same spec gives the same clients, byte for byte.

Schemes (reference/reference_code.md §6 gives the exact behaviour of each reference code):

- `iid`        NIID-Bench `homo`: a random permutation split into near-equal parts.
- `dirichlet`  NIID-Bench `noniid-labeldir` / FedLab `hetero_dir_partition` (Li et al.,
               "Federated Learning on Non-IID Data Silos", ICDE 2022, arXiv:2102.02079):
               per class, p ~ Dir(alpha 1_K) with the balance step and the whole-draw redraw
               until every client has >= min_size examples. With `balanced=True`: FedLab's
               `client_inner_dirichlet_partition` (Acar et al., FedDyn, ICLR 2021) with equal
               client sizes.
- `shards`     McMahan et al. 2017 (AISTATS, arXiv:1602.05629) pathological non-IID: sort by
               label, cut into num_clients * shards_per_client equal shards, deal s each.
- `labels`     NIID-Bench `noniid-#labelK`: client i holds class i mod C plus K-1 random others;
               each class is split evenly among its holders.
- `quantity`   quantity skew with IID labels: sizes ~ Dir(alpha) (NIID-Bench `iid-diff-quantity`)
               or sizes ~ LogNormal(log(N/K), sigma) (FedLab `lognormal_unbalance_split`).
- `two-level`  Bayesian-ADMM / Swaroop et al. 2025 App. E1 (reference/bayes_admm.md §9.2):
               client shares p ~ Dir(size_alpha), class mixes q_k ~ Dir(alpha), client k gets
               round(n_c p_k q_kc / sum_j p_j q_jc) of class c, a count of 1 becomes 2.
- `natural`    the data's own owners (writers, users, subjects, roles), in sorted-id order.

Multi-label targets (2-D 0/1 matrices): label-based schemes (dirichlet, shards, labels,
two-level) use each example's *primary tag*, its tag that is most frequent in the whole data
set (ties -> lower tag index); an example with no tag gets the extra class C. Real-valued or
sequence targets have no classes: those schemes are refused with a ConfigError.

Deviations (Paper/code: ... / Here: ...):
- Dirichlet redraw loops. Code: unbounded `while`. Here: at most `max_tries` whole draws,
  then a ConfigError stating the attempts and a fix.
- Balanced Dirichlet sizes. FedLab: int(N/K) each, the remainder dropped. Here: sizes differ
  by at most one and every example is assigned. FedLab takes class members in index order;
  here each class list is shuffled first. FedLab redraws a class until a non-exhausted one
  comes up; here the class is drawn from the prior restricted to non-exhausted classes
  (the same distribution, without the unbounded loop).
- Shards. FedLab drops the remainder with a warning; here shards that do not divide the
  examples are a ConfigError. The label sort is stable (FedLab's argsort is not).
- `#labels`. NIID-Bench crashes when a class has no holder (possible when K < C). Here, with
  fewer clients than classes, the extra classes are drawn from the still unheld classes
  first, so every class has a holder whenever K * labels_per_client >= C (else ConfigError);
  with K >= C the procedure is NIID-Bench's.
- Log-normal sizes and two-level: the reference code has no minimum size; here a draw
  with a client below `min_size` is redrawn (at most `max_tries` times) like Dirichlet.
- Two-level keeps the paper's rounding: every example is used at most once, but up to a
  few examples per class (about K/2) can stay unassigned. `summarize` reports how many.
- Every scheme: a client with no examples is a ConfigError (it could not train), and each
  client's indices are returned sorted (NIID-Bench shuffles them; batch order is the
  engine's job).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import math
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from fedcli.errors import ConfigError

log = logging.getLogger(__name__)

SCHEMES = ("natural", "iid", "dirichlet", "shards", "labels", "quantity", "two-level")
FORMAT = "fedcli-partition"
FORMAT_VERSION = 1
LABEL_SCHEMES = ("dirichlet", "shards", "labels", "two-level")


@dataclass(frozen=True)
class PartitionSpec:
    """Everything that determines a partition besides the data (saved in partition files)."""

    scheme: str  # one of SCHEMES
    num_clients: int | None = None  # K; None = every natural client (natural only)
    alpha: float | None = None  # Dirichlet concentration: labels (dirichlet, two-level), sizes (quantity)
    shards_per_client: int | None = None  # s of McMahan et al. (they use 2)
    labels_per_client: int | None = None  # K of NIID-Bench noniid-#labelK
    min_size: int = 10  # NIID-Bench min_require_size (FedLab uses the number of classes)
    seed: int = 0  # np.random.default_rng(seed) drives every draw
    balanced: bool = False  # dirichlet only: equal client sizes (FedLab client-inner Dirichlet)
    sigma: float | None = None  # quantity only: log-normal sigma of client sizes (FedLab unbalance_sgm)
    size_alpha: float = 1.0  # two-level only: alpha_1 of client shares (Bayes-ADMM data_generators.py)
    max_tries: int = 100  # bound on whole-draw redraws (docs/style.md rule 16)

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            match = difflib.get_close_matches(str(self.scheme), SCHEMES, n=1)
            hint = f" (did you mean {match[0]!r}?)" if match else ""
            raise ConfigError(f"partition.scheme must be one of {', '.join(SCHEMES)}; got {self.scheme!r}{hint}.")
        _check_range("num_clients", self.num_clients, 1)
        _check_range("shards_per_client", self.shards_per_client, 1)
        _check_range("labels_per_client", self.labels_per_client, 1)
        _check_range("min_size", self.min_size, 1, "A client with no examples cannot train.")
        _check_range("seed", self.seed, 0)
        _check_range("max_tries", self.max_tries, 1)
        for key in ("alpha", "sigma", "size_alpha"):  # a number, and finite (inf/NaN would be drawn from, or stored)
            value = getattr(self, key)
            if value is not None and isinstance(value, int | float) and not isinstance(value, bool) \
                    and not math.isfinite(value):
                raise ConfigError(f"partition.{key} must be a finite number; got {value!r}.")
        for key in ("alpha", "size_alpha"):
            value = getattr(self, key)
            if isinstance(value, int | float) and value > ALPHA_MAX:
                raise ConfigError(f"partition.{key} must be <= {ALPHA_MAX:g}; got {value!r}. A Dirichlet that flat "
                                  "is IID already (use --scheme iid), and numpy's draw underflows to zeros near 1e306.")
        if self.alpha is not None and not (isinstance(self.alpha, int | float) and self.alpha > 0):
            raise ConfigError(f"partition.alpha must be > 0; got {self.alpha!r}. "
                              "Smaller alpha = more skew (try 0.1); large alpha ≈ IID.")
        if self.sigma is not None and not (isinstance(self.sigma, int | float) and self.sigma >= 0):
            raise ConfigError(f"partition.sigma must be >= 0; got {self.sigma!r}. 0 = equal sizes; try 1.0.")
        if not (isinstance(self.size_alpha, int | float) and self.size_alpha > 0):
            raise ConfigError(f"partition.size_alpha must be > 0; got {self.size_alpha!r}. The paper uses 1.")
        self._check_needed()

    def _check_needed(self) -> None:
        scheme = self.scheme
        if scheme != "natural" and self.num_clients is None:
            raise ConfigError(f"partition.num_clients must be set for scheme {scheme!r}; got None. Pass --clients N.")
        needs = {"dirichlet": ("alpha", "try --alpha 0.1 (strong skew) or 1.0 (mild)"),
                 "two-level": ("alpha", "the Bayesian-ADMM paper uses --alpha 0.5 with size alpha 1"),
                 "shards": ("shards_per_client", "McMahan et al. use --shards-per-client 2"),
                 "labels": ("labels_per_client", "NIID-Bench uses --labels-per-client 1, 2 or 3")}
        if scheme in needs and getattr(self, needs[scheme][0]) is None:
            key, fix = needs[scheme]
            raise ConfigError(f"partition.{key} must be set for scheme {scheme!r}; got None; {fix}.")
        if scheme == "quantity" and (self.alpha is None) == (self.sigma is None):
            raise ConfigError(f"scheme 'quantity' needs exactly one of partition.alpha (Dirichlet sizes) or "
                              f"partition.sigma (log-normal sizes); got alpha={self.alpha!r}, sigma={self.sigma!r}.")
        used = {"alpha": ("dirichlet", "two-level", "quantity"), "sigma": ("quantity",),
                "shards_per_client": ("shards",), "labels_per_client": ("labels",)}
        for key, schemes in used.items():
            if getattr(self, key) is not None and scheme not in schemes:
                raise ConfigError(f"partition.{key} is not used by scheme {scheme!r}; got {getattr(self, key)!r}. "
                                  f"Remove it, or use scheme {' / '.join(schemes)}.")
        if self.balanced and scheme != "dirichlet":
            raise ConfigError(f"partition.balanced applies to scheme 'dirichlet' only; got scheme {scheme!r}.")


MIN_SIZE_SCHEMES = ("dirichlet", "quantity", "two-level")  # the schemes that redraw until clients reach min_size


def check_unused_defaults(spec: PartitionSpec) -> None:
    """min_size and size_alpha set away from their defaults must be used by the scheme.

    PartitionSpec cannot tell a default from a choice, so the CLI and the run config call this
    (for user input) and partition files do not (their specs hold the defaults of every scheme).
    """
    defaults = {f.name: f.default for f in fields(PartitionSpec)}
    uses_min_size = spec.scheme in MIN_SIZE_SCHEMES and not spec.balanced
    if spec.min_size != defaults["min_size"] and not uses_min_size:
        raise ConfigError(f"partition.min_size is not used by scheme {spec.scheme!r}"
                          f"{' with balanced' if spec.balanced else ''}; got {spec.min_size!r}. Remove it, or use "
                          "scheme dirichlet / quantity / two-level (which redraw until every client has min_size).")
    if spec.size_alpha != defaults["size_alpha"] and spec.scheme != "two-level":
        raise ConfigError(f"partition.size_alpha is not used by scheme {spec.scheme!r}; got {spec.size_alpha!r}. "
                          "Remove it, or use scheme two-level.")


INT_MAX = 2**31 - 1  # the largest integer setting (fedcli.config.INT_MAX: what the stores keep)
ALPHA_MAX = 1e6  # Dirichlet concentrations above it are IID for every partition size here


def _check_range(key: str, value: int | None, low: int, fix: str = "") -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ConfigError(f"partition.{key} must be an integer >= {low}; got {value!r}. {fix}".strip())
    if value > INT_MAX:
        raise ConfigError(f"partition.{key} must be at most {INT_MAX} (2**31 - 1); got {value!r}.")


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
    raise ConfigError(f"partition.scheme={scheme!r} needs class labels, but this task's targets are {kind}; "
                      "use --scheme iid, quantity or natural.")


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


def dirichlet_label_skew(labels: np.ndarray, *, num_clients: int, alpha: float, min_size: int,
                         max_tries: int, rng: np.random.Generator) -> list[np.ndarray]:
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
    raise ConfigError(f"scheme 'dirichlet' found no draw with every client >= min_size={min_size} examples in "
                      f"max_tries={max_tries} attempts (smallest client: {smallest}); raise --alpha, lower "
                      "--clients or lower --min-size.")


def balanced_dirichlet(labels: np.ndarray, *, num_clients: int, alpha: float,
                       rng: np.random.Generator) -> list[np.ndarray]:
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


def shard_partition(labels: np.ndarray, *, num_clients: int, shards_per_client: int,
                    rng: np.random.Generator) -> list[np.ndarray]:
    """McMahan et al.: sort by label, cut K*s equal shards, give each client s random shards."""
    n, num_shards = len(labels), num_clients * shards_per_client
    if num_shards > n or n % num_shards:
        valid = [d // shards_per_client for d in range(shards_per_client, n + 1, shards_per_client)
                 if n % d == 0]
        near = sorted(valid, key=lambda k: abs(k - num_clients))[:3]
        raise ConfigError(f"partition.num_clients={num_clients} x shards_per_client={shards_per_client} = "
                          f"{num_shards} shards must divide the {n} examples into equal shards; remainder "
                          f"{n % num_shards if num_shards <= n else n}. Valid --clients for this data and "
                          f"--shards-per-client: {', '.join(map(str, sorted(near))) or 'none'}.")
    size = n // num_shards
    order = np.argsort(labels, kind="stable")
    shard_ids = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return [np.concatenate([order[s * size:(s + 1) * size] for s in row]) for row in shard_ids]


def labels_per_client_partition(labels: np.ndarray, *, num_clients: int, labels_per_client: int,
                                rng: np.random.Generator) -> list[np.ndarray]:
    """NIID-Bench noniid-#labelK: client i holds class i mod C and K-1 other random classes;
    each class is split evenly (array_split) among its holders.

    With fewer clients than classes the K-1 extra classes are drawn from the classes no client
    holds yet while any remain (NIID-Bench would crash on a class without holder).
    """
    classes = np.unique(labels)
    num_classes = len(classes)
    if labels_per_client > num_classes:
        raise ConfigError(f"partition.labels_per_client must be <= the {num_classes} classes of this data; "
                          f"got {labels_per_client}.")
    if num_clients * labels_per_client < num_classes:
        raise ConfigError(f"partition.num_clients={num_clients} x labels_per_client={labels_per_client} cannot "
                          f"cover the {num_classes} classes; raise --clients or --labels-per-client.")
    holds: list[list[int]] = []
    for i in range(num_clients):
        held = [i % num_classes]
        while len(held) < labels_per_client:
            unheld = [c for c in range(num_classes) if c not in held and all(c not in h for h in holds)
                      and c >= num_clients] if num_clients < num_classes else []
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


def quantity_skew(num_examples: int, *, num_clients: int, alpha: float | None, sigma: float | None,
                  min_size: int, max_tries: int, rng: np.random.Generator) -> list[np.ndarray]:
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
            sizes = rng.lognormal(mean=math.log(int(n / num_clients)), sigma=sigma, size=num_clients)
            if not np.isfinite(sizes).all():
                raise ConfigError(f"partition.sigma={sigma!r} draws client sizes too large for a float (exp of "
                                  "sigma x N(0, 1)); use a sigma below 10 (FedLab's examples use 0.1 to 1).")
            sizes = (sizes / sizes.sum() * n).astype(int)
            diff = int(sizes.sum()) - n  # <= 0
            if diff:
                sizes[int(np.flatnonzero(sizes > diff)[0])] -= diff
            smallest = float(sizes.min())
            cuts = np.cumsum(sizes)[:-1]
        if smallest >= min_size:
            return list(np.split(perm, cuts))
    raise ConfigError(f"scheme 'quantity' found no draw with every client >= min_size={min_size} examples in "
                      f"max_tries={max_tries} attempts (smallest client: {smallest:.0f}); raise --alpha / lower "
                      "--sigma, lower --clients or lower --min-size.")


def two_level_dirichlet(labels: np.ndarray, *, num_clients: int, alpha: float, size_alpha: float,
                        min_size: int, max_tries: int, rng: np.random.Generator) -> list[np.ndarray]:
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
                parts[k].append(members[starts[k]:starts[k] + counts[k]])
        sizes = [sum(len(p) for p in client) for client in parts]
        smallest = min(sizes)
        if smallest >= min_size:
            return [np.concatenate(p) for p in parts]
    raise ConfigError(f"scheme 'two-level' found no draw with every client >= min_size={min_size} examples in "
                      f"max_tries={max_tries} attempts (smallest client: {smallest}); raise --size-alpha, lower "
                      "--clients or lower --min-size.")


def natural_partition(natural: list[np.ndarray] | None, *, num_clients: int | None) -> list[np.ndarray]:
    """The data's own owners in sorted-id order; num_clients keeps the first num_clients."""
    if not natural:
        raise ConfigError("partition.scheme='natural' needs data with owners (writers, users, subjects); this "
                          "task has none. Use --scheme iid, dirichlet, shards, labels, quantity or two-level.")
    if num_clients is not None and num_clients > len(natural):
        raise ConfigError(f"partition.num_clients={num_clients} exceeds the {len(natural)} natural clients of "
                          "this data; lower --clients or omit it to use them all.")
    return [np.asarray(ix) for ix in natural[: num_clients or len(natural)]]


def make_partition(spec: PartitionSpec, *, labels: np.ndarray, natural: list[np.ndarray] | None
                   ) -> list[np.ndarray]:
    """Return client -> sorted example indices for `spec`; ConfigError on impossible requests.

    Args:
        spec: the scheme and its parameters (validated on construction).
        labels: the training targets [N] (class ids) or [N, L] (multi-hot); see module docstring.
        natural: the data's natural client index (client k -> indices), or None / [] if none.
    """
    labels = np.asarray(labels)
    n, k = len(labels), spec.num_clients
    if k is not None and k > n:
        raise ConfigError(f"partition.num_clients={k} exceeds the {n} training examples; lower --clients.")
    rng = np.random.default_rng(spec.seed)
    y = class_labels(labels, spec.scheme) if spec.scheme in LABEL_SCHEMES else labels
    if spec.scheme == "natural":
        clients = natural_partition(natural, num_clients=k)
    elif spec.scheme == "iid":
        clients = iid_partition(n, num_clients=k, rng=rng)
    elif spec.scheme == "dirichlet" and spec.balanced:
        clients = balanced_dirichlet(y, num_clients=k, alpha=spec.alpha, rng=rng)
    elif spec.scheme == "dirichlet":
        clients = dirichlet_label_skew(y, num_clients=k, alpha=spec.alpha, min_size=spec.min_size,
                                       max_tries=spec.max_tries, rng=rng)
    elif spec.scheme == "shards":
        clients = shard_partition(y, num_clients=k, shards_per_client=spec.shards_per_client, rng=rng)
    elif spec.scheme == "labels":
        clients = labels_per_client_partition(y, num_clients=k, labels_per_client=spec.labels_per_client, rng=rng)
    elif spec.scheme == "quantity":
        clients = quantity_skew(n, num_clients=k, alpha=spec.alpha, sigma=spec.sigma, min_size=spec.min_size,
                                max_tries=spec.max_tries, rng=rng)
    else:
        clients = two_level_dirichlet(y, num_clients=k, alpha=spec.alpha, size_alpha=spec.size_alpha,
                                      min_size=spec.min_size, max_tries=spec.max_tries, rng=rng)
    clients = [np.sort(np.asarray(c, dtype=np.int64)) for c in clients]
    empty = [i for i, c in enumerate(clients) if len(c) == 0]
    if empty:
        raise ConfigError(f"scheme {spec.scheme!r} left {len(empty)} of {len(clients)} clients with no examples "
                          f"(first: client {empty[0]}); lower --clients or choose less extreme parameters.")
    return clients


# ----------------------------------------------------------------------------- summaries


@dataclass(frozen=True)
class PartitionSummary:
    """Heterogeneity statistics of one partition (`fedcli partition` prints them)."""

    num_clients: int
    num_examples: int  # examples in the data
    num_assigned: int  # examples given to some client
    size_min: int
    size_median: float
    size_max: int
    size_mean: float
    num_classes: int | None  # None when the targets have no classes
    entropy: np.ndarray | None  # [K] per-client label entropy in bits
    global_entropy: float | None  # entropy of the global label distribution, bits
    tv: np.ndarray | None  # [K] total-variation distance to the global label distribution

    @property
    def mean_entropy(self) -> float | None:
        return None if self.entropy is None else float(self.entropy.mean())

    @property
    def mean_tv(self) -> float | None:
        """Mean TV distance; for unordered classes it equals the earth mover's distance."""
        return None if self.tv is None else float(self.tv.mean())


def label_histograms(clients: list[np.ndarray], labels: np.ndarray, num_classes: int | None = None
                     ) -> np.ndarray | None:
    """Return [K, C] per-client label counts (tag counts for multi-hot), or None if no classes."""
    labels = np.asarray(labels)
    if labels.ndim == 1 and np.issubdtype(labels.dtype, np.integer) and (len(labels) == 0 or labels.min() >= 0):
        c = max(num_classes or 0, int(labels.max()) + 1 if len(labels) else 0)
        return np.stack([np.bincount(labels[ix], minlength=c) for ix in clients]).astype(np.int64)
    if labels.ndim == 2 and np.isin(labels, (0, 1)).all():
        return np.stack([labels[ix].sum(axis=0) for ix in clients]).astype(np.int64)
    return None


def _entropy_bits(p: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, -p * np.log2(np.where(p > 0, p, 1.0)), 0.0)
    return terms.sum(axis=-1)


def summarize(clients: list[np.ndarray], labels: np.ndarray, num_classes: int | None) -> PartitionSummary:
    """Sizes (min/median/max), per-client label entropy and TV distance to the global mix."""
    sizes = np.array([len(c) for c in clients])
    hist = label_histograms(clients, labels, num_classes)
    entropy = tv = global_entropy = None
    if hist is not None:
        totals = hist.sum(axis=1, keepdims=True)
        dist = hist / np.maximum(totals, 1)  # [K, C]
        overall = hist.sum(axis=0) / max(hist.sum(), 1)  # [C]
        entropy = _entropy_bits(dist)
        global_entropy = float(_entropy_bits(overall))
        tv = 0.5 * np.abs(dist - overall).sum(axis=1)
    assigned = int(len(np.unique(np.concatenate(clients)))) if clients else 0
    return PartitionSummary(
        num_clients=len(clients), num_examples=len(labels), num_assigned=assigned,
        size_min=int(sizes.min()), size_median=float(np.median(sizes)), size_max=int(sizes.max()),
        size_mean=float(sizes.mean()), num_classes=None if hist is None else hist.shape[1],
        entropy=entropy, global_entropy=global_entropy, tv=tv)


def plot_partition(clients: list[np.ndarray], labels: np.ndarray, num_classes: int | None, path: Path) -> None:
    """Draw the client x label count heatmap and the client size histogram to a PNG."""
    fig = partition_figure(clients, labels, num_classes)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(handle)
    try:  # temp file + rename: a failed write (disk full) leaves no half-written PNG
        fig.savefig(tmp, dpi=110, format="png")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def partition_figure(clients: list[np.ndarray], labels: np.ndarray, num_classes: int | None) -> Any:
    """The figure `plot_partition` saves: every axis counts clients, labels or examples, so
    every tick is a whole number."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    hist = label_histograms(clients, labels, num_classes)
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    heat, sizes = fig.subplots(1, 2, width_ratios=(2, 1))
    if hist is None:
        heat.text(0.5, 0.5, "targets have no classes", ha="center", va="center")
    else:
        image = heat.imshow(hist.T, aspect="auto", interpolation="nearest", cmap="viridis", origin="lower")
        fig.colorbar(image, ax=heat, label="examples", ticks=MaxNLocator(integer=True))
        heat.set_xlabel("client")
        heat.set_ylabel("label")
    heat.set_title("examples per client and label")
    sizes.hist([len(c) for c in clients], bins=min(30, max(len(clients), 1)), color="tab:blue")
    sizes.set_xlabel("client size (examples)")
    sizes.set_ylabel("clients")
    for axis in (heat.xaxis, heat.yaxis, sizes.xaxis, sizes.yaxis):  # clients, labels, sizes: whole numbers
        axis.set_major_locator(MaxNLocator(integer=True))
    sizes.set_title(f"{len(clients)} clients")
    return fig


# ----------------------------------------------------------------------------- files


def _canonical(doc: dict[str, Any]) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def save_partition(path: Path, clients: list[np.ndarray], *, spec: PartitionSpec, dataset: str,
                   fingerprint: str, labels: np.ndarray) -> None:
    """Write a partition file atomically (temp file + rename): clients, spec, checks, hash.

    The file is canonical JSON (sorted keys, no whitespace), so the same partition always
    gives the same bytes. `content_sha256` covers every other field.
    """
    hist = label_histograms(clients, labels)
    doc: dict[str, Any] = {
        "format": FORMAT, "version": FORMAT_VERSION, "dataset": dataset, "fingerprint": fingerprint,
        "spec": asdict(spec), "num_examples": int(len(labels)), "num_clients": len(clients),
        "clients": [[int(i) for i in c] for c in clients],
        "label_histograms": None if hist is None else hist.tolist(),
    }
    doc["content_sha256"] = hashlib.sha256(_canonical(doc).encode()).hexdigest()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as fh:
            fh.write(_canonical(doc) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a partition file is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_partition(path: Path, *, dataset: str, fingerprint: str) -> tuple[list[np.ndarray], PartitionSpec]:
    """Read and check a partition file; ConfigError naming the file and the fix on any problem."""
    path = Path(path)
    doc = _read_partition(path, dataset=dataset)
    if doc.get("fingerprint") != fingerprint:
        raise ConfigError(f"partition file {path} was made for different {dataset!r} data (fingerprint "
                          f"{str(doc.get('fingerprint'))[:12]}… ≠ {fingerprint[:12]}…): the data files, --data-dir "
                          f"or the seed of generated data differ; {_redo(path, dataset)}.")
    return _parse_clients(path, doc), _parse_spec(path, doc)


def check_partition_file(path: Path, *, dataset: str | None) -> None:
    """Every check of `load_partition` that needs no data (all but the fingerprint); ConfigError."""
    doc = _read_partition(Path(path), dataset=dataset)
    _parse_clients(path, doc)
    _parse_spec(path, doc)


def _redo(path: Path, dataset: str | None) -> str:
    return f"regenerate it with `fedcli partition --dataset {dataset or 'NAME'} ... --out {path}`"


def _read_partition(path: Path, *, dataset: str | None) -> dict[str, Any]:
    """The checked JSON document of a partition file (format, version, content hash, dataset name)."""
    redo = _redo(path, dataset)
    if path.is_dir():
        raise ConfigError(f"partition.file must be a partition file; got the directory {str(path)!r}. "
                          "Pass the .json file `fedcli partition --out` wrote.")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read partition file {path}: {exc.strerror or exc}.") from None
    except (ValueError, UnicodeDecodeError):
        raise ConfigError(f"partition file {path} is not valid JSON (truncated or not a partition file); "
                          f"{redo}.") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a fedcli partition file; write one with `fedcli partition`.")
    version = doc.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ConfigError(f"partition file {path} has format version {version!r}; this fedcli reads versions "
                          f"<= {FORMAT_VERSION}. Upgrade fedcli or {redo}.")
    claimed = doc.pop("content_sha256", None)
    if claimed != hashlib.sha256(_canonical(doc).encode()).hexdigest():
        raise ConfigError(f"partition file {path} fails its content hash: it was edited or corrupted; {redo}.")
    if dataset is not None and doc.get("dataset") != dataset:
        raise ConfigError(f"partition file {path} was made for dataset {doc.get('dataset')!r}, not {dataset!r}; "
                          f"use --task {doc.get('dataset')} or {redo}.")
    return doc


def _parse_clients(path: Path, doc: dict[str, Any]) -> list[np.ndarray]:
    n = doc.get("num_examples")
    try:
        clients = [np.asarray(c, dtype=np.int64) for c in doc["clients"]]
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"partition file {path} has a malformed 'clients' list; {_redo(path, doc.get('dataset'))}.") from None
    if not clients or any(c.ndim != 1 for c in clients):
        raise ConfigError(f"partition file {path} must hold a non-empty list of clients, each a list of example "
                          f"indices; {_redo(path, doc.get('dataset'))}.")
    flat = np.concatenate(clients)
    if not isinstance(n, int) or isinstance(n, bool) or (len(flat) and (flat.min() < 0 or flat.max() >= n)):
        raise ConfigError(f"partition file {path} has example indices outside 0..{n}-1; "
                          f"{_redo(path, doc.get('dataset'))}.")
    if len(np.unique(flat)) != len(flat):
        raise ConfigError(f"partition file {path} assigns some example to two clients; "
                          f"{_redo(path, doc.get('dataset'))}.")
    return clients


def _parse_spec(path: Path, doc: dict[str, Any]) -> PartitionSpec:
    raw = doc.get("spec")
    known = {f.name for f in fields(PartitionSpec)}
    if not isinstance(raw, dict) or not set(raw) <= known:
        raise ConfigError(f"partition file {path} has a malformed 'spec' section.")
    return PartitionSpec(**raw)
