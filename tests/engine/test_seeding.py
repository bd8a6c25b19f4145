"""derive_seeds (the batched seed derivation of a round's cohort) equals numpy's SeedSequence,
through derive_seed, bit for bit: every run's batch orders and dropout keys depend on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcli.engine.seeding import Stream, derive_seed, derive_seeds, numpy_rng, numpy_rngs, step_keys


@pytest.mark.parametrize(
    "seed", [0, 1, 7, 2**31, 2**32 - 1, 2**32, 2**40 + 3, 2**62, 2**63 - 1, 2**64 + 5, 2**130 + 1]
)
@pytest.mark.parametrize("keys", [(), (1,), (5,), (2**32 + 1,), (3, 9)])
def test_derive_seeds_equals_seedsequence_for_every_stream(seed: int, keys: tuple[int, ...]) -> None:
    last = np.random.default_rng(seed % 2**32).integers(0, 2**32, size=25)
    last[:3] = [0, 1, 2**32 - 1]
    for stream in Stream:
        assert derive_seeds(seed, stream, *keys, last=last).tolist() == [
            derive_seed(seed, stream, *keys, int(c)) for c in last
        ]


def test_derive_seeds_falls_back_to_seedsequence_outside_its_words() -> None:
    """A last key above 2**32 - 1 takes the exact per-client path; a negative one is refused as by
    SeedSequence itself; an empty cohort gives an empty array."""
    big = np.array([2**32, 2**40 + 7], dtype=np.int64)
    assert derive_seeds(3, Stream.NOISE, 4, last=big).tolist() == [
        derive_seed(3, Stream.NOISE, 4, int(c)) for c in big
    ]
    with pytest.raises(ValueError):
        derive_seeds(3, Stream.NOISE, 4, last=np.array([-1]))
    assert derive_seeds(3, Stream.NOISE, 4, last=np.array([], dtype=np.int64)).size == 0


def test_round_helpers_match_their_per_client_definitions() -> None:
    """step_keys = derive_seed(seed, NOISE, round, c) + step; numpy_rngs draw what numpy_rng's draw."""
    cohort = np.array([4, 17, 99, 1000])
    keys = step_keys(11, 6, cohort, 5)
    want = torch.tensor([[derive_seed(11, Stream.NOISE, 6, int(c)) + s for s in range(5)] for c in cohort])
    assert torch.equal(keys, want)
    for got, c in zip(numpy_rngs(11, Stream.BATCH_ORDER, 6, cohort), cohort, strict=True):
        assert (
            got.permutation(50).tolist()
            == numpy_rng(11, Stream.BATCH_ORDER, 6, int(c)).permutation(50).tolist()
        )
