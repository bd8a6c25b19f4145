"""Paper-sized synthetic federations in the publishers' real on-disk formats.

``python -m fedcli.datasets.formats.generate FORMAT --clients N --out DIR --seed S`` writes a federation
that fedcli's own loaders read exactly as they read the published files:

- ``stackoverflow``: TFF h5 (datasets/formats/tff_h5.py) ``stackoverflow_train.h5``,
  ``stackoverflow_held_out.h5``, ``stackoverflow_test.h5`` with ``/examples/<client>/{tokens,
  title, tags}`` (variable-length UTF-8 byte strings; tags joined by '|'), plus
  ``stackoverflow.word_count`` and ``stackoverflow.tag_count``. Client sizes are lognormal with a
  heavy tail (the real federation: 342,477 users, ~135.8M training sentences, median far below
  the mean).
- ``emnist``: TFF ``fed_emnist_train.h5`` / ``fed_emnist_test.h5``, ``pixels`` float32
  [n, 28, 28] (1.0 = white background) and ``label`` int32 (62 classes; the real federation:
  3,400 writers, ~198 training images each).
- ``cifar100``: TFF ``fed_cifar100_train.h5`` / ``fed_cifar100_test.h5``, ``image`` uint8
  [n, 32, 32, 3], ``label`` and ``coarse_label`` (the real one: 500 clients of 100 images, 100
  test clients).
- ``leaf-femnist`` / ``leaf-shakespeare``: LEAF JSON (datasets/formats/leaf.py) ``train/*.json`` and
  ``test/*.json``, each ``{"users", "num_samples", "user_data"}``, at most 1,000 users a file.

The examples are synthetic (class prototypes plus noise; Zipf-distributed words): the files
have the real layout, sizes and skew, not the real content. Everything is generated per
batch of clients and streamed to disk, so 342,477 clients never sit in memory at once; the
same seed gives the same files.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedcli.datasets.formats.writers import write_leaf, write_tff
from fedcli.errors import DataError


@dataclass(frozen=True)
class Sizes:
    """Per-client example counts: lognormal(mean, sigma) rounded, clipped to [low, high]."""

    mean: float
    sigma: float
    low: int = 1
    high: int = 1_000_000
    test_fraction: float = 0.1  # test examples of a client ~ this fraction of its training ones
    test_clients: float = 1.0  # share of the clients that also have test examples


DEFAULTS = {
    # Reddi et al. 2021 Table 7 / TFF: 342,477 users, 135,818,730 train and 16,586,035 test sentences.
    "stackoverflow": Sizes(mean=397.0, sigma=1.9, high=200_000, test_fraction=0.12, test_clients=0.6),
    "emnist": Sizes(mean=198.0, sigma=0.35, low=20, high=500, test_fraction=0.115),  # 671,585 / 3,400 writers
    "cifar100": Sizes(mean=100.0, sigma=0.0, low=100, high=100, test_fraction=1.0, test_clients=0.2),
    "leaf-femnist": Sizes(mean=226.0, sigma=0.35, low=20, high=500, test_fraction=0.111),
    "leaf-shakespeare": Sizes(mean=3743.0 / 10, sigma=1.5, low=2, high=20_000, test_fraction=0.25),
}
FORMATS = tuple(DEFAULTS)


def client_sizes(rng: np.random.Generator, n: int, spec: Sizes) -> np.ndarray:
    """n lognormal sizes with the given mean (before clipping) and log-sd sigma, int64."""
    if spec.sigma == 0:
        return np.full(n, int(round(spec.mean)), dtype=np.int64).clip(spec.low, spec.high)
    mu = math.log(spec.mean) - spec.sigma**2 / 2
    return np.rint(rng.lognormal(mu, spec.sigma, n)).astype(np.int64).clip(spec.low, spec.high)


def test_sizes(rng: np.random.Generator, train: np.ndarray, spec: Sizes) -> np.ndarray:
    """Test counts: ~test_fraction of train (at least 1) for a test_clients share of the clients, else 0."""
    has = rng.random(len(train)) < spec.test_clients
    return np.where(has, np.maximum(1, np.rint(train * spec.test_fraction)).astype(np.int64), 0)


def client_ids(n: int, prefix: str = "") -> list[str]:
    """Zero-padded ids, so sorted-id order is generation order."""
    width = max(len(str(n - 1)), 1)
    return [f"{prefix}{k:0{width}d}" for k in range(n)]


# ----------------------------------------------------------------------------- text


def pseudo_words(n: int) -> list[str]:
    """n distinct lowercase pseudo-words (bijective base 26), shortest first like frequent words."""
    words = []
    for k in range(n):
        k += 1
        chars = []
        while k:
            k, r = divmod(k - 1, 26)
            chars.append(chr(97 + r))
        words.append("".join(reversed(chars)))
    return words


class Joiner:
    """Concatenate table entries given by ids, sep-separated, into one bytes string per group, vectorised."""

    def __init__(self, entries: list[bytes], sep: bytes) -> None:
        self.sep = len(sep)
        self.lengths = np.array([len(e) + len(sep) for e in entries], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        self.table = np.frombuffer(b"".join(e + sep for e in entries), dtype=np.uint8)

    def join(self, ids: np.ndarray, counts: np.ndarray) -> list[bytes]:
        """Group g = the entries ids[sum(counts[:g]) : +counts[g]] joined by sep (every count >= 1)."""
        if len(counts) == 0:
            return []
        piece = self.lengths[ids]
        out_start = np.cumsum(piece) - piece
        src = np.repeat(self.starts[ids] - out_start, piece) + np.arange(int(piece.sum()))
        raw = self.table[src].tobytes()
        ends = np.cumsum(np.add.reduceat(piece, np.cumsum(counts) - counts))
        begins = ends - np.add.reduceat(piece, np.cumsum(counts) - counts)
        return [raw[a : b - self.sep] for a, b in zip(begins.tolist(), ends.tolist(), strict=True)]


def split_clients(values: dict[str, Any], counts: np.ndarray) -> list[dict[str, Any]]:
    """Client k's slice of every value (arrays or lists of one row per example): the k-th run of counts[k] rows."""
    ends = np.cumsum(counts).tolist()
    return [{k: v[a:b] for k, v in values.items()} for a, b in zip([0, *ends][:-1], ends, strict=True)]


