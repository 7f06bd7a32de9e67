"""Rank identity and the run id every rank shares: env, launchers, and agreement over real DDP (gloo)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from ampwatch.agent._identity import launcher_run_id, resolve_identity
from ampwatch_support.ports import free_port


def test_rank_world_size_and_local_rank_come_from_the_environment():
    identity = resolve_identity("r", environ={"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    assert (identity.run, identity.rank, identity.world_size, identity.local_rank) == ("r", 3, 8, 1)
    assert identity.host == socket.gethostname() and identity.pid == os.getpid()


def test_a_single_process_is_rank_zero_of_one():
    identity = resolve_identity(environ={})
    assert (identity.rank, identity.world_size, identity.local_rank) == (0, 1, 0)
    assert identity.run.startswith("run-")


@pytest.mark.parametrize(("env", "expected"), [
    ({"AMPWATCH_RUN": "mine", "TORCHELASTIC_RUN_ID": "elastic", "SLURM_JOB_ID": "77"}, "mine"),
    ({"TORCHELASTIC_RUN_ID": "elastic", "SLURM_JOB_ID": "77"}, "elastic"),
    ({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "77"}, "77"),  # torchrun's "none" is not an id
    ({"PBS_JOBID": "12.pbs"}, "12.pbs"),
    ({"LSB_JOBID": "9"}, "9"),
])
def test_the_run_id_is_ampwatch_run_else_the_launchers_job_id(env, expected):
    assert resolve_identity(environ=env).run == expected


def test_torchrun_without_rdzv_id_has_no_launcher_run_id():
    assert launcher_run_id({"TORCHELASTIC_RUN_ID": "none"}) is None


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "two"}, "RANK must be an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 and WORLD_SIZE=2 are inconsistent"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK must be >= 0"),
])
def test_inconsistent_rank_variables_raise_a_value_error_naming_them(env, message):
    with pytest.raises(ValueError, match=message):
        resolve_identity("r", environ=env)


@pytest.mark.slow
def test_each_process_gets_its_own_incarnation():
    code = "from ampwatch.agent._identity import resolve_identity; print(resolve_identity('r').incarnation)"
    children = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                               check=True).stdout.strip() for _ in range(2)]
    mine = resolve_identity("r", environ={}).incarnation
    assert len({*children, mine}) == 3
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in children)


def test_every_watch_of_a_process_shares_its_process_key_and_a_forked_child_makes_its_own():
    first, second = resolve_identity("r", environ={}), resolve_identity("r", environ={})
    assert first.incarnation != second.incarnation and first.process_key == second.process_key
    assert len(first.process_key) == 32 and first.process_key not in repr(first)  # a secret: never in a log line
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe and leaves at once
        os.write(write, resolve_identity("r", environ={}).process_key.encode())
        os._exit(0)
    os.close(write)
    assert os.waitpid(child, 0)[1] == 0
    with os.fdopen(read, "rb") as pipe:
        forked = pipe.read().decode()
    assert len(forked) == 32 and forked != first.process_key


def _agree(rank: int, world_size: int, port: int, queue) -> None:
    os.environ.pop("AMPWATCH_RUN", None)
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    os.environ.pop("SLURM_JOB_ID", None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        identity = resolve_identity()
        queue.put((identity.rank, identity.world_size, identity.run, identity.incarnation))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ranks_without_any_run_id_agree_on_rank_zeros_over_torch_distributed():
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    context = mp.start_processes(_agree, args=(2, port, queue), nprocs=2, join=False, start_method="spawn")
    try:
        results = sorted(queue.get(timeout=90) for _ in range(2))
        context.join(timeout=30)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    (rank0, world0, run0, inc0), (rank1, world1, run1, inc1) = results
    assert (rank0, rank1, world0, world1) == (0, 1, 2, 2)
    assert run0 == run1 and run0.startswith("run-"), "both ranks must share rank 0's run id"
    assert inc0 != inc1
