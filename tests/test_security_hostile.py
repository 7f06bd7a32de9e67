"""Hostile clients: cardinality floods against a real collector process, and markup in names.

Markup rendered by a real browser on the status page: tests/test_status_page_browser.py.
"""

from __future__ import annotations

import shutil
import subprocess
import urllib.parse

import httpx
import pytest

from ampwatch_support.batches import APPLIED, make_batch, optimizer, skip_event
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import samples, value

pytestmark = [pytest.mark.timeout(120)]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


@pytest.mark.slow
def test_floods_of_runs_ranks_and_optimizers_hit_their_limits_with_clear_refusals_and_bounded_memory(tmp_path):
    limits = ["--max-runs", "50", "--max-ranks-per-run", "20", "--max-optimizers-per-rank", "4"]
    with CollectorProcess(str(tmp_path / "ampwatch.db"), args=limits) as collector, \
            httpx.Client(base_url=collector.url, timeout=30) as client:
        assert client.post("/v1/ingest", json=make_batch(run="victim", optimizers={"gen": optimizer(steps=7)}))\
            .status_code == 200
        codes: dict[int, int] = {}

        def post(batch: dict) -> None:
            answer = client.post("/v1/ingest", json=batch)
            codes[answer.status_code] = codes.get(answer.status_code, 0) + 1
            if answer.status_code != 200:  # names the limit and what to do, and whether a retry can help
                assert "--max-" in answer.json()["message"] and "raise the limit" in answer.json()["message"]
                assert answer.json()["retry"] is (answer.status_code == 429)
        for i in range(200):  # fill up to the run limit and warm allocator and caches before measuring
            post(make_batch(run=f"warm-{i}"))
        rss_before = _rss_kib(collector.proc.pid)
        for i in range(1500):  # distinct runs
            post(make_batch(run=f"flood-run-{i}-" + "x" * 100))
        for rank in range(1, 500):  # distinct ranks of the one run that got in
            post(make_batch(run="victim", rank=rank, world_size=4096))
        for i in range(200):  # distinct optimizer names on the victim's rank
            post(make_batch(run="victim", seq=2 + i, optimizers={f"opt-{i}-{j}": optimizer() for j in range(8)}))
        rss_after = _rss_kib(collector.proc.pid)
        text = client.get("/metrics").text
        assert client.get("/healthz").status_code == 200
    refused = codes.get(429, 0) + codes.get(422, 0)
    print(f"\ncardinality flood: {sum(codes.values())} requests, answers {codes}; collector RSS "
          f"{rss_before / 1024:.1f} -> {rss_after / 1024:.1f} MiB")
    # Runs past --max-runs are back-pressure (429: they may get in later); ranks and optimizers past their
    # limits are refused for good (422: the same rank's batches never will).
    assert set(codes) == {200, 429, 422} and codes[429] >= 150 + 1500 and codes[422] >= 480 + 200
    assert value(text, "ampwatch_collector_rejected_batches_total", reason="cardinality") == refused
    assert value(text, "ampwatch_collector_ranks_tracked") <= 50 + 20
    runs = {dict(labels)["run"] for (name, labels) in samples(text) if name == "ampwatch_rank_closed"}
    assert len(runs) <= 50
    assert value(text, "ampwatch_optimizer_steps_total", run="victim", rank="0", optimizer="gen") == 7
    assert rss_after - rss_before < 32 * 1024, "memory grew with refused batches"


HOSTILE_RUN = '<script>alert("run")</script>\'"&'
HOSTILE_OPT = '"><img src=x onerror=alert(1)>'
HOSTILE_PARAM = "</td><script>alert('param')</script>\\n\""


def test_markup_in_run_optimizer_and_parameter_names_comes_back_as_inert_json_and_escaped_labels(tmp_path):
    import warnings
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
    from fastapi.testclient import TestClient

    from ampwatch.server import ServerConfig, create_app
    batch = make_batch(run=HOSTILE_RUN, optimizers={HOSTILE_OPT: optimizer(steps=2, skipped=1)},
                       events=[skip_event(1, optimizer=HOSTILE_OPT, params=(HOSTILE_PARAM,))])
    config = ServerConfig(db=str(tmp_path / "ampwatch.db"), allowed_hosts=("testserver",))  # TestClient's Host
    with TestClient(create_app(config)) as client:
        assert client.post("/v1/ingest", json=batch).json() == APPLIED
        quoted = urllib.parse.quote(HOSTILE_RUN, safe="")
        answers = [client.get("/v1/runs"), client.get(f"/v1/runs/{quoted}"), client.get(f"/v1/runs/{quoted}/events"),
                   client.get("/v1/runs/" + urllib.parse.quote("<b>nope</b>", safe="")),
                   client.get(f"/v1/runs/{quoted}/events", params={"kind": "<script>"})]
        for answer in answers:  # JSON, never HTML: a browser will not run what it holds
            assert answer.headers["content-type"].startswith("application/json"), answer.headers
        assert [a.status_code for a in answers] == [200, 200, 200, 404, 422]
        ranks = answers[1].json()["ranks"]
        assert ranks[0]["optimizers"][HOSTILE_OPT]["latest_nonfinite_parameter"] == HOSTILE_PARAM
        assert answers[2].json()["events"][0]["params"][0]["name"] == HOSTILE_PARAM
        assert answers[0].json()["runs"][0]["run"] == HOSTILE_RUN
        page = client.get("/")
        assert HOSTILE_RUN not in page.text and "script-src 'self'" in page.headers["content-security-policy"]
        text = client.get("/metrics").text
    parsed = samples(text)
    assert parsed[("ampwatch_nonfinite_gradient_info", frozenset({
        "run": HOSTILE_RUN, "rank": "0", "optimizer": HOSTILE_OPT, "parameter": HOSTILE_PARAM}.items()))] == 1
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: install the Debian package 'prometheus'"
    check = subprocess.run([promtool, "check", "metrics"], input=text, text=True, capture_output=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
