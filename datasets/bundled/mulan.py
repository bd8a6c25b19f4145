"""MULAN multi-label data (sparse ARFF + XML label list): the bundled BibTeX tag set.

Katakis, Tsoumakas, Vlahavas. Multilabel Text Classification for Automated Tag Suggestion.
ECML/PKDD 2008 Discovery Challenge. BibTeX: 7,395 BibSonomy entries, 1,836 binary
bag-of-words features, 159 tags (2.4 per entry). It is fedcli's offline stand-in for
StackOverflow tag prediction: `bibtex` is multi-label logistic regression (one sigmoid
per tag, loss = BCE summed over tags) with precision@0.5, recall@5 and micro/macro-F1
(datasets/metrics.py).

Defaults (measurements in docs/out-of-the-box.md, "bibtex"): the F1 metrics decide by
top-k, k = `TOP_K` = 2, the training split's mean label cardinality (2.40 tags an entry) rounded:
with 2.4 positives among 159 tags every sigmoid stays below 0.5 for many rounds, so the 0.5
threshold predicted no tag (macro-F1 0.0001 after 25 rounds at lr 0.01) while the ranking was
already informative. The client lr is 0.3 (measured, FedAvg at 50 rounds on the default split:
top-2 macro-F1 1.6 / 7.8 / 16.3 / 25.4 % at lr 0.01 / 0.1 / 0.3 / 1; at 1 FedProx ends 3.0 points
below FedAvg after 25 rounds, at 0.3 every algorithm is within 3 points). The trivial predictors
score macro-F1 ≤ 3.0 % (every tag) and micro-F1 ≤ 9.8 % (the 3 most frequent training tags).

MULAN format: an ARFF header (`@attribute <name> {0,1}` lines, then `@data`) and one
sparse row per instance, `{index value,index value,...}` with 0-based attribute indices;
the XML file names the label attributes, all others are features.

Bundled (datasets/data/bibtex, see its README). The data has no train/test split and no
owners: the loader holds out a fixed 20 % (the last 1,479 of `np.random.default_rng(0)
.permutation(7395)`) as the test split, and partitions use --scheme iid/dirichlet/... with
each entry's primary tag (see datasets/partition/make.py) for label skew. Any MULAN data set
(e.g. delicious) loads with `load_mulan(arff, xml)`.
"""

from __future__ import annotations

import gzip
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch
from torch import Tensor

from fedcli.datasets import models
from fedcli.datasets.bundled.femnist import verify_checksums
from fedcli.datasets.bundled.stackoverflow import multilabel_loss
from fedcli.datasets.metrics import multilabel
from fedcli.datasets.sources import holdout
from fedcli.datasets.tasks import Task, TaskData, TaskOptions, fingerprint
from fedcli.errors import DataError

BUNDLED_DIR = Path(__file__).parents[1] / "data" / "bibtex"
TEST_FRACTION = 0.2
TOP_K = 2  # the F1 decision rule: the 2 highest-scoring tags of each entry (mean training cardinality 2.40)
CLIENT_LR = 0.3  # measured (module docstring)


