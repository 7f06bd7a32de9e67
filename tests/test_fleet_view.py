"""The fleet view (issue 41, section 3): every replica's runs on any replica, a replica down or hung shown as such.

Three real collectors with the same ``--peers``, which also lists a port where nothing listens (a replica
down). Each holds the runs placed on it (``ampwatch.contract.placement``, as the agents place them) and a run
bigger than ``--block-ranks`` lies in blocks on two of them. Once both live replicas have seen the third
answer, it is stopped with SIGSTOP: its port still accepts connections, but nothing answers (a hung replica).

| case                                        | GET /v1/runs on a live replica shows                         |
|---------------------------------------------|--------------------------------------------------------------|
| a run on any replica                        | the run, with the replica holding it                         |
| a run in blocks on two replicas             | one row per replica, each with the blocks it holds           |
| nothing listens on a peer's port            | that replica ``down``                                        |
| a peer accepts connections, answers nothing | that replica ``slow``, its runs as last listed, list answering |
| ``scope=local``                             | this replica's runs only (what the others ask)               |
| a rank's series in ``/metrics``             | on the replica holding it, never on another                  |
"""

from __future__ import annotations

import itertools
import os
import pathlib
import signal
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ampwatch.contract.placement import collector_for, ranking
from ampwatch_support.batches import make_batch
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import samples
from ampwatch_support.headless_browser import needs_browser, open_page
from ampwatch_support.patience import SETTLE_S, wait_until
from ampwatch_support.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

READ_TOKEN = "fleet-read-9d1e"  # every replica shares one; each sends it to the others
BLOCK_RANKS = 2
SPLIT_WORLD = 4  # two blocks of two ranks
AUTH = {"Authorization": f"Bearer {READ_TOKEN}"}
ARTIFACTS = pathlib.Path(__file__).resolve().parents[1] / "artifacts"


def _placed_on(first: str, urls: list[str], prefix: str, second: str | None = None) -> str:
    """The first run name ``prefix-N`` that placement puts on ``first`` (and its second block on ``second``)."""
    for n in itertools.count():
        order = ranking(f"{prefix}-{n}", urls)
        if order[0] == first and (second is None or order[1] == second):
            return f"{prefix}-{n}"
    raise AssertionError("unreachable")


def _send(run: str, world_size: int, urls: list[str]) -> dict[str, set[int]]:
    """One batch per rank of ``run``, each to the collector placement gives it; the ranks each collector got."""
    got: dict[str, set[int]] = {}
    for rank in range(world_size):
        url = collector_for(run, rank, world_size, urls, block_ranks=BLOCK_RANKS)
        batch = make_batch(run=run, rank=rank, world_size=world_size, incarnation=f"{rank + 1:032x}")
        answer = httpx.post(url + "/v1/ingest", json=batch, timeout=30)
        assert answer.status_code == 200, answer.text
        got.setdefault(url, set()).add(rank)
    return got


def _runs(url: str, **params: Any) -> dict[str, Any]:
    answer = httpx.get(url + "/v1/runs", params=params, headers=AUTH, timeout=SETTLE_S)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _listed(body: dict[str, Any]) -> set[tuple[str, str]]:
    return {(row["run"], row["replica"]) for row in body["runs"]}


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


