"""PartitionSpec: what determines a partition besides the data, checked on construction (docs/style.md rule 16).

Part of datasets/partition/; imports no other part of it.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields

import numpy as np

from fedcli.errors import ConfigError

SCHEMES = ("natural", "iid", "dirichlet", "shards", "labels", "quantity", "two-level")
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
            raise ConfigError(
                f"partition.scheme must be one of {', '.join(SCHEMES)}; got {self.scheme!r}{hint}."
            )
        _check_range("num_clients", self.num_clients, 1)
        _check_range("shards_per_client", self.shards_per_client, 1)
        _check_range("labels_per_client", self.labels_per_client, 1)
        _check_range("min_size", self.min_size, 1, "A client with no examples cannot train.")
        _check_range("seed", self.seed, 0)
        _check_range("max_tries", self.max_tries, 1)
        for key in (
            "alpha",
            "sigma",
            "size_alpha",
        ):  # a number, and finite (inf/NaN would be drawn from, or stored)
            value = getattr(self, key)
            if (
                value is not None
                and isinstance(value, int | float)
                and not isinstance(value, bool)
                and not math.isfinite(value)
            ):
                raise ConfigError(f"partition.{key} must be a finite number; got {value!r}.")
        for key in ("alpha", "size_alpha"):
            value = getattr(self, key)
            if isinstance(value, int | float) and value > ALPHA_MAX:
                raise ConfigError(
                    f"partition.{key} must be <= {ALPHA_MAX:g}; got {value!r}. A Dirichlet that flat "
                    "is IID already (use --scheme iid), and numpy's draw underflows to zeros near 1e306."
                )
        if self.alpha is not None and not (isinstance(self.alpha, int | float) and self.alpha > 0):
            raise ConfigError(
                f"partition.alpha must be > 0; got {self.alpha!r}. "
                "Smaller alpha = more skew (try 0.1); large alpha ≈ IID."
            )
        if self.sigma is not None and not (isinstance(self.sigma, int | float) and self.sigma >= 0):
            raise ConfigError(f"partition.sigma must be >= 0; got {self.sigma!r}. 0 = equal sizes; try 1.0.")
        if not (isinstance(self.size_alpha, int | float) and self.size_alpha > 0):
            raise ConfigError(f"partition.size_alpha must be > 0; got {self.size_alpha!r}. The paper uses 1.")
        self._check_needed()

    def _check_needed(self) -> None:
        scheme = self.scheme
        if scheme != "natural" and self.num_clients is None:
            raise ConfigError(
                f"partition.num_clients must be set for scheme {scheme!r}; got None. Pass --clients N."
            )
        needs = {
            "dirichlet": ("alpha", "try --alpha 0.1 (strong skew) or 1.0 (mild)"),
            "two-level": ("alpha", "the Bayesian-ADMM paper uses --alpha 0.5 with size alpha 1"),
            "shards": ("shards_per_client", "McMahan et al. use --shards-per-client 2"),
            "labels": ("labels_per_client", "NIID-Bench uses --labels-per-client 1, 2 or 3"),
        }
        if scheme in needs and getattr(self, needs[scheme][0]) is None:
            key, fix = needs[scheme]
            raise ConfigError(f"partition.{key} must be set for scheme {scheme!r}; got None; {fix}.")
        if scheme == "quantity" and (self.alpha is None) == (self.sigma is None):
            raise ConfigError(
                f"scheme 'quantity' needs exactly one of partition.alpha (Dirichlet sizes) or "
                f"partition.sigma (log-normal sizes); got alpha={self.alpha!r}, sigma={self.sigma!r}."
            )
        used = {
            "alpha": ("dirichlet", "two-level", "quantity"),
            "sigma": ("quantity",),
            "shards_per_client": ("shards",),
            "labels_per_client": ("labels",),
        }
        for key, schemes in used.items():
            if getattr(self, key) is not None and scheme not in schemes:
                raise ConfigError(
                    f"partition.{key} is not used by scheme {scheme!r}; got {getattr(self, key)!r}. "
                    f"Remove it, or use scheme {' / '.join(schemes)}."
                )
        if self.balanced and scheme != "dirichlet":
            raise ConfigError(
                f"partition.balanced applies to scheme 'dirichlet' only; got scheme {scheme!r}."
            )


MIN_SIZE_SCHEMES = (
    "dirichlet",
    "quantity",
    "two-level",
)  # the schemes that redraw until clients reach min_size


def check_unused_defaults(spec: PartitionSpec) -> None:
    """min_size and size_alpha set away from their defaults must be used by the scheme.

    PartitionSpec cannot tell a default from a choice, so the CLI and the run config call this
    (for user input) and partition files do not (their specs hold the defaults of every scheme).
    """
    defaults = {f.name: f.default for f in fields(PartitionSpec)}
    uses_min_size = spec.scheme in MIN_SIZE_SCHEMES and not spec.balanced
    if spec.min_size != defaults["min_size"] and not uses_min_size:
        raise ConfigError(
            f"partition.min_size is not used by scheme {spec.scheme!r}"
            f"{' with balanced' if spec.balanced else ''}; got {spec.min_size!r}. Remove it, or use "
            "scheme dirichlet / quantity / two-level (which redraw until every client has min_size)."
        )
    if spec.size_alpha != defaults["size_alpha"] and spec.scheme != "two-level":
        raise ConfigError(
            f"partition.size_alpha is not used by scheme {spec.scheme!r}; got {spec.size_alpha!r}. "
            "Remove it, or use scheme two-level."
        )


INT_MAX = 2**31 - 1  # the largest integer setting (fedcli.config.checks.INT_MAX: what the stores keep)
ALPHA_MAX = 1e6  # Dirichlet concentrations above it are IID for every partition size here


def _check_range(key: str, value: int | None, low: int, fix: str = "") -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ConfigError(f"partition.{key} must be an integer >= {low}; got {value!r}. {fix}".strip())
    if value > INT_MAX:
        raise ConfigError(f"partition.{key} must be at most {INT_MAX} (2**31 - 1); got {value!r}.")
