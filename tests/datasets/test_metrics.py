"""Multi-label and next-token metrics against scikit-learn and hand-derived values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import f1_score, precision_score

from fedcli.datasets.metrics import (
    MULTILABEL,
    add_stats,
    multilabel_metrics,
    next_token,
    token_metrics,
)


def _multilabel_case(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(40, 12, generator=gen, dtype=torch.float64)
    targets = (torch.rand(40, 12, generator=gen) < 0.2).to(torch.float64)
    targets[:, 11] = 0.0  # a tag that never occurs ...
    logits[:, 11] = -5.0  # ... and is never predicted: F1 = 0 by convention
    return logits, targets


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_multilabel_matches_sklearn(seed: int) -> None:
    """precision = sklearn micro precision of (logit > 0); micro/macro-F1 = sklearn with
    zero_division=0 over all 12 tags; recall@5 = sum |top5 ∩ true| / sum |true| by hand."""
    logits, targets = _multilabel_case(seed)
    predicted = (logits > 0).numpy().astype(int)
    truth = targets.numpy().astype(int)
    top5 = np.argsort(-logits.numpy(), axis=1, kind="stable")[:, :5]
    recall5 = sum(truth[i, top5[i]].sum() for i in range(len(truth))) / truth.sum()
    metrics = multilabel_metrics(logits, targets)
    assert metrics["precision"] == pytest.approx(
        precision_score(truth, predicted, average="micro", zero_division=0)
    )
    assert metrics["micro_f1"] == pytest.approx(f1_score(truth, predicted, average="micro", zero_division=0))
    assert metrics["macro_f1"] == pytest.approx(f1_score(truth, predicted, average="macro", zero_division=0))
    assert metrics["recall_at_5"] == pytest.approx(recall5)


def test_multilabel_chunked_equals_whole() -> None:
    logits, targets = _multilabel_case(3)
    total = None
    for start in range(0, 40, 7):
        total = add_stats(total, MULTILABEL.stats(logits[start : start + 7], targets[start : start + 7]))
    assert MULTILABEL.finish(total) == pytest.approx(multilabel_metrics(logits, targets))


def test_empty_predictions_give_zero_not_nan() -> None:
    metrics = multilabel_metrics(torch.full((3, 4), -1.0), torch.zeros(3, 4))
    assert metrics == {"precision": 0.0, "recall_at_5": 0.0, "micro_f1": 0.0, "macro_f1": 0.0}


def test_token_metrics_by_hand() -> None:
    """Targets [5, 2, 0(pad)] and [3, 1(special), 0]: accuracy counts positions whose target is
    neither pad nor special (5, 2, 3); perplexity = exp(mean CE over the 4 non-pad tokens)."""
    vocab = 6
    targets = torch.tensor([[5, 2, 0], [3, 1, 0]])
    logits = torch.zeros(2, 3, vocab, dtype=torch.float64)
    logits[0, 0, 5] = 3.0  # right
    logits[0, 1, 4] = 3.0  # wrong (target 2)
    logits[1, 0, 3] = 3.0  # right
    logits[1, 1, 1] = 3.0  # right, but target 1 is special and not counted
    metrics = token_metrics(logits, targets, pad_id=0, special_ids=(1,))
    right = -math.log(math.exp(3) / (math.exp(3) + vocab - 1))
    wrong = -math.log(1 / (math.exp(3) + vocab - 1))
    assert metrics["accuracy"] == pytest.approx(2 / 3)
    assert metrics["perplexity"] == pytest.approx(math.exp((3 * right + wrong) / 4))
    fns = next_token(0, (1,))
    chunked = fns.finish(add_stats(fns.stats(logits[:1], targets[:1]), fns.stats(logits[1:], targets[1:])))
    assert chunked == pytest.approx(metrics)


@pytest.mark.parametrize(("seed", "top_k"), [(0, 1), (1, 2), (2, 3)])
def test_top_k_decision_rule_predicts_k_tags_per_example(seed: int, top_k: int) -> None:
    """multilabel(top_k=k): micro/macro-F1 of the mask of each row's k largest logits (by numpy's argsort,
    against scikit-learn), whatever the logits' sign; precision stays the 0.5-threshold one; chunked = whole."""
    from fedcli.datasets.metrics import decide, multilabel

    logits, targets = _multilabel_case(seed)
    logits = (
        logits - 10.0
    )  # every sigmoid < 0.5: the threshold rule predicts nothing, top-k still k tags a row
    truth = targets.numpy().astype(int)
    mask = np.zeros_like(truth)
    np.put_along_axis(mask, np.argsort(-logits.numpy(), axis=1, kind="stable")[:, :top_k], 1, axis=1)
    assert (decide(logits, top_k).numpy() == mask).all() and mask.sum(1).tolist() == [top_k] * len(mask)
    fns = multilabel(top_k=top_k)
    got = fns.finish(fns.stats(logits, targets))
    assert got["micro_f1"] == pytest.approx(f1_score(truth, mask, average="micro", zero_division=0))
    assert got["macro_f1"] == pytest.approx(f1_score(truth, mask, average="macro", zero_division=0))
    assert got["micro_f1"] > 0 and multilabel_metrics(logits, targets)["micro_f1"] == 0.0
    assert got["precision"] == 0.0  # nothing above 0.5
    chunked = fns.finish(
        add_stats(fns.stats(logits[:13], targets[:13]), fns.stats(logits[13:], targets[13:]))
    )
    assert chunked == pytest.approx(got)
    assert fns.rule == f"the {top_k} highest-scoring tags of each example are predicted (top-{top_k})"
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        multilabel(top_k=0)


def test_bibtex_decides_by_its_mean_label_cardinality() -> None:
    """bibtex's F1 rule is top-k with k = the training split's mean tags per entry (2.40), rounded; the run
    records the rule (data.f1_rule) for `fedcli report`."""
    from fedcli.datasets.registry import TASKS
    from fedcli.datasets.tasks import TaskOptions
    from fedcli.engine.evaluation import kind_metrics

    task = TASKS["bibtex"]
    data = task.load(TaskOptions())
    k = round(float(data.y.sum(1).mean()))
    fns = kind_metrics(task)
    assert fns is not None and fns.rule.endswith(f"(top-{k})") and task.record["f1_rule"].startswith(fns.rule)
    logits = torch.randn(data.test_y.shape, generator=torch.Generator().manual_seed(0)) - 10.0
    assert fns.finish(fns.stats(logits, data.test_y))["micro_f1"] > 0  # no tag above 0.5, still k predicted
