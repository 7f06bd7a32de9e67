"""A run split in blocks over two real collectors (``--peers``, ``--block-ranks 2``), beside a single collector.

Each rank's batch goes to the collector ``ampwatch.contract.placement.collector_for`` names, as the agents send it.

- A 6-rank run in 3 blocks of 2, every rank in a skip storm (blocks 1 and 3 on one replica, block 2 on the other):
  one AmpRunSkipStorm per replica, judged over the ranks it holds (2 of 6 on one: a share of the world size would
  not fire), labelled with its block (apart from the other replica's in Alertmanager), its texts and its notification
  naming its block and linking the other replica's page.
- A 2-rank run held whole by one replica, in the same storm: exactly the alerts of a single collector without
  ``--peers``, texts included (no block text).
- Ranks sent to a replica the rule does not place them on: kept (the ranks are in the run), counted once per rank in
  ``misplaced_ranks``, logged once per run.
- ``GET /v1/runs/{run}`` and ``/placement``: the blocks, each with its collector and ``here``, from either replica.
- The page (Chromium): "block i of n (ranks a-b ...)" and a link to the other replica's page of the run.
"""

from __future__ import annotations

import urllib.parse
import uuid

import httpx

from ampwatch.contract.placement import blocks, collector_for
from ampwatch_support.batches import make_batch, optimizer, post_batch, samples, skip_event
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.headless_browser import needs_browser, open_page
from ampwatch_support.headless_browser import wait_until as page_wait_until
from ampwatch_support.patience import wait_until
from ampwatch_support.ports import free_port
from ampwatch_support.skipping_jobs import SkippingJobs, unique
from ampwatch_support.webhook_receiver import WebhookReceiver

BLOCK_RANKS = 2
SPLIT, WHOLE, ASTRAY = "split-6", "whole-2", "astray-6"


def storm_batch(run: str, rank: int, world_size: int, seq: int = 1, incarnation: str | None = None) -> dict:
    """A rank 20 steps into a skip streak: past the streak alert's warning threshold (16)."""
    reached = {"1": 1, "2": 1, "4": 1, "8": 1, "16": 1}
    return make_batch(run=run, rank=rank, world_size=world_size, local_rank=rank % 8, host=f"node-{rank // 8}",
                      incarnation=incarnation or uuid.uuid4().hex, seq=seq, iteration=20,
                      optimizers={"gen": optimizer(skipped=20, consecutive=20, longest=20, streaks=1,
                                                   reached=reached)})


def firing(url: str, run: str) -> list[dict]:
    return [a for a in httpx.get(url + "/v1/alerts", timeout=30).json()["firing"] if a["labels"]["run"] == run]


def named(alerts: list[dict], name: str) -> list[dict]:
    return [a for a in alerts if a["name"] == name]


