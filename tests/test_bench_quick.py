"""Smoke tests of the benchmarks (``bench/``): each piece runs briefly against the real servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest
import torch

from ampwatch_support.exposition import value
from bench import _servers, scrape
from bench.overhead import Setup, _answers, _syncs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_pushgateway = pytest.mark.skipif(not os.path.exists(_servers.PUSHGATEWAY),
                                       reason="prometheus-pushgateway is not installed (.ci/run installs it)")


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@needs_pushgateway
@pytest.mark.timeout(60)
def test_load_generator_gets_answers_from_both_servers_and_accounts_for_every_slot():
    for kind in ("ampwatch", "pushgateway"):
        with _servers.server(kind) as srv:
            result = _servers.load(srv, ranks=32, seconds=2)
        assert result["failures"] == {} and result["unanswered"] == 0, result
        # 32 ranks x 2 slots: each answered, or skipped by a rank whose previous answer came a second late.
        assert result["answered"] + result["missed_slots"] == 64 and result["answered"] >= 32, result
        assert result["server_cpu_s"] > 0 and result["vmrss"] > 0, result


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_load_generator_counts_the_rank_updates_of_node_batches_and_makes_one_request_per_node():
    with _servers.collector() as srv:
        result = _servers.load(srv, ranks=32, seconds=2, target="ampwatch-node", per_node=8)
        text = urllib.request.urlopen(srv.url + "/metrics", timeout=10).read().decode()
    assert result["failures"] == {} and result["unanswered"] == 0, result
    # 4 nodes x 2 slots, 8 ranks each: each answered, or skipped by a node whose previous answer came late.
    assert result["answered"] + 8 * result["missed_slots"] == 64 and result["requests"] * 8 == result["answered"]
    assert value(text, "ampwatch_collector_batches_applied_total") == result["answered"]
    assert value(text, "ampwatch_collector_ingest_requests_total", code="200") == result["requests"]


@needs_pushgateway
@pytest.mark.timeout(60)
def test_pushgateway_is_given_exactly_the_series_the_collector_exposed():
    collector, exposition = scrape.level("ampwatch", 64, scrapes=1)
    peer, _ = scrape.level("pushgateway", 64, scrapes=1, exposition=exposition)
    names = {line.split("{")[0].split(" ")[0] for line in exposition.splitlines() if line and line[0] != "#"}
    assert len(names) > 10
    # Every collector sample is there, plus the Pushgateway's own push_time/push_failure_time per group.
    groups = len(scrape.pushgateway_groups(exposition))
    assert peer["samples"] >= collector["samples"] + 2 * groups, (peer, collector)
    assert collector["rss_kib_per_rank"] is not None


@pytest.mark.timeout(60)
def test_ampwatch_answers_right_per_optimizer_and_adds_no_sync_unlike_the_get_scale_recipe():
    bare, watched, recipe = (Setup(v, "mlp", False, collector=()) for v in ("bare", "ampwatch", "forum"))
    try:
        for s in (bare, watched, recipe):
            s.iterate(3)
        clean = _syncs(bare, 3)
        assert _syncs(watched, 3) == clean
        assert _syncs(recipe, 3) == clean + 2  # get_scale() before and after update() each read the scale
        checked = _answers(watched, 5)
        assert checked["storm_per_optimizer_right"] == 5 and checked["clean_false_alarms"] == 0
        recipe_checked = _answers(recipe, 5)
        assert recipe_checked["storm_flagged"] == 5 and recipe_checked["storm_per_optimizer_right"] == 0
    finally:
        for s in (bare, watched, recipe):
            s.close()


@pytest.mark.timeout(120)
def test_the_clip_loops_train_as_the_plain_ones_and_the_watched_ones_watch_the_loss_and_every_norm(monkeypatch):
    """bench.instructions' spike pairs: the bare and watched clip loops clip every optimizer's gradients (changing
    nothing) and step bit-identically to the plain loops; each watched loop holds the loss's and both norms' levels."""
    clipped = []
    clip = torch.nn.utils.clip_grad_norm_

    def counted(params, *args, **kwargs):
        clipped.append(len(list(params)))
        return clip(params, *args, **kwargs)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", counted)
    plain = {"bare_clip": "bare", "ampwatch_clip": "bare", "ampwatch_norm": "bare", "bf16_clip": "bf16",
             "bf16_ampwatch_clip": "bf16"}
    setups = {v: Setup(v, "mlp", False, collector=()) for v in [*plain, "bare", "bf16"]}
    try:
        for name, s in setups.items():
            clipped.clear()
            s.iterate(3)
            assert clipped == ([2, 4] * 3 if name.endswith("_clip") else []), name  # each optimizer's group
        for name, twin in plain.items():
            for a, b in zip(setups[name].model.parameters(), setups[twin].model.parameters(), strict=True):
                assert torch.equal(a, b), name
            if setups[name].watch is not None:
                state = setups[name].watch.snapshot()["state"]
                assert "loss" in state and state["delivery"]["agent_errors"] == 0, name
                assert all("grad_norm" in c for c in state["optimizers"].values()), (name, state["optimizers"])
    finally:
        for s in setups.values():
            s.close()


@pytest.mark.timeout(60)
def test_accelerate_misses_skips_of_fused_optimizers_and_updates_the_scale_per_optimizer():
    from bench.overhead import _updates_per_iter
    fused = Setup("accelerate", "mlp", True, collector=None)
    plain = Setup("accelerate", "mlp", False, collector=None)
    try:
        assert _answers(fused, 4)["storm_flagged"] == 0  # its step hook fires although the fused kernel skipped
        assert _answers(plain, 4)["storm_per_optimizer_right"] == 4
        assert _updates_per_iter(plain, 2) == 2.0
    finally:
        fused.close()
        plain.close()


@pytest.mark.timeout(60)
def test_the_hot_path_timer_runs_the_recorder_calls_of_a_real_attached_agent():
    from bench.overhead import agent_hot_path_us
    # A loose sanity bound only: the figure itself belongs to docs/benchmarks.md.
    assert 0 < agent_hot_path_us(repeats=1, n=200) < 1000


@pytest.mark.timeout(120)
def test_inspection_bench_times_the_scan_beside_gradscalers_check_and_a_storm_beside_the_bare_loop(monkeypatch):
    from bench import inspection, report
    for var in ("AMPWATCH_URL", "AMPWATCH_DISABLED", "AMPWATCH_SPOOL_DIR"):
        monkeypatch.delenv(var, raising=False)
    # skip_cost itself checks that every scan found exactly the planted non-finite gradients.
    cost = inspection.skip_cost(300, 16, rounds=1)
    for scenario, offending in (("one", 1), ("all", 300)):
        measured = cost["scenarios"][scenario]
        assert measured["offending"] == offending
        assert set(measured["variants"]) == {"gradscaler", "gradscaler_kernel", "names", "weights",
                                             "before_names", "before_streak_start"}
        assert measured["variants"]["gradscaler"]["ratio"] == 1.0
        assert all(v["ms"] > 0 for v in measured["variants"].values())
    st = inspection.storm("mlp-2opt", rounds=1, block=4, collector=None, tensors=40)
    assert (st["tensors"], st["optimizers"]) == (40, 2)
    # Six watched iterations (two of warm-up), the first optimizer skipping every other one.
    assert st["skips"] == 3 and 1 <= st["named_skips"] <= 3
    assert st["poisoned_steps"] == 0 and st["agent_errors"] == 0 and st["ratio"] > 0
    section = {"skip_cost": [cost], "storms": [st], "issue_before": {"storm_ratio": 2.55, "note": "quoted"}}
    page = "\n".join(report.inspection.section(section) + report.inspection.summary_rows(section))
    assert "300 x 16" in page and "GradScaler's own check" in page and "mlp-2opt" in page and "2.55x" in page


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quick_bench_measures_and_merge_replaces_only_the_sections_run_now_and_says_so(tmp_path):
    prefix = str(tmp_path / "bench")
    with open(os.path.join(ROOT, "docs", "benchmarks.json")) as f:
        earlier = json.load(f)
    earlier.pop("inspection", None)
    with open(prefix + ".json", "w") as f:
        json.dump(earlier, f)
    out = subprocess.run([sys.executable, "-m", "bench", "--quick", "--only", "footprint", "--merge", "--out", prefix],
                         cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stdout + out.stderr
    merged = json.loads(open(prefix + ".json").read())
    assert merged["scrape"] == earlier["scrape"] and merged["environment"] == earlier["environment"]
    assert merged["footprint"] != earlier["footprint"]
    fp = merged["footprint"]  # the quick run measured it: events stored, a plausible size each
    assert fp["long"]["events"] > fp["short"]["events"] > 0
    assert 100 < fp["bytes_per_event_on_disk"] < 5000
    assert set(merged["remeasured"]) == set(earlier.get("remeasured", {})) | {"footprint"}
    page = open(prefix + ".md").read()
    assert page.count("Re-measured by `python -m bench --quick --only footprint --merge") == 1
    assert "## 3. Scrape cost" in page and "## Summary" in page and "bytes per stored event" in page


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rule_eval_runs_both_rule_sets_over_full_30_minute_windows_and_they_fire_the_same_alerts():
    from bench.experiments import rule_eval
    result = rule_eval.measure(ranks=16, evaluations=3, before="a95d20e")  # raises if the alerts differ
    assert result["samples_per_series_in_30m"] >= 115  # a sample every 15 s over the whole window

    def others(firing: dict) -> dict:
        return {k: v for k, v in firing.items() if k.split(" ")[0] not in rule_eval._STORM_ALERTS}

    assert result["after"]["firing"] and others(result["after"]["firing"]) == others(result["before"]["firing"])
    # The whole-job storm: an alert per rank and optimizer before, one for the run now.
    assert result["before"]["firing"]["AmpConsecutiveSkippedSteps (warning)"] == 16 * 2
    assert result["after"]["firing"]["AmpRunSkipStorm (warning)"] == 1
    assert "AmpConsecutiveSkippedSteps (warning)" not in result["after"]["firing"]
    for side in ("before", "after"):
        assert result[side]["evaluations"] >= 3 and result[side]["group_median_s"] > 0  # a slow machine: more
        assert result[side]["rules"] == len(result[side]["per_rule_ms"])
    # The earlier dashboard drew a line per rank and optimizer; this one a run's spread and its top ranks.
    assert result["before"]["dashboard"]["max_series"] == 4 * 16
    assert result["after"]["dashboard"]["max_series"] < result["before"]["dashboard"]["max_series"]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_fleet_node_relay_transport_posts_one_request_per_node_and_answers_every_rank(tmp_path):
    out = tmp_path / "ranks.json"
    with _servers.collector() as srv:
        sim = subprocess.run([sys.executable, "-m", "bench.experiments._fleet_ranks", "--port", str(srv.port),
                              "--ranks", "32", "--delivery", "after", "--transport", "node-relay", "--heartbeat", "1",
                              "--warm", "2", "--healthy", "3", "--storm", "6", "--storm-share", "0.25",
                              "--iteration-s", "0.2", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert sim.returncode == 0, sim.stderr
        text = urllib.request.urlopen(srv.url + "/metrics", timeout=10).read().decode()
    result = json.loads(out.read_text())
    assert result["transport"] == "node-relay" and result["refused"] == {} and result["timeouts"] == 0, result
    applied = value(text, "ampwatch_collector_batches_applied_total")
    requests = value(text, "ampwatch_collector_ingest_requests_total", code="200")
    # Every rank's batch was applied and answered on its own, while 4 nodes made the requests.
    answered = sum(len(v) for v in result["latency"].values()) + 32  # + each rank's first contact
    assert applied >= answered and requests < applied / 2, (applied, requests, answered)
    # Counts stay exact: each storm rank's skips acknowledged last are the collector's count for it.
    assert any(storm["answers"][-1][1] > 0 for storm in result["storm"].values()), result["storm"]
    for rank, storm in result["storm"].items():
        assert value(text, "ampwatch_optimizer_skipped_steps_total", run="fleet", rank=rank,
                     optimizer="gen") == storm["answers"][-1][1], rank


def test_the_sample_recording_timer_runs_batch_and_a_followed_loader_beside_their_baselines():
    from torch.utils.data import dataloader

    from bench._samples_cost import sample_recording_us

    shipped = dataloader._BaseDataLoaderIter.__dict__["__next__"]
    result = sample_recording_us(rounds=2, n=20, batches=5)
    assert set(result["batch"]) == {"iteration", "batch(list of 32)", "batch(tensor of 32)"}
    assert set(result["loader"]) == {"plain", "another loader followed", "followed"}
    assert all(v["us"] > 0 for part in ("batch", "loader") for v in result[part].values())
    assert dataloader._BaseDataLoaderIter.__dict__["__next__"] is shipped  # the watch closed: nothing left
