"""examples/ddp_train.py end to end: 2 real DDP ranks over gloo deliver to a real HTTP server."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from ampwatch_support.batches import CLEAN_DELIVERY
from ampwatch_support.recording_collector import RecordingCollector

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "ddp_train.py"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_ddp_example_delivers_every_ranks_skips_backoffs_and_close_under_one_agreed_run():
    with RecordingCollector() as server:
        done = subprocess.run([sys.executable, str(EXAMPLE), "--collector", server.url, "--iterations", "30",
                               "--inject-rank", "1", "--inject-at", "10", "--inject-for", "3",
                               "--push-interval", "0.2"],
                              capture_output=True, text=True, timeout=150)
        assert done.returncode == 0, done.stderr[-3000:]
        batches = server.acked

    assert {(b["rank"], b["world_size"]) for b in batches} == {(0, 2), (1, 2)}
    assert len({b["run"] for b in batches}) == 1, "the ranks did not agree on one run id"
    assert sum(b["closed"] for b in batches) == 2
    for rank in (0, 1):
        mine = [b for b in batches if b["rank"] == rank]
        events = [e for b in mine for e in b["events"]]
        skips = {(e["optimizer"], e["iteration"]) for e in events if e["kind"] == "skip"}
        # DDP all-reduces rank 1's inf into rank 0's gradients too: both ranks skip both optimizers, a
        # streak of 3 sent as its rungs (1st, 2nd skip) and its end.
        assert skips == {(opt, it) for opt in ("body", "head") for it in (10, 11)}
        ends = {(e["optimizer"], e["start_iteration"], e["length"]) for e in events if e["kind"] == "streak_end"}
        assert ends == {(opt, 10, 3) for opt in ("body", "head")}
        backoffs = [e for e in events if e["kind"] == "scale_change" and e["cause"] == "backoff"]
        assert sum(e.get("count", 1) for e in backoffs) == 3
        final = mine[-1]["state"]
        assert final["backoffs"] == 3
        assert final["iteration"] == 30 and final["optimizers"]["body"]["skipped"] == 3
        assert final["delivery"] == CLEAN_DELIVERY  # every counter the contract declares, at 0
    assert done.stdout.index("rank 0") < done.stdout.index("rank 1"), done.stdout
    assert "3 skipped" in done.stdout