def test_a_split_runs_storm_fires_once_per_replica_naming_its_block_and_a_whole_run_fires_as_on_one_collector(
        tmp_path):
    ports = free_port(), free_port()
    peers = [f"http://127.0.0.1:{port}" for port in ports]
    with WebhookReceiver() as hooks:
        def args(name: str) -> list[str]:
            return ["--peers", ",".join(peers), "--block-ranks", str(BLOCK_RANKS), "--notify-group-wait", "0",
                    "--webhook", f"webhook:{hooks.url}/{name}"]
        with CollectorProcess(str(tmp_path / "a.db"), port=ports[0], args=args("a")) as a, \
                CollectorProcess(str(tmp_path / "b.db"), port=ports[1], args=args("b")) as b, \
                CollectorProcess(str(tmp_path / "single.db")) as single:
            by_url = {a.url: a, b.url: b}
            for rank in range(6):
                post_batch(collector_for(SPLIT, rank, 6, peers, BLOCK_RANKS), storm_batch(SPLIT, rank, 6))
            for rank in range(2):
                batch = storm_batch(WHOLE, rank, 2)
                post_batch(collector_for(WHOLE, rank, 2, peers, BLOCK_RANKS), batch)
                post_batch(single.url, batch)

            # The split run: one storm per replica, over the ranks it holds.
            placed = blocks(SPLIT, 6, peers, BLOCK_RANKS)
            assert {b.collector for b in placed} == set(peers)  # 3 blocks on 2 replicas: both hold some
            for url in peers:
                mine = [b for b in placed if b.collector == url]
                other = next(u for u in peers if u != url)
                storm = wait_until(lambda url=url: named(firing(url, SPLIT), "AmpRunSkipStorm"),
                                   what=f"the split run's storm on {url}")
                # Labelled with its block numbers here: the replicas' alerts of the run stay apart in Alertmanager.
                label = ",".join(str(b.index + 1) for b in mine)
                assert len(storm) == 1 and storm[0]["labels"] == {"run": SPLIT, "severity": "warning",
                                                                  "block": label}, storm
                texts = storm[0]["annotations"]
                ranges = ", ".join(f"{b.first_rank}-{b.last_rank}" for b in mine)
                where = f"ranks {ranges} of 6 (block{'s' if len(mine) > 1 else ''} " \
                        f"{', '.join(str(b.index + 1) for b in mine)} of 3)"
                assert texts["block"] == where, texts
                assert texts["summary"].endswith(f"[{where} on this replica]"), texts
                assert where in texts["description"] and "Prometheus" in texts["description"], texts
                page = f"{other}/#run={urllib.parse.quote(SPLIT, safe='')}"
                assert page in texts["other_blocks"] and page in texts["description"], texts
                assert url not in texts["other_blocks"], texts
                # The storm speaks for the ranks' own streak alerts: none of them fires.
                assert not named(firing(url, SPLIT), "AmpConsecutiveSkippedSteps"), firing(url, SPLIT)

                # The run view says where the run is, from either replica.
                run = httpx.get(f"{url}/v1/runs/{SPLIT}", timeout=30).json()
                assert [r["rank"] for r in run["ranks"]] == [r for b in mine for r in range(b.first_rank,
                                                                                              b.last_rank + 1)]
                expected = {"world_size": 6, "block_ranks": BLOCK_RANKS, "split": True, "collector": url,
                            "block_count": 3, "misplaced_ranks": 0,
                            "blocks": [{"index": b.index, "first_rank": b.first_rank, "last_rank": b.last_rank,
                                        "collector": b.collector, "here": b.collector == url} for b in placed]}
                assert run["placement"] == expected, run["placement"]
                assert httpx.get(f"{url}/v1/runs/{SPLIT}/placement", timeout=30).json() == \
                    {"run": SPLIT, "collectors": 2, "placement": expected}

            # Each replica's notification of the storm names its block and links the other replica's page.
            def storm_notes() -> dict[str, dict]:
                return {request["path"]: alert["annotations"] for request in hooks.requests
                        for alert in request["body"]["alerts"]
                        if alert["labels"]["alertname"] == "AmpRunSkipStorm" and alert["labels"]["run"] == SPLIT}
            notes = wait_until(lambda: len(storm_notes()) == 2 and storm_notes(), what="both replicas' notifications")
            assert len({named(firing(u, SPLIT), "AmpRunSkipStorm")[0]["fingerprint"] for u in peers}) == 2
            for path, me, other in (("/a", a.url, b.url), ("/b", b.url, a.url)):
                [storm] = named(firing(me, SPLIT), "AmpRunSkipStorm")
                assert notes[path]["block"] == storm["annotations"]["block"]
                assert f"{other}/#run=" in notes[path]["other_blocks"] and me not in notes[path]["other_blocks"]

            # The whole run: its one replica fires what a collector without --peers fires, to the letter.
            holder = by_url[collector_for(WHOLE, 0, 2, peers, BLOCK_RANKS)]

            def alerts_of(url: str) -> set:
                return {(x["name"], tuple(sorted(x["labels"].items())), tuple(sorted(x["annotations"].items())))
                        for x in firing(url, WHOLE)}
            wait_until(lambda: any(x[0] == "AmpRunSkipStorm" for x in alerts_of(holder.url))
                       and alerts_of(holder.url) == alerts_of(single.url),
                       what=lambda: f"the same alerts: {alerts_of(holder.url)} vs {alerts_of(single.url)}")
            assert all("block" not in dict(x[1]) and "block" not in dict(x[2]) for x in alerts_of(holder.url))
            held = httpx.get(f"{holder.url}/v1/runs/{WHOLE}", timeout=30).json()["placement"]
            assert held["split"] is False and held["blocks"] == [
                {"index": 0, "first_rank": 0, "last_rank": 1, "collector": holder.url, "here": True}], held
            assert "placement" not in httpx.get(f"{single.url}/v1/runs/{WHOLE}", timeout=30).json()
            assert httpx.get(f"{single.url}/v1/runs/{WHOLE}/placement", timeout=30).json() == \
                {"run": WHOLE, "collectors": 1, "placement": None}

            # Ranks sent where the rule does not place them: kept, counted once each, logged once per run.
            wrong = {rank: next(u for u in peers if u != collector_for(ASTRAY, rank, 6, peers, BLOCK_RANKS))
                     for rank in range(6)}
            astray_at = wrong[0]
            astray = [rank for rank in range(6) if wrong[rank] == astray_at][:2]
            incarnations = {rank: uuid.uuid4().hex for rank in astray}
            for seq in (1, 2):
                for rank in astray:
                    post_batch(astray_at, storm_batch(ASTRAY, rank, 6, seq, incarnations[rank]))
            run = httpx.get(f"{astray_at}/v1/runs/{ASTRAY}", timeout=30).json()
            assert [r["rank"] for r in run["ranks"]] == astray
            assert run["placement"]["misplaced_ranks"] == len(astray), run["placement"]
            log = open(by_url[astray_at].log_path).read()
            assert log.count(f"of run '{ASTRAY}'") == 1 and "misplaced_ranks" in log, log[-2000:]


