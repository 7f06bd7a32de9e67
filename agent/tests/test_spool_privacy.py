"""The spool is private: every batch in it carries the process key and is posted with the job's token.

Folders 0700 and files 0600 under any umask (the umask is process-wide, so each is tried in a process of its
own); an entry of the spool that this user did not write (another user's, a link, a fifo, a file others may
write) is refused unread, counted in ``state.delivery.refused_spool_files`` and logged once; a spool folder
of another user is not used, and one of ours that an older agent left loose is tightened. Tests run as root,
which may hand a planted file to another uid (65534, "nobody").
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
import uuid

import httpx
import pytest

from ampwatch.agent._outbox import Pending
from ampwatch.agent._spool import SpoolOutbox
from ampwatch_support.batches import make_batch
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.delivery_harness import make_sender
from ampwatch_support.exposition import value
from ampwatch_support.patience import SETTLE_S, wait_until
from ampwatch_support.ports import free_port
from ampwatch_support.recording_collector import RecordingCollector

pytestmark = pytest.mark.timeout(120)

NOBODY = 65534

_SPOOL_IN_A_PROCESS = textwrap.dedent("""
    import json, os, pathlib, sys
    os.umask(int(sys.argv[2], 8))
    from ampwatch_support.delivery_harness import make_sender
    from ampwatch_support.patience import wait_until
    spool = pathlib.Path(sys.argv[1])
    sender, recorder = make_sender(sys.argv[3], spool_dir=str(spool / "made" / "spool"))
    wait_until(lambda: sender.send_failures > 0, what="an attempt to fail")
    for _ in range(3):
        recorder.skip()
        wait_until(lambda: len(recorder.events) == 0, what="the event to be spooled")
    modes = {str(p.relative_to(spool)): [oct(p.lstat().st_mode & 0o7777), p.is_dir()] for p in sorted(spool.rglob("*"))}
    sender.close(0.2)
    print(json.dumps(modes))
