"""Evaluation of a global model (or a posterior ensemble) on a held-out split, in fixed-size chunks.

The round loop calls `evaluate(task, fns, params, x, y, optimum)` every `eval_every` rounds;
`fedcli evaluate` adds calibration, per-client distributions and posterior predictives.

Metrics by task kind (keys `eval/<name>`):

- every kind: `loss`, the mean per-example loss of the task (`per_example_loss`);
  `dist_to_opt = ||theta - theta*||_2` when the task knows its optimum theta*.
- classification: `accuracy`, the fraction of argmax predictions equal to the label; with
  `calibration=True` also, from p = softmax(output):
  `nll = mean -log p_y`; `brier = mean sum_k (p_k - 1[k = y])^2` (Brier 1950, multi-class,
  in [0, 2]); `ece = sum_b (n_b / N) |acc_b - conf_b|` over `ECE_BINS` = 15 equal-width
  bins ((b-1)/15, b/15] of the confidence max_k p_k (Guo et al., ICML 2017).
- multilabel (precision at 0.5, recall_at_5, micro_f1, macro_f1; F1 of a label with no
  positives and no predictions is 0) and next_token (accuracy without special tokens,
  perplexity): the chunkable `MetricFns` of `fedcli.datasets.metrics`, summed over chunks
  so the numbers are exact corpus-level values (`kind_metrics` picks them).

Evaluation at scale (docs/scaling.md, "Paper scale"): `--eval-sample N` (train.eval_sample) evaluates the rounds on a
fixed sample of N test examples (`eval_sample_index`: drawn once from a fixed seed, sorted; the
same sample every round, across resumes and across runs on the same test split, so runs stay
comparable); None = the task's paper default (`PAPER_EVAL_SAMPLE`: StackOverflow NWP and LR
evaluate on 10,000 sampled test examples, Reddi et al. 2021's setting that FedPA Table 3 follows,
docs/reproductions.md), 0 = the whole split. Every split is read in chunks of `chunk` examples
gathered by index (`x[index]` of memory tensors or a disk store's memory maps); the whole split is
never copied at once, and `evaluate_clients` streams clients through shared chunks.

A posterior predictive (`ensemble_predict`) averages the members' predictive distributions
(softmax probabilities for classification and next-token, sigmoid probabilities per label
for multilabel, outputs for regression) and returns them in output form (log-probabilities,
logits, values) so the same metrics apply to it.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from fedcli.algorithms.base import Params, flatten
from fedcli.datasets.metrics import MULTILABEL, MetricFns, add_stats, next_token
from fedcli.datasets.tasks import Task, per_example_loss
from fedcli.engine.model import ModelFunctions
from fedcli.tracking.metric_defs import is_lower_better

if TYPE_CHECKING:
    from fedcli.engine.setup import Setup

ECE_BINS = 15
PROBE_CHUNK = 64  # examples of an evaluation's first chunk
OUTPUT_BUDGET = (
    1 << 25
)  # output elements per evaluation chunk (128 MiB of float32): chunks shrink below `chunk`
# bytes of every tensor the forward makes for one chunk (its activations, summed, views included): an upper
# bound of what a chunk holds at once: a chunk of 2,048 EMNIST images through the CNN makes all its
# convolution activations at once, and such chunks set a run's memory peak (docs/scaling.md, "Client state").
# Counted at the torch-function level (the aten ops inside a conv or linear are not seen: on the CNN it sees
# 0.79 of the bytes a dispatch mode counts), so the budget is 192 MiB: the CNN's chunks stay ~370 images.
ACTIVATION_BUDGET = 3 << 26
EVAL_SAMPLE_SEED = 32  # the fixed seed of the --eval-sample draw (independent of the run's seed)
# Paper defaults of train.eval_sample (None): FedPA (Al-Shedivat et al. 2021) Table 3 uses Reddi et al.'s
# framework, which evaluates StackOverflow every round on 10,000 randomly sampled test examples (the full
# test split has 16.6M sentences); EMNIST and CIFAR-100 use their full test splits (docs/reproductions.md).
PAPER_EVAL_SAMPLE: dict[str, int] = {"stackoverflow-nwp": 10_000, "stackoverflow-lr": 10_000}
Predict = Callable[[Tensor], Tensor]  # prepared inputs [B, ...] -> outputs [B, ...]


def resolve_eval_sample(requested: int | None, task_name: str) -> int:
    """train.eval_sample as it runs: None -> the task's paper default (PAPER_EVAL_SAMPLE), else 0 (whole split)."""
    return PAPER_EVAL_SAMPLE.get(task_name, 0) if requested is None else requested


