"""FOLA precision compression (Sec. 3.5) and its byte accounting.

Liu, Zheng. A Bayesian Federated Learning Framework with Multivariate Gaussian Product.
arXiv:2102.01936 (2021), Sec. 3.5; code: `pruning_clients` of cnn_ours.py.

Implements: "set a percentage scale p ... for the diagonal of the co-variance of each layer,
we sort the elements and set the last 1 - p of the values to be the mean ... coded in
Compressed Sparse Row format" -> compress_precision (client, before upload) and
decompress_precision (server, before Eq. 9).
Notation: p -> hp.compress_p (the kept fraction), n -> entries of one layer.
Deviations:
  Paper: "the mean" (unspecified). Here: the mean of the dropped entries (the code), which
  keeps each layer's total precision.
  Code: keeps the entries >= the one at sorted index int(p n), i.e. int(p n) + 1 without ties.
  Here: exactly round(p n) entries (at least 1) by torch.topk, a static count under vmap.
  Paper: CSR. Here: kept values + int32 flat indices + one fill value per layer (a one-row
  CSR without the row pointer); the upload holds exactly these tensors, so the engine's
  dense byte count of the upload is the compressed size: per layer k * (value bytes + 4)
  + value bytes. The code's server-side compression is a no-op bug and is not reproduced;
  the broadcast (mu_S, P_S) stays dense.
"""

from __future__ import annotations

import torch

from fedcli.algorithms.base import Params


def kept_count(numel: int, p: float) -> int:
    """Entries of an n-entry layer kept by compression: round(p * n), at least 1."""
    return max(1, min(numel, int(p * numel + 0.5)))


def compress_precision(precision: Params, p: float) -> dict[str, Params]:
    """Per layer keep the top round(p n) entries; the rest become the mean of the dropped ones."""
    out: dict[str, Params] = {"values": {}, "indices": {}, "fill": {}}
    for name, v in precision.items():
        flat = v.reshape(-1)
        k = kept_count(flat.numel(), p)
        top, index = torch.topk(flat, k)
        out["values"][name] = top  # [k]
        out["indices"][name] = index.to(torch.int32)  # [k]
        out["fill"][name] = (flat.sum() - top.sum()) / max(flat.numel() - k, 1)  # []
    return out


def decompress_precision(compressed: dict[str, Params], like: Params) -> Params:
    """Rebuild dense cohort precisions [C, ...] from stacked compress_precision outputs."""
    out: Params = {}
    for name, ref in like.items():
        values, index = compressed["values"][name], compressed["indices"][name].long()  # [C, k]
        dense = compressed["fill"][name][:, None].expand(ref.shape[0], ref[0].numel())  # [C, n]
        out[name] = dense.scatter(1, index, values).reshape(ref.shape)
    return out


def upload_precision(precision: Params, p: float) -> dict[str, object]:
    """The precision part of a client upload: dense when p = 1, else compressed."""
    if p >= 1.0:
        return {"precision": precision}
    return {"precision_compressed": compress_precision(precision, p)}


def cohort_precision(upload: dict[str, object]) -> Params:
    """The dense stacked precisions [C, ...] of a stacked cohort upload."""
    if "precision" in upload:
        return upload["precision"]  # type: ignore[return-value]
    return decompress_precision(upload["precision_compressed"], upload["mean"])  # type: ignore[arg-type]
