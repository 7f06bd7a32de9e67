"""Why it skipped, end to end: real gloo DDP jobs over a real DataLoader, the real agent, a real collector.

Three runs into one collector: one where a sample's input holds an inf (bad data, drawn by a different rank each
epoch), two where one rank corrupts its own gradients at random iterations whatever the data (a faulty device).
Every skip names its samples and where it began; ``GET /v1/suspects`` lists that sample and that device, and
nothing else; the status page shows the three answers (the README's screenshot). A run where the scale settles
from 2**127 and the whole job overflows at once accuses nothing. The truth comes from what the ranks drew
(``ampwatch_support.diagnosis_job`` writes it).
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys
import urllib.parse

import httpx
import pytest

from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.diagnosis_job import BAD_SAMPLE
from ampwatch_support.headless_browser import needs_browser, open_page
from ampwatch_support.patience import wait_until

ARTIFACTS = pathlib.Path(__file__).resolve().parents[1] / "artifacts"
RANKS = 3
FAULTY = 1
HOST = socket.gethostname()


def _run(url: str, run: str, scenario: str, out: pathlib.Path, *extra: str) -> list[dict]:
    out.mkdir()
    job = subprocess.run([sys.executable, "-m", "ampwatch_support.diagnosis_job", "--collector", url, "--run", run,
                          "--out", str(out), "--scenario", scenario, "--ranks", str(RANKS), *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=240)
    assert job.returncode == 0, job.stdout.decode()[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]


def _get(url: str, path: str) -> dict:
    answer = httpx.get(url + path, timeout=30)
    answer.raise_for_status()
    return answer.json()


def _closed(url: str, run: str) -> bool:
    try:
        ranks = _get(url, f"/v1/runs/{urllib.parse.quote(run)}")["ranks"]
    except httpx.HTTPError:
        return False
    return len(ranks) == RANKS and all(r["closed"] for r in ranks)


def _skips(url: str, run: str) -> list[dict]:
    return _get(url, f"/v1/runs/{urllib.parse.quote(run)}/events?kind=skip&limit=1000")["events"]


def _starts(iterations: list[int]) -> list[int]:
    """The first iteration of each run of consecutive ones: a streak's first skip."""
    return [it for it in sorted(iterations) if it - 1 not in iterations]


@pytest.mark.slow
@pytest.mark.timeout(600)
@needs_browser
def test_bad_data_and_a_faulty_device_are_told_apart_by_their_evidence(tmp_path):
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        url = collector.url
        # Bad data: seed 0 deals sample 13 to ranks 0, 1, 0, 2 in epochs 0-3.
        data = _run(url, "data", "data", tmp_path / "data", "--epochs", "4", "--seed", "0")
        drew = {(r, it) for r, rank in enumerate(data) for it, ids in enumerate(rank["drawn"]) if BAD_SAMPLE in ids}
        assert len({r for r, _ in drew}) >= 2  # it landed on different ranks
        # A faulty device: rank 1 (host, local rank 1) in two runs, its gradients corrupted whatever the data.
        faulty = {run: _run(url, run, "device", tmp_path / run, "--epochs", "5", "--faulty-rank", str(FAULTY))
                  for run in ("device-a", "device-b")}
        assert wait_until(lambda: all(_closed(url, run) for run in ("data", "device-a", "device-b")))

        skips = _skips(url, "data")
        origins = [e for e in skips if e["origin"]]
        assert {(e["rank"], e["iteration"]) for e in origins if e["streak"] == 1} == drew
        for event in origins:
            ids = data[event["rank"]]["drawn"][event["iteration"]]
            assert event["samples"]["ids"] == ids and event["samples"]["count"] == len(ids)
            assert event["began"]["loss_finite"] is False and event["began"]["stage"] == "forward"
        probes = [e["began"]["probe"] for e in sorted(origins, key=lambda e: e["iteration"])]
        assert probes[0] == "armed" and "found" in probes[1:], probes
        found = [e["began"] for e in origins if e["began"].get("probe") == "found"]
        assert {(b["module"], b["module_type"]) for b in found} == {("embed", "Linear")}, found

        starts = 0
        for run, ranks in faulty.items():
            glitched = ranks[FAULTY]["glitched"]
            skips = _skips(url, run)
            assert {e["iteration"] for e in skips if e["origin"]} >= set(_starts(glitched))
            assert {e["rank"] for e in skips if e["origin"]} == {FAULTY}
            for event in (e for e in skips if e["origin"]):
                assert event["samples"]["ids"] == ranks[FAULTY]["drawn"][event["iteration"]]
                began = event["began"]
                assert (began["loss_finite"], began["stage"], began["module"]) == (True, "backward", "embed"), began
                assert began["param"] in ("embed.weight", "embed.bias")
            starts += len(_starts(glitched))
        assert starts >= 3, "the seeded faults must make at least K=3 events for the test to mean anything"

        suspects = _get(url, "/v1/suspects")
        assert [(s["id"], len(s["devices"]) >= 2) for s in suspects["samples"]] == [(BAD_SAMPLE, True)]
        assert [(d["host"], d["local_rank"]) for d in suspects["devices"]] == [(HOST, FAULTY)], suspects["devices"]
        device = suspects["devices"][0]
        assert device["runs"] == ["device-a", "device-b"] and device["events"] >= 3
        _page_shows_the_three_answers(url, device["device"])