""")


@pytest.mark.parametrize("umask", ["000", "022"])
def test_spool_folders_are_0700_and_its_files_0600_whatever_the_umask(tmp_path, umask):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens: every batch stays in the spool
    done = subprocess.run([sys.executable, "-c", _SPOOL_IN_A_PROCESS, str(tmp_path), umask, down],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    modes = {p: mode for p, (mode, _) in found.items()}
    # By their type, not their names: a batch the sender is still writing is a file too (``*.tmp``), and private.
    folders = {p: mode for p, (mode, folder) in found.items() if folder}
    files = {p: mode for p, mode in modes.items() if p not in folders}
    assert "made" in folders and "made/spool" in folders and len(folders) == 3, modes  # parents, and one incarnation
    assert any(p.endswith(".json") for p in files) and any(p.endswith("lock") for p in files), modes
    assert set(folders.values()) == {"0o700"} and set(files.values()) == {"0o600"}, modes


def _plant_batch(path, run: str, **mode_owner) -> None:
    """Write a valid batch of ``run`` at ``path`` (a stranger's: its own incarnation, one event)."""
    event = {"id": 1, "kind": "warning", "time": 1.0, "iteration": 0, "code": "planted", "message": "planted"}
    path.write_text(json.dumps(make_batch(run=run, incarnation=uuid.uuid4().hex, events=[event])))
    if "mode" in mode_owner:
        os.chmod(path, mode_owner["mode"])
    if "uid" in mode_owner:
        os.chown(path, mode_owner["uid"], mode_owner["uid"])


def test_spool_entries_another_user_could_have_planted_are_refused_unread_counted_and_logged_once(tmp_path, caplog):
    spool, elsewhere = tmp_path / "spool", tmp_path / "elsewhere"
    elsewhere.mkdir()
    port = free_port()
    dead, recorder = make_sender(f"http://127.0.0.1:{port}", run="job", spool_dir=str(spool))
    wait_until(lambda: dead.send_failures > 0, what="an attempt to fail")
    recorder.skip()
    wait_until(lambda: len(recorder.events) == 0, what="the event to be spooled")
    dead.close(0.3)  # gives up: its batches stay for the next process
    dead._thread.join(SETTLE_S)
    (folder,) = spool.iterdir()
    # What a user sharing the host could have left while the spool was loose (an older agent's, umask 000):
    _plant_batch(folder / "000000000901-1.json", "planted-foreign-file", uid=NOBODY)
    _plant_batch(elsewhere / "batch.json", "planted-link")
    (folder / "000000000902-1.json").symlink_to(elsewhere / "batch.json")
    os.mkfifo(folder / "000000000903-1.json")  # opened blocking, it would hang the sender thread
    _plant_batch(folder / "000000000904-1.json", "planted-writable", mode=0o666)
    foreign, linked = spool / ("f" * 32), elsewhere / ("e" * 32)
    foreign.mkdir()
    _plant_batch(foreign / "000000000001-1.json", "planted-foreign-folder")
    os.chown(foreign, NOBODY, NOBODY)
    linked.mkdir()
    _plant_batch(linked / "000000000001-1.json", "planted-linked-folder")
    (spool / ("d" * 32)).symlink_to(linked)
    with CollectorProcess(str(tmp_path / "ampwatch.db"), port=port) as collector, \
            caplog.at_level(logging.WARNING, logger="ampwatch.agent"):
        successor, _ = make_sender(collector.url, run="job", spool_dir=str(spool))
        successor.close(SETTLE_S)
        with httpx.Client(base_url=collector.url, timeout=30) as client:
            runs = sorted(r["run"] for r in client.get("/v1/runs").json()["runs"])
            (rank,) = client.get("/v1/runs/job").json()["ranks"]
            text = client.get("/metrics").text
    assert runs == ["job"], "a planted batch was posted"
    assert rank["incarnations"] == 2  # the dead process's batch replayed, then the successor's
    assert value(text, "ampwatch_agent_refused_spool_files_total", run="job", rank="0") == 6
    refusals = [r.getMessage() for r in caplog.records if "of the spool" in r.getMessage()]
    assert len(refusals) == 1 and "refused 6 entries of the spool" in refusals[0], refusals
    assert "uid 65534" in refusals[0] and "a symbolic link" in refusals[0]
    assert (folder / "000000000903-1.json").exists(), "refused entries are left for a human to look at"


def test_a_spool_folder_of_another_user_is_not_used_and_delivery_goes_on_from_memory(tmp_path):
    spool = tmp_path / "theirs"
    spool.mkdir(mode=0o777)
    os.chown(spool, NOBODY, NOBODY)
    with RecordingCollector() as server:
        sender, recorder = make_sender(server.url, spool_dir=str(spool))
        recorder.skip()
        sender.close(SETTLE_S)
        assert server.event_ids() == [1]
        assert server.acked[-1]["state"]["delivery"]["agent_errors"] == 1
    assert list(spool.iterdir()) == [], "nothing of the job's may go into another user's folder"


def test_an_older_agents_loose_spool_of_ours_is_tightened_and_its_batches_are_replayed(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    older = spool / ("a" * 32)
    older.mkdir()
    (older / "000000000001-0.json").write_bytes(b'{"run": "r", "rank": 0, "world_size": 1}')
    for path, mode in ((spool, 0o777), (older, 0o755), (older / "000000000001-0.json", 0o644)):
        os.chmod(path, mode)
    successor = SpoolOutbox(spool, "b" * 32, max_bytes=1 << 20)
    try:
        head = successor.head()
        assert head is not None and head.load() == b'{"replayed":true,"run": "r", "rank": 0, "world_size": 1}'
        assert successor.refused_files == 0
        for path, mode in ((spool, 0o700), (older, 0o700), (older / "000000000001-0.json", 0o600)):
            assert stat.S_IMODE(os.stat(path).st_mode) == mode, path
        successor.put(Pending(seq=1, events=0, run="r", rank=0, world_size=1,
                              body=b'{"run": "r", "rank": 0, "world_size": 1}'))
    finally:
        successor.close()