def zipf_ids(rng: np.random.Generator, n: int, vocab: int, exponent: float = 1.1) -> np.ndarray:
    """n ranks in [0, vocab) with P(r) ~ (r + 1)^-exponent."""
    cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -exponent)
    return np.searchsorted(cdf / cdf[-1], rng.random(n), side="right").clip(0, vocab - 1)


# ----------------------------------------------------------------------------- TFF h5


class StackOverflowText:
    """Zipf words over a vocabulary larger than the tasks' 10,000 (so OOV occurs), Zipf tags."""

    def __init__(self, vocab: int = 20_000, tags: int = 1_000, tokens_only: bool = False) -> None:
        self.tokens_only = tokens_only  # NWP reads only `tokens`; HDF5 dataset creation dominates the time
        self.words = pseudo_words(vocab)
        self.tags = [f"tag-{w}" for w in pseudo_words(tags)]
        self.word_join = Joiner([w.encode() for w in self.words], b" ")
        self.tag_join = Joiner([t.encode() for t in self.tags], b"|")

    def sentences(self, rng: np.random.Generator, n: int, mean_len: float, cap: int) -> list[bytes]:
        lengths = rng.geometric(1.0 / mean_len, n).clip(1, cap)
        return self.word_join.join(zipf_ids(rng, int(lengths.sum()), len(self.words)), lengths)

    def make(self, rng: np.random.Generator, counts: np.ndarray) -> list[dict[str, Any]]:
        total = int(counts.sum())
        fields = {"tokens": self.sentences(rng, total, 14.0, 60)}
        if not self.tokens_only:
            fields["title"] = self.sentences(rng, total, 8.0, 20)
            ntags = rng.integers(1, 4, total)
            fields["tags"] = self.tag_join.join(zipf_ids(rng, int(ntags.sum()), len(self.tags), 1.0), ntags)
        return split_clients(fields, counts)

    def write_counts(self, out: Path) -> None:
        ranks = np.arange(1, len(self.words) + 1, dtype=np.float64)
        counts = np.rint(1e9 * ranks**-1.1).astype(np.int64) + 1
        (out / "stackoverflow.word_count").write_text(
            "".join(f"{w}\t{c}\n" for w, c in zip(self.words, counts, strict=True))
        )
        tag_counts = np.rint(1e7 / np.arange(1, len(self.tags) + 1)).astype(np.int64) + 1
        (out / "stackoverflow.tag_count").write_text(
            json.dumps(dict(zip(self.tags, tag_counts.tolist(), strict=True)))
        )


def prototypes(rng: np.random.Generator, classes: int, shape: tuple[int, ...]) -> np.ndarray:
    """One smooth random ink pattern in [0, 1] per class (box-blurred noise, thresholded)."""
    noise = rng.random((classes, *shape))
    for axis in (1, 2):
        for _ in range(2):
            noise = (np.roll(noise, 1, axis) + noise + np.roll(noise, -1, axis)) / 3.0
    return (noise > np.quantile(noise, 0.8, axis=(1, 2), keepdims=True)).astype(np.float32)


