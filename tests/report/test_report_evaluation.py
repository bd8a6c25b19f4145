"""Evaluation metrics (fedcli/engine/evaluation.py) on crafted predictions.

The "model" is a scaling of its input, out = x * params["scale"], so each test writes the
logits it wants as x and knows every probability exactly.
"""

from __future__ import annotations

import math
from types import MappingProxyType

import numpy as np
import pytest
import torch
from sklearn.metrics import f1_score

from fedcli.datasets.tasks import Task
from fedcli.engine.evaluation import (
    ECE_BINS,
    ensemble_predict,
    evaluate,
    evaluate_predictions,
    sample_posterior,
    summarize_clients,
)
from fedcli.engine.model import ModelFunctions
from fedcli.tracking.metric_defs import is_lower_better


def _task(kind: str) -> Task:
    return Task(
        name=f"crafted-{kind}",
        description="",
        source="",
        offline=True,
        kind=kind,
        models=MappingProxyType({}),
        default_model="",
        load=lambda options: None,
    )


def _scale_fns() -> ModelFunctions:
    def apply_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return x * params["scale"]

    return ModelFunctions(apply_fn=apply_fn, loss_fn=None, data=None, prepare=lambda x: x)  # type: ignore[arg-type]


ONE = {"scale": torch.ones((), dtype=torch.float64)}


def test_calibration_metrics_on_crafted_predictions() -> None:
    """Two classes, logits (log p, log(1-p)) give softmax (p, 1-p) exactly.
    Four examples at confidence 0.9 (bin ceil(0.9*15) = 14), three right and one wrong;
    two at confidence 0.7 (bin 11), both right. Away from bin edges, so
        ECE = 4/6 |3/4 - 0.9| + 2/6 |1 - 0.7| = 0.1 + 0.1 = 0.2,
        Brier = mean_n sum_k (p_k - 1[k=y])^2 = [3(2*0.1^2) + 2*0.9^2 + 2(2*0.3^2)] / 6,
        NLL = [-3 log 0.9 - log 0.1 - 2 log 0.7] / 6,  accuracy 5/6.
    chunk=4 splits the examples over two chunks, which must not change anything."""
    conf = torch.tensor([0.9, 0.9, 0.9, 0.9, 0.7, 0.7], dtype=torch.float64)
    x = torch.stack([conf.log(), (1 - conf).log()], dim=1)  # predicts class 0 everywhere
    y = torch.tensor([0, 0, 0, 1, 0, 0])
    assert ECE_BINS == 15

    metrics = evaluate(_task("classification"), _scale_fns(), ONE, x, y, chunk=4, calibration=True)

    brier = (3 * (2 * 0.1**2) + 2 * 0.9**2 + 2 * (2 * 0.3**2)) / 6
    nll = (-3 * math.log(0.9) - math.log(0.1) - 2 * math.log(0.7)) / 6
    assert metrics["eval/ece"] == pytest.approx(4 / 6 * abs(3 / 4 - 0.9) + 2 / 6 * abs(1 - 0.7), abs=1e-12)
    assert metrics["eval/brier"] == pytest.approx(brier, abs=1e-12)
    assert metrics["eval/nll"] == pytest.approx(nll, abs=1e-12)
    assert metrics["eval/loss"] == pytest.approx(nll, abs=1e-12)  # cross-entropy is the NLL
    assert metrics["eval/accuracy"] == pytest.approx(5 / 6, abs=1e-15)


def test_perfectly_calibrated_bins_have_zero_ece() -> None:
    """Confidence 0.75 (bin 12) right in 3 of 4 examples: |acc - conf| = 0 in the only bin."""
    conf = torch.full((4,), 0.75, dtype=torch.float64)
    x = torch.stack([conf.log(), (1 - conf).log()], dim=1)

    metrics = evaluate(
        _task("classification"), _scale_fns(), ONE, x, torch.tensor([0, 0, 0, 1]), calibration=True
    )

    assert metrics["eval/ece"] == pytest.approx(0.0, abs=1e-12)


def test_round_loop_metrics_are_unchanged_without_calibration() -> None:
    """The round loop's call (no keyword) returns loss and accuracy only."""
    x = torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=torch.float64)

    metrics = evaluate(_task("classification"), _scale_fns(), ONE, x, torch.tensor([0, 0]))

    assert sorted(metrics) == ["eval/accuracy", "eval/loss"]


