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

Layout (datasets/partition/): `spec` (PartitionSpec and its checks), `schemes` (the
partitioners above, and the label helpers), `summary` (statistics and the figure), `files`
(partition files); `make_partition`, here, dispatches a spec to its partitioner. None of them
imports this module; import each name from the module that defines it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from fedcli.datasets.partition.schemes import (
    balanced_dirichlet,
    class_labels,
    dirichlet_label_skew,
    iid_partition,
    labels_per_client_partition,
    natural_partition,
    quantity_skew,
    shard_partition,
    two_level_dirichlet,
)
from fedcli.datasets.partition.spec import LABEL_SCHEMES, PartitionSpec
from fedcli.errors import ConfigError

log = logging.getLogger(__name__)


def make_partition(
    spec: PartitionSpec, *, labels: np.ndarray, natural: Sequence[np.ndarray] | None
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
    else:
        assert k is not None  # PartitionSpec._check_needed: every scheme but natural needs num_clients
        clients = _split(spec, y, n=n, k=k, rng=rng)
    clients = [np.sort(np.asarray(c, dtype=np.int64)) for c in clients]
    empty = [i for i, c in enumerate(clients) if len(c) == 0]
    if empty:
        raise ConfigError(
            f"scheme {spec.scheme!r} left {len(empty)} of {len(clients)} clients with no examples "
            f"(first: client {empty[0]}); lower --clients or choose less extreme parameters."
        )
    return clients


def _split(
    spec: PartitionSpec, y: np.ndarray, *, n: int, k: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """`make_partition`'s dispatch for every scheme but natural: k clients from n examples (y: class ids)."""
    # PartitionSpec._check_needed guarantees each scheme's required parameter (asserted below):
    # alpha for dirichlet and two-level, shards_per_client for shards, labels_per_client for labels.
    if spec.scheme == "iid":
        return iid_partition(n, num_clients=k, rng=rng)
    if spec.scheme == "dirichlet":
        assert spec.alpha is not None
        if spec.balanced:
            return balanced_dirichlet(y, num_clients=k, alpha=spec.alpha, rng=rng)
        return dirichlet_label_skew(
            y, num_clients=k, alpha=spec.alpha, min_size=spec.min_size, max_tries=spec.max_tries, rng=rng
        )
    if spec.scheme == "shards":
        assert spec.shards_per_client is not None
        return shard_partition(y, num_clients=k, shards_per_client=spec.shards_per_client, rng=rng)
    if spec.scheme == "labels":
        assert spec.labels_per_client is not None
        return labels_per_client_partition(
            y, num_clients=k, labels_per_client=spec.labels_per_client, rng=rng
        )
    if spec.scheme == "quantity":
        return quantity_skew(
            n,
            num_clients=k,
            alpha=spec.alpha,
            sigma=spec.sigma,
            min_size=spec.min_size,
            max_tries=spec.max_tries,
            rng=rng,
        )
    assert spec.alpha is not None  # two-level, the last scheme
    return two_level_dirichlet(
        y,
        num_clients=k,
        alpha=spec.alpha,
        size_alpha=spec.size_alpha,
        min_size=spec.min_size,
        max_tries=spec.max_tries,
        rng=rng,
    )
