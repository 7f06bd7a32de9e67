"""Parity: one scripted batch stream, two evaluators: the real Prometheus with the generated rules and the built-in one.

Both read the same thresholds (shortened to seconds): Prometheus gets the rules
``render_rules`` generates from them, the collector gets them as its
``--alert-thresholds`` file. Runs, each scripted to trip one or a few alerts (or
none), stream protocol v1 batches into one real collector for about 20 s; then
the alerts that fired (name, run, rank, optimizer, severity) must be the same on
both sides, every alert of them; those of the alerts scripted here equal to what each run
was scripted to trip, and nothing at all for p-clean. Every alert the contract declares is
tripped by some run (``EXPECTED``), or named in ``EXEMPT`` with the reason, or declares its
condition in a common form: both evaluators compile that one declaration, and
tests/test_condition_forms.py runs each form's table through both (parity by construction);
here its instances, wherever the runs trip it, must still be the same on both sides.
Edge cases ride along: a skip ratio exactly at its threshold, loss scales of NaN and 0.
Loss and gradient-norm spikes come on one rank (its own alert) and on every rank of a run (the
run-wide alert, speaking for theirs); a rank's own gradient norm far from its run's others' makes
the collector judge a gradient outlier, which both evaluators alert on.
Runs skip together on every rank (a short storm, one whose scale collapses and whose
skip ratio climbs, one that ends in the storm, one whose ranks close mid-streak but
one), so each evaluator fires one run-level alert per trouble there (AmpRunSkipStorm,
AmpRunLossScaleCollapsed, AmpRunHighSkippedStepRatio) and never a per-rank alert
they speak for, not even at the storms' edges, where a scrape or a pass lands between
two ranks' batches, nor after ranks closed; the collector's webhook must never hear
RESOLVED for an alert it was not told fired.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from ampwatch.contract.alerts import ALERT_NAMES, ALERTS
from ampwatch.contract.protocol import NO_SCALER_KIND
from ampwatch.contract.thresholds import AlertThresholds
from ampwatch.dashboards.rules import render_rules
from ampwatch.server._floats import wire_float
from ampwatch_support.batches import make_batch, optimizer, post_batch, samples, skip_event, spike_event
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.prometheus_stack import (
    Processes,
    get,
    query_range,
    start_prometheus,
    wait_for_scrapes,
    wait_until,
)
from ampwatch_support.webhook_receiver import WebhookReceiver, free_port

# skip_ratio is exactly p-ratio's share of skipped steps (every other one): both evaluators must fire at the
# boundary, as the rule's >= says. Its skipped and stepped counters rise alike, so Prometheus's increase()
# gives equal values whatever it extrapolates, and x / (x + x) is exactly 0.5 in floating point.
THRESHOLDS = AlertThresholds(
    calibration_iterations=0, skip_streak_warning=4, skip_streak_critical=16, skip_streak_window_s=6,
    backoff_window_s=6, backoff_min_count=3, backoff_for_s=1, collapsed_for_s=1, desync_for_s=2,
    skip_ratio=0.5, skip_ratio_window_s=10, skip_ratio_for_s=1, skip_ratio_min_steps=20,
    silent_after_s=4, silent_for_s=1, scheduler_window_s=6, poisoned_window_s=6, origin_window_s=6,
    conflict_window_s=6, storm_edge_for_s=3,  # three of Prometheus's 1 s evaluations
    spike_window_s=6, outlier_window_s=6,
)
BATCHES = 40  # one every 0.5 s per rank
PERIOD_S = 0.5
ITERATIONS_PER_BATCH = 2
_NO_SKIPS: Iterator[bool] = iter(())  # the default schedule of skips: none
TROUBLE = range(10, 13)  # the batches in which scripted trouble happens
JOB_TROUBLE = range(10, 24)  # p-job skips on every rank, then its scale is restored from a checkpoint

# What each run was scripted to trip: (alert, run, rank, optimizer, severity); "" where a label is absent.
EXPECTED = {
    # Both ranks of p-streak skip 6 in a row together: one run alert, not one per rank.
    ("AmpRunSkipStorm", "p-streak", "", "", "warning"),
    ("AmpSustainedLossScaleBackoff", "p-streak", "", "", "warning"),
    # Rank 1 of three skips the same 6 alone: it stands out, with its own streak alert (once the storm's edge wait
    # is over), and its scale, backed off 6 times, is apart from the others'.
    ("AmpConsecutiveSkippedSteps", "p-one", "1", "gen", "warning"),
    ("AmpLossScaleDesync", "p-one", "", "", "warning"),
    # Every rank of p-job skips every step for JOB_TROUBLE: its streak passes both severities, its scale collapses
    # below 1 (and stays, longer than collapsed_for_s) and its skip ratio climbs, as a whole-job storm does. One
    # run alert for each speaks for every rank's streak, collapse and skip ratio.
    ("AmpRunSkipStorm", "p-job", "", "", "warning"),
    ("AmpRunSkipStorm", "p-job", "", "", "critical"),
    ("AmpRunLossScaleCollapsed", "p-job", "", "", "critical"),
    ("AmpRunHighSkippedStepRatio", "p-job", "", "", "warning"),
    ("AmpSustainedLossScaleBackoff", "p-job", "", "", "warning"),
    ("AmpHighSkippedStepRatio", "p-ratio", "0", "gen", "warning"),
    ("AmpSustainedLossScaleBackoff", "p-ratio", "", "", "warning"),
    ("AmpLossScaleCollapsed", "p-collapse", "0", "", "critical"),
    ("AmpLossScaleCollapsed", "p-nan", "0", "", "critical"),
    ("AmpLossScaleCollapsed", "p-zero", "1", "", "critical"),
    ("AmpLossScaleDesync", "p-zero", "", "", "warning"),
    ("AmpLossScaleDesync", "p-desync", "", "", "warning"),
    ("AmpSchedulerStepsOnSkipped", "p-sched", "0", "gen", "warning"),
    ("AmpPoisonedStep", "p-poison", "0", "gen", "critical"),
    ("AmpRankSilent", "p-silent", "0", "", "warning"),
    ("AmpSkipOriginRank", "p-origin", "2", "", "warning"),
    ("AmpPoisonedStep", "p-bf16", "1", "gen", "critical"),  # and no scale alert: two of its ranks have no scaler
    # Every rank of p-end closes in its streak, the moment it reaches the warning (4): closed ranks count in the
    # storm's share as their streak alerts do, so it stays one run alert, and no rank fires its own. No rank open
    # ever backed off 3 times: no sustained backoff.
    ("AmpRunSkipStorm", "p-end", "", "", "warning"),
    # Ranks 0 and 1 of p-close close the same way; rank 2 skips one batch more, then trains on: one run alert; its
    # backoffs, the only open rank's, are sustained backoff.
    ("AmpRunSkipStorm", "p-close", "", "", "warning"),
    ("AmpSustainedLossScaleBackoff", "p-close", "", "", "warning"),
    # A second process (its own host, pid and process key) claims p-conflict's rank 0 while the first keeps sending.
    ("AmpRankConflict", "p-conflict", "0", "", "warning"),
    # Rank 1 of p-suspect (on its own host) is the sole origin of three skips, each on other samples: the collector
    # suspects its device, and the rank, still training, alerts with it.
    ("AmpSuspectDevice", "p-suspect", "1", "", "warning"),
    # Rank 1 of p-loss gets a bad batch: its own loss spike. Every rank of p-loss-job spikes together: one run alert.
    ("AmpLossSpike", "p-loss", "1", "", "warning"),
    ("AmpRunLossSpike", "p-loss-job", "", "", "warning"),
    # Optimizer gen of rank 0 of p-norm spikes alone; the all-reduced norm of every rank of p-norm-job together.
    ("AmpGradNormSpike", "p-norm", "0", "gen", "warning"),
    ("AmpRunGradNormSpike", "p-norm-job", "", "", "warning"),
    # Rank 2 of p-outlier sends a spike of its own gradient norm (local, before DDP's all-reduce) far above the other
    # ranks' levels: the collector judges it an outlier, both evaluators alert on its count.
    ("AmpRankGradientOutlier", "p-outlier", "2", "", "warning"),
}
# Alerts no run here trips, each with the reason it cannot (none today: every declared alert has its run).
EXEMPT: dict[str, str] = {}
# Alerts whose condition the contract declares in a common form (their parity holds by construction): a run here
# for one is welcome, not required.
DECLARED = frozenset(name for name, d in ALERTS.items() if d.condition is not None)
NO_SCALER = {"enabled": False, "kind": NO_SCALER_KIND, "init_scale": None, "growth_factor": None,
             "backoff_factor": None, "growth_interval": None}


class ScriptedRank:
    """One rank's cumulative counters, advanced batch by batch as a real agent would report them."""

    def __init__(self, run: str, rank: int, world_size: int, scale: float | None = 2.0 ** 16,
                 iteration: int = 0, **identity: str | int) -> None:
        self.run, self.rank, self.world_size = run, rank, world_size
        # The process's identity (incarnation, host, pid, process_key), where not the batches' default.
        self.identity = {"incarnation": f"parity-{run}-{rank}", **identity}
        self.closed = False
        self.seq, self.iteration, self.scale = 0, iteration, scale  # scale None: a rank without a GradScaler
        self.backoffs = 0
        self.opts = {name: optimizer() for name in ("gen", "disc")}
        self.origins: int | None = None  # state.origin_iterations, sent when set (an agent watching DDP)
        self.loss_spikes: int | None = None  # state.loss_spikes, sent when set (an agent that sees the loss)

    def close(self, skip_gen: Iterator[bool] = _NO_SKIPS) -> dict:
        """Return the last batch of a rank that closed cleanly (``skip_gen``: as :meth:`step`)."""
        batch = self.step(skip_gen)
        batch["closed"] = self.closed = True
        return batch

    def step(self, skip_gen: Iterator[bool] = _NO_SKIPS, **gen_extra: int) -> dict:
        """Advance ITERATIONS_PER_BATCH iterations (``skip_gen`` says which skip ``gen``) and return the batch."""
        for _ in range(ITERATIONS_PER_BATCH):
            self.iteration += 1
            skipped = next(skip_gen, False)
            for name, o in self.opts.items():
                if name == "gen" and skipped:
                    o["skipped"] += 1
                    o["consecutive_skipped"] += 1
                    o["longest_streak"] = max(o["longest_streak"], o["consecutive_skipped"])
                    if o["consecutive_skipped"] == 1:
                        o["streaks"] += 1
                    if o["consecutive_skipped"] & (o["consecutive_skipped"] - 1) == 0:  # a power of two: on the ladder
                        key = str(o["consecutive_skipped"])
                        o["streaks_reached"][key] = o["streaks_reached"].get(key, 0) + 1
                else:
                    o["steps"] += 1
                    o["consecutive_skipped"] = 0
            if skipped:  # a skip backs the scale off once per update, as GradScaler does
                self.backoffs += 1
                self.scale /= 2
        for key, value in gen_extra.items():  # a counter the agent sends only once it moved may be absent yet
            self.opts["gen"][key] = self.opts["gen"].get(key, 0) + value
        self.seq += 1
        batch = make_batch(run=self.run, rank=self.rank, world_size=self.world_size, local_rank=self.rank,
                          seq=self.seq, **self.identity, sent_at=time.time(),
                          iteration=self.iteration, backoffs=self.backoffs,
                          loss_scale=None if self.scale is None else wire_float(self.scale),
                          optimizers={k: dict(v, streaks_reached=dict(v["streaks_reached"]))
                                      for k, v in self.opts.items()})
        if self.scale is None:
            batch["scaler"] = dict(NO_SCALER)
        if self.origins is not None:
            batch["state"]["origin_iterations"] = self.origins
        if self.loss_spikes is not None:
            batch["state"]["loss_spikes"] = self.loss_spikes
        return batch