@functools.lru_cache(maxsize=8)
def eval_sample_index(num_examples: int, sample: int) -> np.ndarray | None:
    """The fixed evaluation sample: `sample` sorted indices of range(num_examples), drawn without
    replacement from EVAL_SAMPLE_SEED; None (the whole split) when sample is 0 or >= num_examples."""
    if sample <= 0 or sample >= num_examples:
        return None
    index = np.sort(np.random.default_rng(EVAL_SAMPLE_SEED).choice(num_examples, size=sample, replace=False))
    index.flags.writeable = False  # shared by every round (cached)
    return index


@torch.no_grad()
def evaluate(
    task: Task,
    fns: ModelFunctions,
    params: Params,
    x: Tensor,
    y: Tensor,
    optimum: Tensor | None = None,
    chunk: int = 2048,
    *,
    calibration: bool = False,
    index: np.ndarray | None = None,
) -> dict[str, float]:
    """Return the task's `eval/*` metrics of `params` on (x, y); see the module docstring.

    Args:
        task: The task (its kind selects the metrics).
        fns: Model functions of the run (`apply_fn`, `prepare`).
        params: The global model.
        x, y: The split, in stored form (CPU or device).
        optimum: Flattened exact optimum, if known (adds `eval/dist_to_opt`).
        chunk: Examples per forward pass.
        calibration: Add `eval/nll`, `eval/brier`, `eval/ece` for classification tasks.
        index: Evaluate only these examples of (x, y) (the --eval-sample, `eval_sample_index`); None = all.
    """
    metrics = evaluate_predictions(
        task,
        lambda xb: fns.apply_fn(params, xb),
        fns.prepare,
        x,
        y,
        device=next(iter(params.values())).device,
        chunk=chunk,
        calibration=calibration,
        index=index,
    )
    if optimum is not None:
        metrics["eval/dist_to_opt"] = float(
            torch.linalg.vector_norm(flatten(params) - optimum.to(flatten(params).device))
        )
    return metrics


