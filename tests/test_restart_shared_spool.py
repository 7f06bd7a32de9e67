"""Issue 37 item 6 with real processes: a rank restarts while a sibling replays its dead process's spool.

The ranks of a host share one spool folder (``AMPWATCH_SPOOL_DIR``). Rank 3's process loses the
collector (a network hop that goes down), spools the batches of two more skips, and dies. The elastic
launcher starts rank 3 again, and the new process reports; then rank 4's process starts, adopts the dead
process's folder and replays its batches. Before the fix, those late batches took rank 3 back for the dead
process and every later batch of the restarted one got ``409``: the rank showed a dead pid for good. Now
they are the dead process's history: counted, never the rank's owner. Every part is real: the agents in
their own processes with real GradScalers, a TCP hop, the collector.
"""

from __future__ import annotations

import json
import pathlib
import signal
import socket
import threading

import httpx
import pytest

from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.patience import SETTLE_S, START_S
from ampwatch_support.ports import free_port
from ampwatch_support.rank_processes import spawn_rank, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RUN = "shared-spool"

# Trains until told to stop, a skip every 24 iterations; writes what it did after every iteration. With a
# fifth argument, it waits after its first skip until that file exists, then trains two skips more and idles.
RANK = """
import json, os, pathlib, sys, time
from ampwatch_support.fault_training import POISON_EVERY, Trainer
url, run, stop, truth = sys.argv[1:5]
go = sys.argv[5] if len(sys.argv) > 5 else None
trainer = Trainer(collector=url, run=run, push_interval=0.1)
while not os.path.exists(stop):
    if go and len(trainer.skipped_at) == 1:
        while not os.path.exists(go):
            time.sleep(0.01)
        for _ in range(2 * POISON_EVERY):
            trainer.step("train")
        go = None
    elif go is None and len(sys.argv) > 5:
        time.sleep(0.01)
        continue
    trainer.step("train")
    pathlib.Path(truth + ".tmp").write_text(json.dumps(dict(trainer.truth(), pid=os.getpid())))
    os.replace(truth + ".tmp", truth)
trainer.watch.close(timeout=30)
"""


class NetworkHop:
    """A TCP hop to ``target`` that the test can take down: afterwards every connection is refused."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit("//", 1)[1].rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", free_port()))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # taken down
            upstream = socket.create_connection(self._target)
            with self._lock:
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def take_down(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() above; close() alone would not
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()


def _truth(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _rank(client: httpx.Client, rank: int) -> dict:
    found = [r for r in client.get(f"/v1/runs/{RUN}").json().get("ranks", []) if r["rank"] == rank]
    return found[0] if found else {}


def _spooled_skips(folder: pathlib.Path) -> int:
    """The skips of the newest batch waiting in the dead process's spool folder (0: none yet)."""
    batches = sorted(folder.glob("*/*.json"))
    return json.loads(batches[-1].read_bytes())["state"]["optimizers"]["main"]["skipped"] if batches else 0


def test_a_restarted_rank_keeps_its_rank_when_a_sibling_replays_the_dead_processs_spool(tmp_path):
    spool, stops = tmp_path / "spool", {name: tmp_path / f"stop-{name}" for name in ("dead", "restarted", "sibling")}
    truths = {name: tmp_path / f"truth-{name}.json" for name in stops}
    ranks = []
    with CollectorProcess(str(tmp_path / "ampwatch.db"), args=["--silent-after", "600"]) as collector, \
            httpx.Client(base_url=collector.url, timeout=30) as client:
        hop = NetworkHop(collector.url)
        try:
            def start(name: str, url: str, rank: int, shared_spool: bool, *args: str):
                env = {"AMPWATCH_SPOOL_DIR": str(spool)} if shared_spool else {}
                ranks.append(spawn_rank(RANK, url, RUN, str(stops[name]), str(truths[name]), *args, rank=rank,
                                        world_size=8, env=env))
                return ranks[-1]

            go = tmp_path / "go"
            dead = start("dead", hop.url, 3, True, str(go))
            wait_for(lambda: _rank(client, 3).get("optimizers", {}).get("main", {}).get("skipped", 0) == 1,
                     START_S, "rank 3's first skip to arrive")
            hop.take_down()
            go.touch()
            # Two more skips after the hop went down: they reach the spool only.
            wait_for(lambda: _spooled_skips(spool) == 3, START_S, "two more skips in the spool")
            dead.send_signal(signal.SIGKILL)  # no close, no flush: its spool folder stays, unlocked
            dead.wait(SETTLE_S)
            spooled = _spooled_skips(spool)

            restarted = start("restarted", collector.url, 3, shared_spool=False)
            wait_for(lambda: _rank(client, 3).get("pid") == restarted.pid, START_S, "the restarted rank 3")
            start("sibling", collector.url, 4, shared_spool=True)  # adopts the dead one's folder
            wait_for(lambda: not any(spool.glob("*/*.json")) and _rank(client, 4), START_S,
                     "the dead process's spool to be replayed")

            for name in ("restarted", "sibling"):
                stops[name].touch()
            for process in ranks[1:]:
                assert process.wait(SETTLE_S) == 0, process.communicate()[0]
            restarted_truth = _truth(truths["restarted"])
            rank = _rank(client, 3)
            assert (rank["pid"], rank["closed"], rank["conflicts"]) == (restarted.pid, True, [])
            # Every skip counted once: the dead process's (delivered and replayed) and the restarted one's.
            assert rank["optimizers"]["main"]["skipped"] == spooled + len(restarted_truth["skipped_at"])
            assert rank["delivery"]["rejected_batches"] == 0 and rank["incarnations"] == 2
        finally:
            hop.take_down()
            for process in ranks:
                process.kill()