_post = functools.partial(post_batch, timeout=5)


def _stream(url: str) -> None:
    """Send every run's batches, PERIOD_S apart, for BATCHES periods."""
    ranks = {
        "p-clean": [ScriptedRank("p-clean", r, 2) for r in (0, 1)],
        "p-streak": [ScriptedRank("p-streak", r, 2) for r in (0, 1)],
        "p-one": [ScriptedRank("p-one", r, 3) for r in range(3)],
        # Started high: half its updates back off, yet it must not collapse (below 1) within the test.
        "p-ratio": [ScriptedRank("p-ratio", 0, 1, scale=2.0 ** 64)],
        # Joined late with its scale already collapsed (its backoffs happened before the collector saw it).
        "p-collapse": [ScriptedRank("p-collapse", 0, 1, scale=0.5, iteration=500)],
        # Scales a float32 GradScaler can reach: NaN (sent as the protocol's "NaN" string), and 0.0 after
        # ~166 backoffs in a row, beside a healthy rank (max / min is +Inf: out of sync too).
        "p-nan": [ScriptedRank("p-nan", 0, 1, scale=float("nan"), iteration=500)],
        "p-zero": [ScriptedRank("p-zero", 0, 2, iteration=500), ScriptedRank("p-zero", 1, 2, scale=0.0, iteration=500)],
        "p-desync": [ScriptedRank("p-desync", 0, 2), ScriptedRank("p-desync", 1, 2, scale=2.0 ** 14)],
        "p-sched": [ScriptedRank("p-sched", 0, 1)],
        "p-poison": [ScriptedRank("p-poison", 0, 1)],
        "p-silent": [ScriptedRank("p-silent", 0, 1)],
        # Rank 2 of 4 starts three iterations' inf/NaN (its skips, spread to every rank, are left out here so
        # that only this alert is in play).
        "p-origin": [ScriptedRank("p-origin", r, 4) for r in range(4)],
        # Two bf16 ranks without a GradScaler beside one with a scaler: no scale of theirs may look collapsed
        # (a 0 or NaN) or apart from the scaler's (a 1.0 beside 2**16); rank 1's poisoned step alone fires.
        "p-bf16": [ScriptedRank("p-bf16", 0, 3, scale=None), ScriptedRank("p-bf16", 1, 3, scale=None),
                   ScriptedRank("p-bf16", 2, 3)],
        "p-job": [ScriptedRank("p-job", r, 3) for r in range(3)],
        "p-end": [ScriptedRank("p-end", r, 3) for r in range(3)],
        "p-close": [ScriptedRank("p-close", r, 3) for r in range(3)],
        "p-conflict": [ScriptedRank("p-conflict", 0, 1, process_key="parity-conflict-key-of-the-first")],
        "p-suspect": [ScriptedRank("p-suspect", r, 2, host="node-suspect") for r in (0, 1)],
        "p-loss": [ScriptedRank("p-loss", r, 3) for r in range(3)],
        "p-loss-job": [ScriptedRank("p-loss-job", r, 3) for r in range(3)],
        "p-norm": [ScriptedRank("p-norm", r, 3) for r in range(3)],
        "p-norm-job": [ScriptedRank("p-norm-job", r, 3) for r in range(3)],
        "p-outlier": [ScriptedRank("p-outlier", r, 4) for r in range(4)],
    }
    claimant = ScriptedRank("p-conflict", 0, 1, iteration=2 * ITERATIONS_PER_BATCH * TROUBLE.start,
                            incarnation="parity-p-conflict-0-claimant", host="node-b", pid=5151,
                            process_key="parity-conflict-key-of-the-second")
    for rank in ranks["p-origin"]:
        rank.origins = 0
    for rank in ranks["p-loss"] + ranks["p-loss-job"]:
        rank.loss_spikes = 0
    for rank in ranks["p-outlier"]:  # each rank's own gradient norm's level (ddp=), a little apart from the others'
        rank.opts["gen"]["local_grad_norm"] = {"mean": 1.0 + rank.rank / 100, "std": 0.05}
    for batch in range(BATCHES):
        started = time.monotonic()
        trouble = batch in TROUBLE
        if trouble:
            ranks["p-origin"][2].origins += 1
        for rank in (ranks["p-origin"] + ranks["p-clean"] + ranks["p-desync"] + ranks["p-collapse"] + ranks["p-nan"]
                     + ranks["p-zero"]):
            _post(url, rank.step())
        for rank in ranks["p-streak"]:  # 6 skips in a row: a streak over the warning threshold (4), 6 backoffs
            _post(url, rank.step(iter([trouble] * ITERATIONS_PER_BATCH)))
        for rank in ranks["p-one"]:
            _post(url, rank.step(iter([trouble and rank.rank == 1] * ITERATIONS_PER_BATCH)))
        # p-end and p-close skip from TROUBLE's first batch; at its second, each rank's streak reaches 4 and every
        # rank of p-end, and ranks 0 and 1 of p-close, close; p-close's rank 2 skips one batch more.
        for rank in ranks["p-end"] + ranks["p-close"]:
            if rank.closed:
                continue
            skipping = iter([batch in TROUBLE] * ITERATIONS_PER_BATCH)
            closing = batch == TROUBLE.start + 1 and (rank.run == "p-end" or rank.rank < 2)
            _post(url, rank.close(skipping) if closing else rank.step(skipping))
        _post(url, ranks["p-conflict"][0].step())
        if batch == TROUBLE.start:  # the claimant's one batch: the first process sends again at the next
            _post(url, claimant.step())
        for rank in ranks["p-job"]:
            if batch == JOB_TROUBLE.stop:
                rank.scale = 2.0 ** 16  # restored from a checkpoint
            _post(url, rank.step(iter([batch in JOB_TROUBLE] * ITERATIONS_PER_BATCH)))
        # Every other iteration skips: half the steps (exactly skip_ratio), never two in a row.
        _post(url, ranks["p-ratio"][0].step(iter([True, False])))
        first = batch == TROUBLE.start
        _post(url, ranks["p-sched"][0].step(iter([first]), scheduler_steps_after_skip=int(first)))
        _post(url, ranks["p-poison"][0].step(poisoned_steps=int(first)))
        for rank in ranks["p-bf16"]:
            _post(url, rank.step(poisoned_steps=int(first and rank.rank == 1)))
        if batch < 8:  # then it goes quiet without closing
            _post(url, ranks["p-silent"][0].step())
        for rank in ranks["p-suspect"]:  # the skips alone: no streak, no backoff alert in play
            sent = rank.step()
            if trouble:
                sent["events"] = [skip_event(batch, iteration=rank.iteration, origin=rank.rank == 1,
                                             samples=samples([f"{batch}-{rank.rank}-{i}" for i in range(4)]))]
            _post(url, sent)
        for rank in ranks["p-loss"] + ranks["p-loss-job"]:
            rank.loss_spikes = (rank.loss_spikes or 0) + int(first and (rank.run == "p-loss-job" or rank.rank == 1))
            _post(url, rank.step())
        for rank in ranks["p-norm"] + ranks["p-norm-job"]:
            _post(url, rank.step(grad_norm_spikes=int(first and (rank.run == "p-norm-job" or rank.rank == 0))))
        for rank in ranks["p-outlier"]:
            sent = rank.step()
            if first and rank.rank == 2:
                sent["events"] = [spike_event(batch, "grad_norm_spike", iteration=rank.iteration, value=50.0,
                                              mean=1.02, std=0.05, local=True)]
            _post(url, sent)
        time.sleep(max(0.0, PERIOD_S - (time.monotonic() - started)))
    for run, run_ranks in ranks.items():
        for rank in run_ranks:
            if run != "p-silent" and not rank.closed:  # the others close cleanly: only p-silent is silent
                _post(url, rank.close())