def read_label_names(path: Path) -> list[str]:
    """Label attribute names from a MULAN XML file (<label name=...> elements, any namespace)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        raise DataError(f"MULAN label file {path} is not valid XML ({exc}).") from None
    names = [e.get("name", "") for e in root.iter() if e.tag.rsplit("}", 1)[-1] == "label"]
    if not names:
        raise DataError(f"MULAN label file {path} names no <label> elements.")
    return names


def read_sparse_arff(path: Path) -> tuple[list[str], np.ndarray, np.ndarray, int]:
    """Attribute names, (row, column) of every non-zero entry, and the number of rows."""
    try:
        with (
            gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")
        ) as fh:
            lines = fh.read().splitlines()
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:
        raise DataError(f"ARFF file {path} cannot be read ({exc}); it is truncated or corrupted.") from None
    names: list[str] = []
    data: list[str] = []
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("%"):
            continue
        if data or names and text.lower().startswith("@data"):
            if data and not (text.startswith("{") and text.endswith("}")):
                raise DataError(
                    f"{path}:{number}: expected a sparse row {{i v,...}}; got {text[:40]!r} "
                    "(truncated file?)."
                )
            data.append(text)
        elif text.lower().startswith("@attribute"):
            names.append(text.split()[1].strip("'\""))
    if not data:
        raise DataError(f"ARFF file {path} has no @data section; is it a MULAN ARFF file?")
    return (names, *_parse_sparse_rows(path, data[1:]), len(data) - 1)


def _parse_sparse_rows(path: Path, rows: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Parse '{i v,i v}' rows in one pass; return (row, column) of the entries with v != 0."""
    inner = [r[1:-1] for r in rows]
    counts = np.array([s.count(",") + 1 if s.strip() else 0 for s in inner])
    tokens = " ".join(inner).replace(",", " ").split()
    if len(tokens) != 2 * counts.sum():
        raise DataError(f"{path}: a sparse row does not consist of 'index value' pairs.")
    try:
        column = np.array(list(map(int, tokens[0::2])), dtype=np.int64)
        keep = np.array(list(map(float, tokens[1::2]))) != 0.0
    except ValueError:
        raise DataError(f"{path}: a sparse row holds a non-numeric index or value.") from None
    row = np.repeat(np.arange(len(rows)), counts)
    return row[keep], column[keep]


def load_mulan(arff: Path, xml: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Features uint8 [N, D], multi-hot labels float32 [N, L] and the label names."""
    names, row, column, num_rows = read_sparse_arff(arff)
    labels = read_label_names(xml)
    index = {n: i for i, n in enumerate(names)}
    unknown = [n for n in labels if n not in index]
    if unknown:
        raise DataError(f"{xml} names labels absent from {arff}: {', '.join(unknown[:3])}.")
    bad = np.flatnonzero((column < 0) | (column >= len(names)))
    if len(bad):
        raise DataError(f"{arff}: row {row[bad[0]]} uses attribute {column[bad[0]]}; there are {len(names)}.")
    dense = np.zeros((num_rows, len(names)), dtype=np.uint8)
    dense[row, column] = 1
    is_label = np.zeros(len(names), dtype=bool)
    is_label[[index[n] for n in labels]] = True
    return dense[:, ~is_label], dense[:, [index[n] for n in labels]].astype(np.float32), labels


def _load_bibtex(options: TaskOptions) -> TaskData:
    folder = Path(options.data_dir) if options.data_dir is not None else BUNDLED_DIR
    arff = folder / "bibtex.arff.gz" if (folder / "bibtex.arff.gz").exists() else folder / "bibtex.arff"
    if not arff.exists() or not (folder / "bibtex.xml").exists():
        raise DataError(
            f"BibTeX data not found in {folder} (expected bibtex.arff(.gz) and bibtex.xml from MULAN)."
        )
    verify_checksums(folder)
    features, tags, _ = load_mulan(arff, folder / "bibtex.xml")
    train, test = holdout(len(tags), int(round(TEST_FRACTION * len(tags))))
    x, y = torch.from_numpy(features[train]), torch.from_numpy(tags[train])
    return TaskData(
        x=x,
        y=y,
        client_indices=[],
        client_names=[],
        test_x=torch.from_numpy(features[test]),
        test_y=torch.from_numpy(tags[test]),
        fingerprint=fingerprint(x, y),
        num_classes=tags.shape[1],
    )


def _as_float(x: Tensor) -> Tensor:
    return x.to(torch.float32)


BIBTEX = Task(
    name="bibtex",
    description="BibTeX tag prediction (MULAN): 1,836 binary words -> 159 tags, multi-label, no natural clients",
    source="bundled MULAN bibtex (datasets/data/bibtex)",
    offline=True,
    kind="multilabel",
    models=MappingProxyType({"logreg": lambda: models.Linear(1836, 159)}),
    default_model="logreg",
    load=_load_bibtex,
    prepare=_as_float,
    example_loss=multilabel_loss,
    metrics=multilabel(top_k=TOP_K),
    client_lr=CLIENT_LR,
    # recorded with every run (data.f1_rule); `fedcli report` prints it under its F1 tables
    record=MappingProxyType(
        {
            "f1_rule": multilabel(top_k=TOP_K).rule + "; k = the training split's mean "
            "label cardinality 2.40, rounded"
        }
    ),
)

TASKS = (BIBTEX,)
