"""Which batch, over two real gloo ranks: a shuffled DistributedSampler moves the inf sample between ranks, and each
skip names, on every rank, exactly the batch that rank trained on; the rank whose batch held it is the origin."""

from __future__ import annotations

import pytest

from ampwatch_support.ddp_harness import run_ranks
from ampwatch_support.samples_worker import BAD

pytestmark = pytest.mark.slow


def test_every_ranks_skip_names_its_own_batch_and_the_inf_sample_only_on_the_origin_rank(tmp_path):
    ranks = run_ranks("ampwatch_support.samples_worker", tmp_path, 2, timeout=240, what="samples")
    for r in ranks:
        assert "error" not in r, r.get("error")
    holders = {}
    for rank, r in enumerate(ranks):
        truth = {i: ids for i, ids in enumerate(r["trained"])}
        for iteration, origin, ids, before in r["skips"]:
            assert ids == truth[iteration]  # this rank's own batch, although DDP made every rank skip
            assert origin is (BAD in ids)  # the rank whose batch held the inf started the skip
            assert before == [i for i in range(iteration - 4, iteration) if i >= 0]
            if BAD in ids:
                holders[iteration] = rank
    skipped = [{s[0] for s in r["skips"]} for r in ranks]
    assert skipped[0] == skipped[1] == set(holders)  # every rank skips together, one of them holds the sample
    assert set(holders.values()) == {0, 1}  # shuffled over the epochs, the sample landed on both ranks