def _fired_in_prometheus(prometheus: str, start: float) -> set[tuple]:
    series = query_range(prometheus, 'ALERTS{alertstate="firing"}', start)
    return {(s["metric"]["alertname"], s["metric"].get("run", ""), s["metric"].get("rank", ""),
             s["metric"].get("optimizer", ""), s["metric"].get("severity", "")) for s in series}


def _fired_built_in(collector: str) -> set[tuple]:
    alerts = json.loads(get(collector + "/v1/alerts"))
    return {(a["name"], a["labels"].get("run", ""), a["labels"].get("rank", ""), a["labels"].get("optimizer", ""),
             a["labels"].get("severity", "")) for a in alerts["firing"] + alerts["resolved"]}


def test_every_alert_the_contract_declares_has_a_parity_run_or_a_named_exemption():
    tripped = {name for name, *_ in EXPECTED}
    missing = set(ALERT_NAMES) - tripped - set(EXEMPT) - DECLARED
    extra = (tripped | set(EXEMPT)) - set(ALERT_NAMES)
    assert not missing and not extra, (f"missing: {sorted(missing)} (add a run that trips each, name it in EXEMPT "
                                       "with the reason, or declare its condition in a common form); extra: "
                                       f"{sorted(extra)} (no such alert in the contract)")
    assert not tripped & set(EXEMPT), f"exempt, yet tripped here: {sorted(tripped & set(EXEMPT))}"
    assert all(EXEMPT.values()), "each exemption says why"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_prometheus_rules_and_built_in_alerts_fire_the_same_alerts_for_the_same_run_rank_and_optimizer(
        tmp_path: Path):
    (tmp_path / "thresholds.json").write_text(json.dumps(dataclasses.asdict(THRESHOLDS)))
    processes = Processes(tmp_path)
    receiver = WebhookReceiver().start()
    collector = CollectorProcess(str(tmp_path / "ampwatch.db"),
                                 args=["--alert-thresholds", str(tmp_path / "thresholds.json"),
                                       "--webhook", f"webhook:{receiver.url}/hook", "--notify-group-wait", "1",
                                       "--notify-group-interval", "1"])
    try:
        collector.start()
        prometheus = start_prometheus(processes, tmp_path, free_port(), render_rules(THRESHOLDS),
                                      [f"127.0.0.1:{collector.port}"])
        # Let Prometheus scrape the empty collector once, so every run's series is born inside the test.
        wait_for_scrapes(processes, prometheus)
        start = time.time()
        _stream(collector.url)
        # Prometheus lags by a scrape and an evaluation; the silent rank needs silent_after_s + for. Generous: on a
        # loaded machine (load 8) the built-in pass once took past 20 s to hold every run-wide alert.
        wait_until(lambda: _fired_in_prometheus(prometheus, start) >= EXPECTED
                   and _fired_built_in(collector.url) >= EXPECTED, 60,
                   lambda: f"both evaluators to fire everything scripted:\n  expected   {sorted(EXPECTED)}\n"
                           f"  prometheus {sorted(_fired_in_prometheus(prometheus, start))}\n"
                           f"  built-in   {sorted(_fired_built_in(collector.url))}")
        # Every rank closed: the storms resolve in both (the per-rank alerts they spoke for never fired).
        storms = 'ALERTS{alertname="AmpRunSkipStorm",alertstate="firing"}'
        wait_until(lambda: not _storms_firing(prometheus, storms) and not _storms_firing_built_in(collector.url),
                   30, lambda: "both evaluators to resolve the storms")
        in_prometheus = _fired_in_prometheus(prometheus, start)
        built_in = _fired_built_in(collector.url)
        run_storms = sum(1 for name, *_ in EXPECTED if name == "AmpRunSkipStorm")
        hook = receiver.wait_for(lambda reqs: _announced(reqs, "AmpRunSkipStorm", "resolved") >= run_storms, 30)
    finally:
        processes.stop_all()
        collector.kill()
        receiver.stop()
    assert built_in == in_prometheus, (f"only built-in: {sorted(built_in - in_prometheus)}; "
                                       f"only Prometheus: {sorted(in_prometheus - built_in)}")
    scripted = {name for name, *_ in EXPECTED}
    assert {fired for fired in built_in if fired[0] in scripted} == EXPECTED
    assert not [fired for fired in built_in if fired[1] == "p-clean"]
    # The webhook heard each RESOLVED only for an alert it had been told was firing.
    told: set[str] = set()
    for request in hook:
        for alert in request["body"]["alerts"]:
            if alert["status"] == "firing":
                told.add(alert["fingerprint"])
            else:
                assert alert["fingerprint"] in told, f"RESOLVED never announced: {alert['labels']}"


def _storms_firing(prometheus: str, expr: str) -> list:
    answer = json.loads(get(f"{prometheus}/api/v1/query?query={urllib.parse.quote(expr)}"))
    return answer["data"]["result"]


def _storms_firing_built_in(collector: str) -> list:
    return [a for a in json.loads(get(collector + "/v1/alerts"))["firing"] if a["name"] == "AmpRunSkipStorm"]


def _announced(requests: list, name: str, status: str) -> int:
    return sum(1 for r in requests for a in r["body"]["alerts"]
               if a["labels"]["alertname"] == name and a["status"] == status)