class Fleet:
    """The running fleet: the live replicas, the hung one, the down URL, and where each run's ranks went."""

    def __init__(self, live: list[CollectorProcess], hung: CollectorProcess, down: str, urls: list[str]) -> None:
        self.live, self.hung, self.down, self.urls = live, hung, down, urls
        self.held: dict[str, dict[str, set[int]]] = {}  # run -> replica -> ranks

    @property
    def expected(self) -> set[tuple[str, str]]:
        return {(run, url) for run, where in self.held.items() for url in where}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    folder = tmp_path_factory.mktemp("fleet")
    ports = [free_port() for _ in range(4)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    args = ["--peers", ",".join(urls), "--read-token", READ_TOKEN, "--block-ranks", str(BLOCK_RANKS)]
    a, b, h = (CollectorProcess(str(folder / f"{name}.db"), port=port, args=args)
               for name, port in zip("abh", ports, strict=False))
    started: list[CollectorProcess] = []
    try:
        for collector in (a, b, h):
            started.append(collector.start())
        fleet = Fleet([a, b], h, urls[3], urls)
        for name, collector in (("alpha", a), ("beta", b), ("hung", h)):
            run = _placed_on(collector.url, urls, name)
            fleet.held[run] = _send(run, 2, urls)
        split = _placed_on(a.url, urls, "split", second=b.url)
        fleet.held[split] = _send(split, SPLIT_WORLD, urls)
        assert set(fleet.held[split]) == {a.url, b.url} and fleet.held[split][a.url] == {0, 1}
        # Both live replicas have seen every run, the hung one's included, before it stops answering.
        for collector in (a, b):
            wait_until(lambda c=collector: _listed(_runs(c.url)) == fleet.expected, SETTLE_S,
                       lambda c=collector: f"{c.url} listing {fleet.expected}: {_runs(c.url)}")
        os.kill(h.proc.pid, signal.SIGSTOP)
        yield fleet
    finally:
        if h.proc is not None and h.proc.poll() is None:
            os.kill(h.proc.pid, signal.SIGCONT)
        for collector in started:
            collector.kill(signal.SIGTERM)


def test_every_live_replica_lists_every_run_of_the_fleet_with_the_replica_holding_it(fleet):
    for collector in fleet.live:
        body = _runs(collector.url)
        assert _listed(body) == fleet.expected, body
        for row in body["runs"]:
            held = fleet.held[row["run"]][row["replica"]]
            assert row["ranks"] == len(held) and row["in_metrics"] is True, row
            # A run in blocks: each replica's row names the blocks it holds, of how many.
            split = row["split"]
            assert split is None if len(fleet.held[row["run"]]) == 1 else \
                split == {"blocks": sorted({r // BLOCK_RANKS for r in held}), "of": 2, "world_size": SPLIT_WORLD}, row
        # Page by page, one run at a time: every row once, in the same order, whichever replica holds it.
        rows, after = [], None
        while True:
            page = _runs(collector.url, limit=1, **({"after": after} if after else {}))
            rows += [(row["run"], row["replica"]) for row in page["runs"]]
            after = page["next"]
            if after is None:
                break
        assert rows == [(row["run"], row["replica"]) for row in body["runs"]] and len(set(rows)) == len(rows)
        # scope=local: this replica's own runs (what the others ask of it), without the fleet's states.
        own = _runs(collector.url, scope="local")
        assert _listed(own) == {(run, url) for run, url in fleet.expected if url == collector.url}
        assert "replicas" not in own


def test_a_replica_down_and_a_hung_one_are_shown_as_such_while_the_list_answers(fleet):
    a = fleet.live[0]
    hung = fleet.hung.url

    def states() -> dict[str, dict[str, Any]] | None:
        body = _runs(a.url)
        found = {r["url"]: r for r in body["replicas"]}
        return found if found[fleet.down]["state"] == "down" and found[hung]["state"] == "slow" else None

    found = wait_until(states, SETTLE_S, "the down replica shown down and the hung one slow")
    # The list answered while the hung replica still holds every connection it accepted without a word.
    assert _stopped(fleet.hung.proc.pid)
    assert found[fleet.down]["answer_age"] is None and found[fleet.down]["error"]
    assert "no answer within" in found[hung]["error"] and found[hung]["answer_age"] > 0
    assert found[a.url] == {"url": a.url, "state": "up", "answer_age": 0.0, "checked_age": 0.0, "error": None,
                            "self": True}
    assert all(found[live.url]["state"] == "up" for live in fleet.live), found
    # The hung replica's runs stay listed as it last listed them, and their answer only ages.
    spent = []
    with httpx.Client(headers=AUTH, timeout=SETTLE_S) as client:
        for _ in range(5):
            started = time.monotonic()
            body = client.get(a.url + "/v1/runs").json()
            spent.append(time.monotonic() - started)
            assert _listed(body) == fleet.expected and _stopped(fleet.hung.proc.pid)
    print(f"GET /v1/runs with a replica down and one hung: {', '.join(f'{s * 1000:.0f}' for s in spent)} ms")
    again = wait_until(lambda: (r := {x["url"]: x for x in _runs(a.url)["replicas"]})[hung]["answer_age"]
                       > found[hung]["answer_age"] and r, SETTLE_S, "the hung replica's answer ageing")
    assert again[hung]["state"] == "slow"


def test_each_rank_is_in_the_metrics_of_the_one_replica_holding_it(fleet):
    shown: dict[str, set[tuple[str, int]]] = {}
    for collector in fleet.live:
        text = httpx.get(collector.url + "/metrics", headers=AUTH, timeout=SETTLE_S).text
        shown[collector.url] = {(dict(labels)["run"], int(dict(labels)["rank"])) for (_, labels), _ in
                                samples(text).items() if {"run", "rank"} <= dict(labels).keys()}
    a, b = (c.url for c in fleet.live)
    assert not shown[a] & shown[b], sorted(shown[a] & shown[b])  # no rank counted twice by Prometheus
    for url in (a, b):
        assert shown[url] == {(run, rank) for run, where in fleet.held.items() for rank in where.get(url, ())}


@needs_browser
def test_the_page_shows_each_runs_replica_as_a_link_and_names_each_replica_not_answering(fleet):
    a = fleet.live[0]
    wait_until(lambda: {r["url"]: r["state"] for r in _runs(a.url)["replicas"]}[fleet.down] == "down")
    with open_page(a.url + "/") as (page, problems):
        page.wait_for_selector("#token-form:not([hidden])", timeout=30_000)
        page.fill("#token", READ_TOKEN)
        page.click("#token-form button")
        page.wait_for_selector("#replicas-down li[data-state=slow]", timeout=30_000)
        rows = page.locator("#runs tr.run")
        assert rows.count() == len(fleet.expected)
        assert page.locator("#runs-replica").is_visible()
        seen = set()
        for i in range(rows.count()):
            row = rows.nth(i)
            run = row.get_attribute("data-run")
            replica = row.locator("a.replica-link")
            href = replica.get_attribute("href")
            url = href.split("/#run=")[0]
            assert href == f"{url}/#run={urllib.parse.quote(run, safe='')}", href
            seen.add((run, url))
            # A run held here opens here; another replica's opens on that replica's page.
            link = row.locator("a.run-link").get_attribute("href")
            assert link == (f"#run={urllib.parse.quote(run, safe='')}" if url == a.url else href), link
            if url == fleet.hung.url:
                assert "(not answering)" in row.locator("td.replica").text_content()
            if len(fleet.held[run]) > 1:
                assert "of 2" in row.locator("td.replica").text_content()
        assert seen == fleet.expected
        lines = {li.get_attribute("data-replica"): li.get_attribute("data-state")
                 for li in page.locator("#replicas-down li").all()}
        assert lines == {fleet.down: "down", fleet.hung.url: "slow"}
        down_line = page.locator(f'#replicas-down li[data-replica="{fleet.down}"]').text_content()
        assert "down" in down_line and "none of its runs are listed" in down_line, down_line
        assert page.locator("#replicas").text_content() == "of 4 replicas, 2 answering"
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator("#runs-view").screenshot(path=str(ARTIFACTS / "status-page-fleet.png"))
        assert not [p for p in problems if "401" not in p], problems
