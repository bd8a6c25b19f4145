"""The cohort's uploads reduced a group at a time (Algorithm.upload_sums, issue 32): a streamed round
of BayesADMM never holds the [C, ...] uploads; stream_cohort passes server_update an UploadSums whose
sums equal the whole cohort's within float32 rounding, leaves non-finite clients out as aggregate
does, and counts every client's upload bytes.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils import _pytree as pytree

from fedcli.algorithms.base import UploadSums, tree_nbytes
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.cohort import CohortInputs, CohortJob
from fedcli.engine.rounds import Timing, aggregate, draw_noise, plan_round, train_cohort
from tests.engine.test_stream_cohort import make


def whole_uploads(setup, state, store) -> tuple[np.ndarray, dict]:
    """Round 1's uploads of the whole cohort at once (the back end's own path, before streaming)."""
    params = setup.alg.global_params(state)
    planned = plan_round(setup, 1)
    steps = planned.plan.num_epochs * planned.plan.steps_per_epoch
    inputs = CohortInputs(
        plan=planned.plan,
        keys=planned.keys,
        noise=draw_noise(setup, params, planned.cohort, 1, steps),
        states=store.gather(planned.cohort, setup.device),
    )
    job = CohortJob(
        setup.alg, setup.fns, setup.alg.broadcast(state, setup.hp), inputs, setup.hp, setup.opt, 1
    )
    return planned.cohort, setup.backend.run(job).upload


def assert_close_sums(got: object, want: object) -> None:
    a, b = pytree.tree_leaves(got), pytree.tree_leaves(want)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_a_streamed_bayesadmm_round_sums_its_uploads_a_group_at_a_time() -> None:
    """loop, groups of 2 of a cohort of 5: the round's upload is an UploadSums (no [C, ...] tensor), equal
    to upload_sums of the whole cohort's stacked uploads; comm bytes count all 5 clients."""
    setup, init = make("bayesadmm", "loop", {"train.cohort_chunk": 2})
    store = ClientStateStore(init)
    state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    cohort, upload = whole_uploads(setup, state, store)
    trained = train_cohort(setup, state, store, 1)
    assert np.array_equal(trained.cohort, cohort)
    got = trained.outs.upload
    assert isinstance(got, UploadSums) and got.count == 5 and bool(got.finite.all())
    assert got.nbytes == float(tree_nbytes(upload))
    assert_close_sums(
        got.sums, setup.alg.upload_sums(upload, trained.plan.num_examples, trained.broadcast, setup.hp)
    )
    _, metrics = aggregate(setup, state, store, trained, 1, Timing())
    assert metrics["comm/bytes_up"] == float(tree_nbytes(upload))
    assert metrics["client/dropped_nonfinite"] == 0.0
    store.close(remove=True)


def test_a_non_finite_client_is_left_out_of_the_group_sums() -> None:
    """A NaN in one client's upload inside a group: that client is left out of the sums (the others'
    equal upload_sums over the 4 finite clients), aggregate counts it dropped and does not store its state."""
    setup, init = make("bayesadmm", "loop", {"train.cohort_chunk": 2})
    store = ClientStateStore(init)
    state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    cohort, upload = whole_uploads(setup, state, store)
    inner, calls = setup.backend.run, []

    # the real back end, then a NaN in the first group's first client
    def poison_first_client(job: CohortJob):  # noqa: ANN202
        out = inner(job)
        if not calls:
            out.upload["mean"] = {
                k: v.clone().index_fill_(0, torch.tensor([0]), math.nan)
                for k, v in out.upload["mean"].items()
            }
        calls.append(len(job.inputs.plan.num_examples))
        return out

    setup.backend.run = poison_first_client
    trained = train_cohort(setup, state, store, 1)
    assert calls == [2, 2, 1]
    got = trained.outs.upload
    assert isinstance(got, UploadSums) and got.count == 4 and int((~got.finite).sum()) == 1
    bad = int(np.flatnonzero(~got.finite)[0])
    keep = torch.tensor([i for i in range(5) if i != bad])
    kept = pytree.tree_map(lambda t: t.index_select(0, keep), upload)
    assert_close_sums(
        got.sums, setup.alg.upload_sums(kept, trained.plan.num_examples[keep], trained.broadcast, setup.hp)
    )
    new_state, metrics = aggregate(setup, state, store, trained, 1, Timing())
    assert metrics["client/dropped_nonfinite"] == 1.0
    assert all(torch.isfinite(p).all() for p in setup.alg.global_params(new_state).values())
    stored = store.state_dict()
    assert int(cohort[bad]) not in stored and len(stored) == 4
    store.close(remove=True)