class Images:
    """Class prototypes plus per-example noise; labels from a skewed global class distribution."""

    def __init__(self, seed: int, classes: int, shape: tuple[int, ...]) -> None:
        rng = np.random.default_rng([seed, 999])
        self.classes = classes
        self.protos = prototypes(rng, classes, shape)
        weights = rng.lognormal(0.0, 0.5, classes)
        self.p = weights / weights.sum()

    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.choice(self.classes, n, p=self.p)
        ink = self.protos[labels] * rng.uniform(0.6, 1.0, (n,) + (1,) * (self.protos.ndim - 1))
        ink = np.clip(ink + rng.normal(0.0, 0.15, ink.shape), 0.0, 1.0).astype(np.float32)
        return ink, labels

    def emnist(self, rng: np.random.Generator, counts: np.ndarray) -> list[dict[str, Any]]:
        """TFF EMNIST clients: `pixels` float32 (1.0 = white background) and `label` int32."""
        ink, labels = self.draw(rng, int(counts.sum()))
        # TFF/LEAF convention: 1.0 = white background, so pixels = 1 - ink, quantised to 1/255
        pixels = (1.0 - np.rint(ink * 255.0) / 255.0).astype(np.float32)
        return split_clients({"pixels": pixels, "label": labels.astype(np.int32)}, counts)

    def cifar(self, rng: np.random.Generator, counts: np.ndarray) -> list[dict[str, Any]]:
        """TFF CIFAR-100 clients: `image` uint8, `label` and `coarse_label` int64."""
        ink, labels = self.draw(rng, int(counts.sum()))
        image = np.rint(ink * 255.0).astype(np.uint8)
        return split_clients(
            {
                "image": image,
                "label": labels.astype(np.int64),
                "coarse_label": (labels // 5).astype(np.int64),
            },
            counts,
        )


# ----------------------------------------------------------------------------- LEAF JSON

SHAKESPEARE_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


def _femnist_user(images: Images) -> Callable[[np.random.Generator, np.ndarray], list[tuple[bytes, bytes]]]:
    values = Joiner([repr(1.0 - k / 255.0).encode() for k in range(256)], b", ")

    def make(rng: np.random.Generator, counts: np.ndarray) -> list[tuple[bytes, bytes]]:
        total = int(counts.sum())
        if total == 0:
            return []
        ink, labels = images.draw(rng, total)
        rows = values.join(np.rint(ink * 255.0).astype(np.int64).reshape(-1), np.full(total, 784))
        out, start = [], 0
        for c in counts:
            c = int(c)
            x = b"[[" + b"], [".join(rows[start : start + c]) + b"]]"
            out.append((x, json.dumps(labels[start : start + c].tolist()).encode()))
            start += c
        return out

    return make


def _shakespeare_user(
    rng0: np.random.Generator,
) -> Callable[[np.random.Generator, np.ndarray], list[tuple[bytes, bytes]]]:
    letters = np.frombuffer(SHAKESPEARE_LETTERS.encode("latin-1"), dtype=np.uint8)
    weights = rng0.lognormal(0.0, 1.0, len(letters))
    p = weights / weights.sum()

    def make(rng: np.random.Generator, counts: np.ndarray) -> list[tuple[bytes, bytes]]:
        out = []
        for c in counts:  # one role: a text of c + 80 letters, c sliding 80-letter windows
            text = letters[rng.choice(len(letters), int(c) + 80, p=p)].tobytes().decode("latin-1")
            xs = [text[i : i + 80] for i in range(int(c))]
            ys = [text[i + 80] for i in range(int(c))]
            out.append((json.dumps(xs).encode(), json.dumps(ys).encode()))
        return out

    return make


# ----------------------------------------------------------------------------- entry points


def generate(
    fmt: str,
    clients: int,
    out: Path,
    seed: int = 0,
    *,
    mean_size: float | None = None,
    sigma: float | None = None,
    max_size: int | None = None,
    quiet: bool = True,
    tokens_only: bool = False,
) -> dict[str, Any]:
    """Write a synthetic federation of `clients` clients in format `fmt` under `out`; return a summary
    (format, clients, per-split example counts and the files written). DataError on bad arguments.
    tokens_only (stackoverflow): write only `tokens` (enough for stackoverflow-nwp; faster:
    docs/scaling.md)."""
    if fmt not in DEFAULTS:
        raise DataError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}.")
    if clients < 1:
        raise DataError(f"--clients must be at least 1 (got {clients}).")
    spec = DEFAULTS[fmt]
    if mean_size is not None or sigma is not None or max_size is not None:
        if (
            (mean_size is not None and mean_size < 1)
            or (sigma is not None and sigma < 0)
            or (max_size is not None and max_size < 1)
        ):
            raise DataError("--mean-size and --max-size must be >= 1 and --sigma >= 0.")
        spec = Sizes(
            mean=mean_size if mean_size is not None else spec.mean,
            sigma=sigma if sigma is not None else spec.sigma,
            low=min(spec.low, max_size) if max_size is not None else spec.low,
            high=max_size if max_size is not None else spec.high,
            test_fraction=spec.test_fraction,
            test_clients=spec.test_clients,
        )
        if mean_size is not None and mean_size < spec.low:
            spec = Sizes(spec.mean, spec.sigma, 1, spec.high, spec.test_fraction, spec.test_clients)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 1])
    train = client_sizes(rng, clients, spec)
    test = test_sizes(rng, train, spec)
    if fmt == "cifar100":
        test = np.where(np.arange(clients) < max(1, round(clients * spec.test_clients)), train, 0)
    splits: dict[str, np.ndarray]
    if fmt == "stackoverflow":
        ids = client_ids(clients)
        held = np.where(test > 0, np.maximum(1, test // 4), 0)
        splits = {
            "stackoverflow_train.h5": train,
            "stackoverflow_held_out.h5": held,
            "stackoverflow_test.h5": test,
        }
        text = StackOverflowText(tokens_only=tokens_only)
        text.write_counts(out)
        write_tff(out, splits, ids, text.make, seed, quiet)
    elif fmt == "emnist":
        ids = [f"f{k}_{int(k) % 100:02d}" for k in client_ids(clients)]
        splits = {"fed_emnist_train.h5": train, "fed_emnist_test.h5": test}
        write_tff(out, splits, ids, Images(seed, 62, (28, 28)).emnist, seed, quiet)
    elif fmt == "cifar100":
        ids = client_ids(clients)
        splits = {"fed_cifar100_train.h5": train, "fed_cifar100_test.h5": test}
        write_tff(out, splits, ids, Images(seed, 100, (32, 32, 3)).cifar, seed, quiet)
    elif fmt == "leaf-femnist":
        ids = [f"f{k}_{int(k) % 100:02d}" for k in client_ids(clients)]
        splits = {"train": train, "test": test}
        write_leaf(out, ids, splits, _femnist_user(Images(seed, 62, (28, 28))), seed, quiet, "femnist")
    else:  # leaf-shakespeare
        ids = [f"ROLE_{k}" for k in client_ids(clients)]
        splits = {"train": train, "test": test}
        write_leaf(
            out, ids, splits, _shakespeare_user(np.random.default_rng([seed, 7])), seed, quiet, "shakespeare"
        )
    return {
        "format": fmt,
        "clients": clients,
        "seed": seed,
        "out": str(out),
        "examples": {name: int(c.sum()) for name, c in splits.items()},
        "clients_per_split": {name: int((c > 0).sum()) for name, c in splits.items()},
        "max_client_size": int(train.max()),
        "median_client_size": float(np.median(train)),
        "files": sorted(
            str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and not p.name.startswith(".")
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedcli.datasets.formats.generate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("format", choices=FORMATS)
    parser.add_argument("--clients", type=int, required=True, help="number of training clients")
    parser.add_argument("--out", type=Path, required=True, help="folder to write (pass it as --data-dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mean-size",
        type=float,
        default=None,
        help="mean training examples per client (default: the real federation's)",
    )
    parser.add_argument(
        "--sigma", type=float, default=None, help="log-sd of the lognormal client sizes (skew)"
    )
    parser.add_argument("--max-size", type=int, default=None, help="largest client")
    parser.add_argument(
        "--tokens-only",
        action="store_true",
        help="stackoverflow: write only tokens (stackoverflow-nwp; not -lr), ~3x faster",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        summary = generate(
            args.format,
            args.clients,
            args.out,
            args.seed,
            mean_size=args.mean_size,
            sigma=args.sigma,
            max_size=args.max_size,
            quiet=args.quiet,
            tokens_only=args.tokens_only,
        )
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"error: cannot write {args.out}: {exc.strerror or exc}; free space or choose another --out.",
            file=sys.stderr,
        )
        return 2
    print(json.dumps({k: v for k, v in summary.items() if k != "files"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
