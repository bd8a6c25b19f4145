"""Metric math of the multi-label and next-token tasks, as pure tensor functions.

Each metric family comes as `*_stats(output, target) -> dict[str, Tensor]` (sums that add
over evaluation chunks) and `*_finish(stats) -> dict[str, float]`, so an evaluator can
stream the test set in chunks and still get exact corpus-level numbers; `*_metrics` does
both for one batch. Definitions (the keys become `eval/<name>`):

Multi-label (scores = logits [N, L], targets = 0/1 [N, L]; StackOverflow LR, BibTeX):
- precision: micro precision of "sigmoid(logit) > 0.5" (logit > 0), i.e. Keras
  `Precision()` as in Reddi et al. 2021: sum TP / sum predicted positives (0 if none).
- recall_at_5: micro recall of the top-5 logits per example, Keras `Recall(top_k=5)`:
  sum |top5 ∩ true| / sum |true| (0 if no true tags).
- micro_f1 / macro_f1: F1 of the task's decision rule (`multilabel(top_k)`): threshold 0.5
  (sigmoid(logit) > 0.5, the default, `MULTILABEL`) or the top-k logits of each example
  (`multilabel(top_k=k)`; bibtex uses k = 2, its training set's mean label cardinality 2.40
  rounded: a model trained for a few rounds puts no tag above 0.5, docs/out-of-the-box.md),
  pooled over all tags / averaged over tags; a tag with no true and no predicted positives
  scores 0 (scikit-learn's `zero_division=0`), so macro_f1 = mean over all L tags.
  `MetricFns.rule` states the rule in words (`fedcli report` prints it with its F1 table).

Next token (logits [N, T, V], targets [N, T]; StackOverflow NWP):
- accuracy: argmax == target over positions whose target is not a special token (pad, OOV,
  BOS, EOS by default; Reddi et al. report accuracy without special tokens).
- perplexity: exp(mean token cross-entropy over non-pad positions).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor


class MetricFns(NamedTuple):
    """A task's chunkable metrics: stats per chunk (summed by key), then finish; `rule` states the
    decision rule of its F1 metrics in words ('' when it has none)."""

    stats: Callable[[Tensor, Tensor], dict[str, Tensor]]
    finish: Callable[[dict[str, Tensor]], dict[str, float]]
    rule: str = ""


THRESHOLD_RULE = "a tag is predicted when sigmoid(logit) > 0.5"


def decide(logits: Tensor, top_k: int | None = None) -> Tensor:
    """The predicted tags [N, L] (bool): logit > 0 (sigmoid > 0.5), or the `top_k` largest logits per row."""
    if top_k is None:
        return logits > 0.0
    top = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).indices
    return torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, top, True)


def multilabel_stats(
    logits: Tensor, targets: Tensor, *, k: int = 5, top_k: int | None = None
) -> dict[str, Tensor]:
    """Per-tag TP/FP/FN of the decision rule (threshold 0.5, or `top_k` tags per example), the
    0.5-threshold precision's counts and the top-k recall's hits: sums over the examples of a chunk."""
    truth = targets > 0.5  # [N, L]
    at_half = logits > 0.0  # sigmoid(logit) > 0.5
    predicted = at_half if top_k is None else decide(logits, top_k)
    top = torch.topk(logits, min(k, logits.shape[-1]), dim=-1).indices  # [N, k]
    hits = truth.gather(-1, top).sum()
    return {
        "tp": (predicted & truth).sum(dim=0).to(torch.float64),  # [L]
        "fp": (predicted & ~truth).sum(dim=0).to(torch.float64),
        "fn": (~predicted & truth).sum(dim=0).to(torch.float64),
        "tp_at_half": (at_half & truth).sum().to(torch.float64),
        "predicted_at_half": at_half.sum().to(torch.float64),
        "topk_hits": hits.to(torch.float64),
        "num_true": truth.sum().to(torch.float64),
    }


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0


def multilabel_finish(stats: dict[str, Tensor]) -> dict[str, float]:
    """precision, recall_at_5, micro_f1, macro_f1 from summed stats (see module docstring)."""
    tp, fp, fn = stats["tp"], stats["fp"], stats["fn"]
    per_tag_denominator = 2 * tp + fp + fn
    per_tag_f1 = torch.where(
        per_tag_denominator > 0, 2 * tp / per_tag_denominator.clamp_min(1), torch.zeros_like(tp)
    )
    return {
        "precision": _ratio(float(stats["tp_at_half"]), float(stats["predicted_at_half"])),
        "recall_at_5": _ratio(float(stats["topk_hits"]), float(stats["num_true"])),
        "micro_f1": _ratio(float(2 * tp.sum()), float(per_tag_denominator.sum())),
        "macro_f1": float(per_tag_f1.mean()),
    }


def multilabel_metrics(
    logits: Tensor, targets: Tensor, *, k: int = 5, top_k: int | None = None
) -> dict[str, float]:
    """All multi-label metrics of one batch."""
    return multilabel_finish(multilabel_stats(logits, targets, k=k, top_k=top_k))


def multilabel(top_k: int | None = None) -> MetricFns:
    """MetricFns of a multi-label task whose F1 decision rule is threshold 0.5 (None) or the top `top_k` tags."""
    if top_k is None:
        return MetricFns(stats=multilabel_stats, finish=multilabel_finish, rule=THRESHOLD_RULE)
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1; got {top_k}.")
    return MetricFns(
        stats=lambda out, y: multilabel_stats(out, y, top_k=top_k),
        finish=multilabel_finish,
        rule=f"the {top_k} highest-scoring tags of each example are predicted (top-{top_k})",
    )


def token_stats(
    logits: Tensor, targets: Tensor, *, pad_id: int, special_ids: Sequence[int]
) -> dict[str, Tensor]:
    """Correct / counted tokens (special ids excluded) and summed non-pad cross-entropy (no autograd graph)."""
    logits = logits.detach()  # a metric: called on training logits too, where it would keep their graph
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none")
    nll = nll.view_as(targets).to(torch.float64)
    real = targets != pad_id
    counted = real.clone()
    for token in special_ids:
        counted &= targets != token
    correct = (logits.argmax(dim=-1) == targets) & counted
    return {
        "correct": correct.sum().to(torch.float64),
        "counted": counted.sum().to(torch.float64),
        "nll_sum": (nll * real).sum(),
        "num_real": real.sum().to(torch.float64),
    }


def token_finish(stats: dict[str, Tensor]) -> dict[str, float]:
    """accuracy (special tokens excluded) and perplexity (non-pad tokens) from summed stats."""
    mean_nll = _ratio(float(stats["nll_sum"]), float(stats["num_real"]))
    return {
        "accuracy": _ratio(float(stats["correct"]), float(stats["counted"])),
        "perplexity": math.exp(mean_nll),
    }


def token_metrics(
    logits: Tensor, targets: Tensor, *, pad_id: int, special_ids: Sequence[int]
) -> dict[str, float]:
    """All next-token metrics of one batch."""
    return token_finish(token_stats(logits, targets, pad_id=pad_id, special_ids=special_ids))


def add_stats(total: dict[str, Tensor] | None, chunk: dict[str, Tensor]) -> dict[str, Tensor]:
    """Sum two stats dicts key by key (None = nothing yet)."""
    if total is None:
        return {k: v.clone() for k, v in chunk.items()}
    return {k: total[k] + chunk[k] for k in total}


MULTILABEL = multilabel()


def next_token(pad_id: int, special_ids: Sequence[int]) -> MetricFns:
    """MetricFns for a next-token task with the given pad and special token ids."""
    return MetricFns(
        stats=lambda out, y: token_stats(out, y, pad_id=pad_id, special_ids=special_ids), finish=token_finish
    )