@torch.no_grad()
def evaluate_predictions(
    task: Task,
    predict: Predict,
    prepare: Callable[[Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    *,
    device: torch.device,
    chunk: int = 2048,
    calibration: bool = False,
    index: np.ndarray | None = None,
) -> dict[str, float]:
    """Metrics of any predictor (a model, or a posterior ensemble) on (x, y) or its examples `index`,
    chunk by chunk (each chunk gathered by itself: the split is never copied whole)."""
    acc = _Accumulator(task, calibration)
    size = min(chunk, PROBE_CHUNK)  # the first chunk is small: it measures the outputs' size per example
    done = 0
    total = len(y) if index is None else len(index)
    while done < total:
        if index is None:
            xs, ys = x[done : done + size], y[done : done + size]
        else:
            ix = torch.from_numpy(np.array(index[done : done + size], dtype=np.int64))
            xs, ys = x[ix.to(x.device)], y[ix.to(y.device)]
        xb = prepare(xs.to(device))
        if done == 0:
            with _MadeBytes() as made:
                out = predict(xb)
            per_example = made.bytes // max(1, len(ys))
        else:
            out = predict(xb)
        acc.update(out, xb, ys.to(device))
        done += len(ys)
        # bound each chunk's outputs (next-token logits are [B, T, V]: 2,048 x 20 x 10,004 floats were 1.6 GB)
        # and everything its forward makes (ACTIVATION_BUDGET), both measured on the first chunk
        size = max(
            1, min(chunk, OUTPUT_BUDGET // max(1, out[:1].numel()), ACTIVATION_BUDGET // max(1, per_example))
        )
    return acc.result()


class _MadeBytes(TorchFunctionMode):
    """Counts the bytes of every tensor the torch functions run inside it return (a forward's activations,
    summed, views included). A torch-function mode, not a dispatch mode: entering a TorchDispatchMode
    imports ~900 more modules of torch (+150 MiB resident, measured on the demo run), this one nothing."""

    bytes = 0  # counted by each instance (`+=` makes it the instance's own)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, Tensor):
                self.bytes += leaf.numel() * leaf.element_size()
        return out


class _Accumulator:
    """Sufficient statistics of the metrics, summed over chunks."""

    def __init__(self, task: Task, calibration: bool) -> None:
        self.task, self.count, self.loss_sum, self.correct = task, 0, 0.0, 0
        self.calibration = calibration and task.kind == "classification"
        self.nll_sum, self.brier_sum = 0.0, 0.0
        self.bin_count, self.bin_conf, self.bin_correct = (np.zeros(ECE_BINS) for _ in range(3))
        self.kind_fns = kind_metrics(task)
        self.kind_stats: dict[str, Tensor] | None = None  # summed chunk stats of the kind's metrics

    def update(self, output: Tensor, xb: Tensor, yb: Tensor) -> None:
        self.loss_sum += float(per_example_loss(self.task, output, xb, yb).sum())
        self.count += len(yb)
        if self.task.kind == "classification":
            self.correct += int((output.argmax(dim=-1) == yb).sum())
        elif self.kind_fns is not None:
            self.kind_stats = add_stats(self.kind_stats, self.kind_fns.stats(output, yb))
        if not self.calibration:  # the sums below: nll, brier and the ECE bins
            return
        log_probs = torch.log_softmax(output.to(torch.float64), dim=-1)  # [B, K]
        probs = log_probs.exp()
        self.nll_sum += float(-log_probs.gather(-1, yb[:, None]).sum())
        onehot = torch.nn.functional.one_hot(yb, probs.shape[-1]).to(probs.dtype)
        self.brier_sum += float(((probs - onehot) ** 2).sum())
        conf, pred = probs.max(dim=-1)
        bins = (torch.ceil(conf * ECE_BINS).long() - 1).clamp(0, ECE_BINS - 1).cpu().numpy()
        self.bin_count += np.bincount(bins, minlength=ECE_BINS)
        self.bin_conf += np.bincount(bins, weights=conf.cpu().numpy(), minlength=ECE_BINS)
        self.bin_correct += np.bincount(
            bins, weights=(pred == yb).cpu().numpy().astype(np.float64), minlength=ECE_BINS
        )

    def result(self) -> dict[str, float]:
        n = max(self.count, 1)
        out = {"eval/loss": self.loss_sum / n}
        if self.task.kind == "classification":
            out["eval/accuracy"] = self.correct / n
        elif self.kind_fns is not None and self.kind_stats is not None:
            out.update({f"eval/{k}": float(v) for k, v in self.kind_fns.finish(self.kind_stats).items()})
        if self.calibration:
            out["eval/nll"] = self.nll_sum / n
            out["eval/brier"] = self.brier_sum / n
            out["eval/ece"] = expected_calibration_error(self.bin_count, self.bin_conf, self.bin_correct)
        return out


def expected_calibration_error(bin_count: np.ndarray, bin_conf: np.ndarray, bin_correct: np.ndarray) -> float:
    """ECE = sum_b (n_b / N) |acc_b - conf_b| from per-bin counts, summed confidences and hits."""
    total = bin_count.sum()
    if total == 0:
        return 0.0
    return float(np.abs(bin_correct - bin_conf).sum() / total)  # n_b |acc_b - conf_b| = |hits_b - sum conf_b|


def kind_metrics(task: Task) -> MetricFns | None:
    """The chunkable metrics of a multilabel / next-token task; None for other kinds.

    A task may carry its own (`Task.metrics`, e.g. a next-token task with its special token
    ids); otherwise multilabel tasks get `MULTILABEL` and next-token tasks
    `next_token(pad_id=0, special_ids=())`, which counts OOV/BOS/EOS as ordinary tokens.
    """
    own = getattr(task, "metrics", None)
    if own is not None:
        return own
    if task.kind == "multilabel":
        return MULTILABEL
    if task.kind == "next_token":
        warnings.warn(
            f"task {task.name} declares no special token ids; next-token accuracy counts every "
            "non-pad (id 0) token",
            stacklevel=2,
        )
        return next_token(pad_id=0, special_ids=())
    return None


# --------------------------------------------------------------------------- posterior predictive


def sample_posterior(mean: Params, var: Params, num_samples: int, generator: torch.Generator) -> list[Params]:
    """Draw `num_samples` parameter sets theta_k = mean + sqrt(var) * eps_k, eps_k ~ N(0, I).

    The noise comes from `generator` (CPU, seeded by the caller), leaf by leaf in sorted key
    order, so the draws do not depend on the device or on the dict's insertion order.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1; got {num_samples}.")
    members: list[Params] = []
    for _ in range(num_samples):
        member = {}
        for key in sorted(mean):
            eps = torch.randn(mean[key].shape, generator=generator, dtype=torch.float64)
            std = var[key].clamp_min(0).to(torch.float64).sqrt().cpu()
            member[key] = (
                (mean[key].cpu().to(torch.float64) + std * eps).to(mean[key].dtype).to(mean[key].device)
            )
        members.append({k: member[k] for k in mean})
    return members


def ensemble_predict(
    task: Task, apply_fn: Callable[[Params, Tensor], Tensor], members: Sequence[Params]
) -> Predict:
    """The posterior predictive of `members` in output form (see the module docstring)."""
    log_k = math.log(len(members))

    def predict(xb: Tensor) -> Tensor:
        outputs = torch.stack([apply_fn(p, xb) for p in members])  # [K, B, ...]
        if task.kind in ("classification", "next_token"):
            return torch.logsumexp(torch.log_softmax(outputs, dim=-1), dim=0) - log_k
        if task.kind == "multilabel":
            return torch.logit(torch.sigmoid(outputs).mean(dim=0), eps=1e-7)
        return outputs.mean(dim=0)

    return predict


# --------------------------------------------------------------------------- per-client view


@torch.no_grad()
def evaluate_clients(
    task: Task,
    predict: Predict,
    prepare: Callable[[Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    client_indices: Sequence[np.ndarray],
    *,
    device: torch.device,
    chunk: int = 2048,
) -> list[dict[str, float]]:
    """Metrics of `predict` on each client's examples (clients without examples are skipped).

    Streams: consecutive clients share chunks of at most `chunk` examples (a larger client spans
    several), one forward pass per chunk, each client's slice of the outputs summed into its own
    statistics; only one chunk of examples is ever gathered.
    """
    accs = [_Accumulator(task, False) for idx in client_indices if len(idx)]
    segments: list[tuple[int, np.ndarray]] = []  # (client's accumulator, its indices in this chunk)
    size = 0

    def flush() -> None:
        ix = torch.as_tensor(np.concatenate([s for _, s in segments]), dtype=torch.int64)
        xb = prepare(x[ix.to(x.device)].to(device))
        yb = y[ix.to(y.device)].to(device)
        out, start = predict(xb), 0
        for k, seg in segments:
            end = start + len(seg)
            accs[k].update(out[start:end], xb[start:end], yb[start:end])
            start = end
        segments.clear()

    for k, idx in enumerate(i for i in client_indices if len(i)):
        for a in range(0, len(idx), chunk):
            seg = np.asarray(idx[a : a + chunk])
            if size + len(seg) > chunk and segments:
                flush()
                size = 0
            segments.append((k, seg))
            size += len(seg)
    if segments:
        flush()
    return [acc.result() for acc in accs]


def summarize_clients(
    per_client: Sequence[dict[str, float]], lower_is_better: Callable[[str], bool]
) -> dict[str, float]:
    """Distribution over clients of each metric: unweighted mean, std (ddof 0), worst 10%.

    `<name>_worst10` is the mean over the worst ceil(10% of clients) clients (lowest accuracy,
    highest loss), the fairness statistic of q-FFL/Ditto-style tables; `clients` counts them.
    """
    if not per_client:
        return {}
    out: dict[str, float] = {}
    for key in sorted(per_client[0]):
        values = np.sort(np.array([m[key] for m in per_client], dtype=np.float64))
        if lower_is_better(key):
            values = values[::-1]
        worst = values[: max(1, math.ceil(0.1 * len(values)))]
        name = key.split("/", 1)[-1]
        out.update(
            {
                f"client/{name}_mean": float(values.mean()),
                f"client/{name}_std": float(values.std()),
                f"client/{name}_worst10": float(worst.mean()),
            }
        )
    out["client/clients"] = float(len(per_client))
    return out


# --------------------------------------------------------------------------- one run's split


@dataclass(frozen=True)
class SplitEvaluation:
    """What `fedcli evaluate` reports for one split."""

    metrics: dict[str, float]  # eval/* over the whole split
    clients: dict[str, float]  # client/* distribution over clients (empty without per_client)
    client_split: str | None  # the split the per-client view used (None without per_client)


@torch.no_grad()
def evaluate_split(
    setup: Setup,
    predict: Predict,
    *,
    split: str,
    per_client: bool = False,
    params: Params | None = None,
    chunk: int = 2048,
    sample: int = 0,
) -> SplitEvaluation:
    """Evaluate `predict` on a run's `test` split or its clients' `train` examples.

    With `per_client`, clients are the run's partition clients: on `test` each client's own
    test examples when the task has them (`TaskData.test_client_indices`, natural partition),
    otherwise each client's training examples (`client_split` then says `train`).
    `params` (the point estimate) adds `eval/dist_to_opt` when the task knows its optimum.
    `sample` > 0 evaluates the split-wide metrics on the fixed sample of that many examples
    (`eval_sample_index`); the per-client view always uses every client's examples. Both stream:
    each chunk is gathered by index from the tensors (a disk store: its memory maps), never the split.
    """
    data, fed, prepare = setup.data, setup.fed, setup.fns.prepare
    if split == "test":
        x, y = data.test_x, data.test_y
        index = eval_sample_index(len(y), sample)
    else:
        x, y = fed.x, fed.y
        own = np.concatenate(list(fed.client_indices)) if fed.num_clients else np.zeros(0, dtype=np.int64)
        sampled = eval_sample_index(len(own), sample)
        index = own if sampled is None else own[sampled]
    metrics = evaluate_predictions(
        setup.task, predict, prepare, x, y, device=setup.device, chunk=chunk, calibration=True, index=index
    )
    if params is not None and data.optimum is not None:
        metrics["eval/dist_to_opt"] = float(
            torch.linalg.vector_norm(flatten(params).cpu() - data.optimum.cpu())
        )
    if not per_client:
        return SplitEvaluation(metrics, {}, None)
    test_indices = getattr(data, "test_client_indices", None)
    natural = setup.cfg.partition.scheme == "natural" and setup.cfg.partition.file is None
    if split == "test" and test_indices is not None and natural:
        client_split, cx, cy, indices = "test", data.test_x, data.test_y, test_indices[: fed.num_clients]
    else:
        client_split, cx, cy, indices = "train", fed.x, fed.y, fed.client_indices
    per = evaluate_clients(setup.task, predict, prepare, cx, cy, indices, device=setup.device, chunk=chunk)
    return SplitEvaluation(metrics, summarize_clients(per, is_lower_better), client_split)