def test_multilabel_f1_matches_scikit_learn_on_random_data() -> None:
    """micro/macro-F1 of 'logit > 0' equal sklearn's f1_score(average=..., zero_division=0),
    whose macro mean counts a label with no positives and no predictions as 0 (labels 0
    and 1 are forced empty here). Precision is micro precision; recall@5 = hits in the top 5
    logits / true labels, both recomputed directly. Chunks of 7 examples are summed."""
    rng = np.random.default_rng(3)
    logits = rng.normal(-0.5, 1.0, size=(40, 12))
    truth = (rng.random((40, 12)) < 0.3).astype(np.float64)
    logits[:, :2], truth[:, :2] = -5.0, 0.0
    predicted = logits > 0

    metrics = evaluate(
        _task("multilabel"), _scale_fns(), ONE, torch.from_numpy(logits), torch.from_numpy(truth), chunk=7
    )

    top5 = np.argsort(-logits, axis=1)[:, :5]
    hits = np.take_along_axis(truth, top5, axis=1).sum()
    assert metrics["eval/micro_f1"] == pytest.approx(
        f1_score(truth, predicted, average="micro", zero_division=0), abs=1e-12
    )
    assert metrics["eval/macro_f1"] == pytest.approx(
        f1_score(truth, predicted, average="macro", zero_division=0), abs=1e-12
    )
    assert metrics["eval/precision"] == pytest.approx(
        (predicted & (truth > 0)).sum() / predicted.sum(), abs=1e-12
    )
    assert metrics["eval/recall_at_5"] == pytest.approx(hits / truth.sum(), abs=1e-12)


def test_posterior_samples_are_mean_plus_std_times_seeded_noise() -> None:
    """theta_k = mean + sqrt(var) * eps_k with eps drawn leaf by leaf in sorted key order from
    the given generator; the same seed redraws the same members."""
    mean = {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.5])}
    var = {"w": torch.tensor([4.0, 0.25]), "b": torch.tensor([0.0])}

    members = sample_posterior(mean, var, 3, torch.Generator().manual_seed(7))

    gen = torch.Generator().manual_seed(7)
    for member in members:
        eps_b = torch.randn((1,), generator=gen, dtype=torch.float64)
        eps_w = torch.randn((2,), generator=gen, dtype=torch.float64)
        torch.testing.assert_close(member["b"], (0.5 + 0.0 * eps_b).float(), rtol=0, atol=1e-7)
        torch.testing.assert_close(
            member["w"], (mean["w"].double() + var["w"].double().sqrt() * eps_w).float(), rtol=0, atol=1e-6
        )
    assert list(members[0]) == ["w", "b"]


def test_ensemble_predictive_averages_probabilities() -> None:
    """Two members scale the logits by 1 and 3: the predictive is (softmax(z) + softmax(3z)) / 2,
    and its NLL (the eval loss) is -log of that average at the label."""
    z = torch.tensor([[1.0, 0.0, -1.0], [0.2, 0.4, 0.0]], dtype=torch.float64)
    y = torch.tensor([0, 1])
    members = [
        {"scale": torch.tensor(1.0, dtype=torch.float64)},
        {"scale": torch.tensor(3.0, dtype=torch.float64)},
    ]
    task = _task("classification")

    predict = ensemble_predict(task, _scale_fns().apply_fn, members)
    metrics = evaluate_predictions(task, predict, lambda x: x, z, y, device=torch.device("cpu"))

    expected = (torch.softmax(z, -1) + torch.softmax(3 * z, -1)) / 2
    torch.testing.assert_close(torch.softmax(predict(z), -1), expected, rtol=0, atol=1e-12)
    assert metrics["eval/loss"] == pytest.approx(float(-expected[[0, 1], y].log().mean()), abs=1e-12)


def test_summarize_clients_mean_std_and_worst_tenth() -> None:
    """Ten clients with accuracy 0.1..1.0 and loss 1..10: worst 10% = the single worst client
    (accuracy 0.1, loss 10); mean 0.55 / 5.5; std is the population std over clients."""
    per_client = [{"eval/accuracy": k / 10, "eval/loss": float(k)} for k in range(1, 11)]

    summary = summarize_clients(per_client, is_lower_better)

    acc = np.arange(1, 11) / 10
    assert summary["client/accuracy_mean"] == pytest.approx(acc.mean(), abs=1e-12)
    assert summary["client/accuracy_std"] == pytest.approx(acc.std(), abs=1e-12)
    assert summary["client/accuracy_worst10"] == pytest.approx(0.1, abs=1e-12)
    assert summary["client/loss_worst10"] == pytest.approx(10.0, abs=1e-12)
    assert summary["client/clients"] == 10
    eleven = summarize_clients([*per_client, {"eval/accuracy": 0.0, "eval/loss": 11.0}], is_lower_better)
    assert eleven["client/accuracy_worst10"] == pytest.approx(
        (0.0 + 0.1) / 2, abs=1e-12
    )  # ceil(1.1) = 2 clients
