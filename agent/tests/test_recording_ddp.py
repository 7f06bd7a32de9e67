"""Real DDP over gloo with two processes: who skips, on which rank (and ShardedGradScaler is accepted)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from ports import free_port

WORKER = Path(__file__).with_name("ddp_worker.py")
INJECT_AT = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Run the two-rank worker once (bounded in time, whole process group killed on timeout)."""
    out = tmp_path_factory.mktemp("ddp")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPWATCH_")}
    proc = subprocess.Popen([sys.executable, str(WORKER), str(out), str(free_port())], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the two-rank DDP worker did not finish within 120 s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output.decode(errors="replace")[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


pytestmark = pytest.mark.slow


def test_inf_on_one_ddp_rank_makes_every_rank_skip(ranks):
    expected = [i != INJECT_AT for i in range(4)]
    for rank in ranks:
        ddp = rank["ddp"]
        assert ddp["truth"] == expected and ddp["reported"] == expected
        assert ddp["state"]["optimizers"]["net"]["skipped"] == 1
        assert ddp["state"]["backoffs"] == 1 and ddp["state"]["loss_scale"] == ddp["scale"] == 32768.0


def test_inf_on_one_rank_with_independent_models_skips_only_that_rank(ranks):
    rank0, rank1 = (r["independent"] for r in ranks)
    assert rank0["truth"] == rank0["reported"] == [True] * 4
    assert rank1["truth"] == rank1["reported"] == [i != INJECT_AT for i in range(4)]
    assert (rank0["state"]["backoffs"], rank1["state"]["backoffs"]) == (0, 1)


def test_sharded_grad_scaler_is_accepted_and_its_all_reduced_skips_are_reported(ranks):
    expected = [i != INJECT_AT for i in range(4)]
    for rank in ranks:
        sharded = rank["sharded"]
        assert sharded["scaler"]["kind"] == "ShardedGradScaler"
        # ShardedGradScaler all-reduces found_inf, so the rank without the inf skips too.
        assert sharded["truth"] == sharded["reported"] == expected
        assert sharded["state"]["backoffs"] == 1 and sharded["state"]["loss_scale"] == sharded["scale"]