def _page_shows_the_three_answers(url: str, device: str) -> None:
    """The status page of the faulty device's second run: where its skips began, on which samples, and the
    suspects (the README's screenshot, retaken into ``artifacts/``)."""
    with open_page(f"{url}/#run=device-b", height=1000) as (page, problems):
        page.wait_for_selector("#suspect-devices tr.suspect-device", timeout=15_000)
        page.wait_for_selector("#events tr.event[data-kind=skip]", timeout=15_000)
        assert page.locator("#suspect-devices tr.suspect-device td").first.text_content() == device
        assert page.locator("#suspect-samples tr.suspect-sample td").first.text_content() == str(BAD_SAMPLE)
        details = page.locator("#events tr.event[data-kind=skip] td").all_text_contents()
        assert any("began in backward in embed (Linear)" in text for text in details), details
        assert any("samples " in text for text in details), details
        assert any("began on another rank" in text for text in details), details
        assert any("before: it " in text for text in details), details  # a streak's first skip: the batches before
        ARTIFACTS.mkdir(exist_ok=True)
        # docs/images/status-page-diagnosis.png: the suspects and, right below, the run's skips with their answers.
        top = page.locator("#suspects").bounding_box()["y"]
        page.screenshot(path=str(ARTIFACTS / "status-page-diagnosis.png"),
                        clip={"x": 0, "y": top, "width": page.viewport_size["width"], "height": 1000}, full_page=True)
    assert problems == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_settling_scale_and_a_whole_job_overflow_accuse_no_device_and_no_sample(tmp_path):
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        url = collector.url
        _run(url, "settling", "calibration", tmp_path / "settling", "--epochs", "8", "--whole-job-at", "14,26")
        assert wait_until(lambda: _closed(url, "settling"))
        skips = _skips(url, "settling")
        assert any(e["calibration"] for e in skips)  # the scale came down from 2**127 on every rank
        # Two whole-job overflows, 24 of the 48 samples in them: some are in both, on two devices.
        whole = [e for e in skips if e["iteration"] in (14, 26)]
        assert len(whole) == 2 * RANKS and all(e["origin"] for e in whole) and not any(e["calibration"] for e in whole)
        both = {(i, e["rank"]) for e in whole for i in e["samples"]["ids"]}
        assert any(len({rank for i, rank in both if i == sample}) >= 2 for sample, _ in both)
        suspects = _get(url, "/v1/suspects")
        assert (suspects["devices"], suspects["samples"]) == ([], []), suspects