def test_a_replica_judges_a_split_runs_suspects_over_the_ranks_it_holds(tmp_path):
    """docs/suspects.md rules 4 and 5 compare an event's origin set with the run's ranks: a replica holding a block
    sees only its ranks' evidence, so it compares with those. A 3-rank run in blocks of 2: ranks 0-1 on one
    replica, rank 2 alone on the other.

    - Three whole-job overflows (every rank's own gradients, ``origin: true`` everywhere): no suspect on either
      replica. Compared with the world size, rank 2 would be the sole origin of three (a suspect device), and the
      id ranks 0 and 1 both trained on each time a suspect sample.
    - In another such run, rank 0 alone is the origin of three: its replica still finds its device."""
    ports = free_port(), free_port()
    peers = [f"http://127.0.0.1:{port}" for port in ports]
    args = ["--peers", ",".join(peers), "--block-ranks", str(BLOCK_RANKS)]
    with CollectorProcess(str(tmp_path / "a.db"), port=ports[0], args=args), \
            CollectorProcess(str(tmp_path / "b.db"), port=ports[1], args=args):
        jobs = {url: SkippingJobs(url) for url in peers}
        for run, origins in (("whole-3", {0, 1, 2}), ("faulty-3", {0})):
            for iteration in (5, 6, 7):
                for rank in range(3):
                    ids = ["shared", *unique(f"{run}-{iteration}-r{rank}")] if rank < 2 else \
                        unique(f"{run}-{iteration}-r{rank}")
                    jobs[collector_for(run, rank, 3, peers, BLOCK_RANKS)].post(
                        run, rank, [skip_event(0, iteration=iteration, origin=rank in origins,
                                               samples=samples(ids))], world_size=3, host=f"{run}-host")
        first, second = blocks("whole-3", 3, peers, BLOCK_RANKS)
        assert (first.last_rank - first.first_rank, second.first_rank, second.last_rank) == (1, 2, 2)
        assert first.collector != second.collector
        found = {}
        for url, job in jobs.items():
            judged = wait_until(lambda url=url, job=job: (body := httpx.get(url + "/v1/suspects", timeout=30).json())
                                ["evidence_rows"] == job.rows and body, what=f"{url}'s evidence judged")
            found[url] = ([d["device"] for d in judged["devices"]], [x["id"] for x in judged["samples"]])
        faulty_at = blocks("faulty-3", 3, peers, BLOCK_RANKS)[0].collector
        assert found == {url: (["faulty-3-host:0"] if url == faulty_at else [], []) for url in peers}


@needs_browser
def test_the_page_of_a_split_run_says_its_block_and_links_the_other_blocks_replica(tmp_path):
    ports = free_port(), free_port()
    peers = [f"http://127.0.0.1:{port}" for port in ports]
    args = ["--peers", ",".join(peers), "--block-ranks", str(BLOCK_RANKS)]
    with CollectorProcess(str(tmp_path / "a.db"), port=ports[0], args=args), \
            CollectorProcess(str(tmp_path / "b.db"), port=ports[1], args=args):
        run = "split/4 <img src=x>"  # a slash and markup: the links must quote it, the line show it as text
        for rank in range(4):
            post_batch(collector_for(run, rank, 4, peers, BLOCK_RANKS), storm_batch(run, rank, 4))
        first, second = blocks(run, 4, peers, BLOCK_RANKS)
        assert first.collector != second.collector
        with open_page(f"{first.collector}/#run={urllib.parse.quote(run, safe='')}") as (page, problems):
            assert wait_until_shown(page, "#run-blocks"), "the block line never showed"
            line = page.locator("#run-blocks").text_content()
            assert line.startswith("block 1 of 2 (ranks 0-1 of 4) on this collector"), line
            link = page.locator("#run-blocks a.block-link")
            assert link.count() == 1 and link.text_content() == "block 2 (ranks 2-3)"
            assert link.get_attribute("href") == f"{second.collector}/#run={urllib.parse.quote(run, safe='')}"
            link.click()  # the other replica's page, on the same run
            page.wait_for_url(f"{second.collector}/**")
            assert wait_until_shown(page, "#run-blocks"), "the other replica's block line never showed"
            assert page.locator("#run-blocks").text_content().startswith(
                "block 2 of 2 (ranks 2-3 of 4) on this collector")
            assert page.locator("#run-name").text_content() == run and page.locator("img").count() == 0
            assert problems == []


def wait_until_shown(page, selector: str) -> bool:
    return page_wait_until(page, f"!document.querySelector({selector!r}).hidden")
