"""--alert-thresholds: a profile or a JSON file changes the built-in alerts; a bad one is refused with the fix."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS
from ampwatch.server import create_app
from ampwatch.server.alerting.thresholds import load_thresholds
from ampwatch_support.batches import make_batch, optimizer
from ampwatch_support.ports import free_port


def _streak_of(length: int) -> dict:
    reached = {str(2 ** i): 1 for i in range(11) if 2 ** i <= length}
    return {"gen": optimizer(steps=300, skipped=length, consecutive=length, longest=length, streaks=1,
                             reached=reached)}


def test_without_a_setting_the_built_in_alerts_use_the_thresholds_the_rules_are_generated_from():
    assert load_thresholds(None) is DEFAULT_THRESHOLDS
    assert load_thresholds("") is DEFAULT_THRESHOLDS
    assert load_thresholds("default") is DEFAULT_THRESHOLDS


def test_a_json_file_overrides_only_the_fields_it_names(tmp_path):
    path = tmp_path / "thresholds.json"
    path.write_text(json.dumps({"skip_streak_warning": 8, "skip_streak_window_s": 30}))
    loaded = load_thresholds(str(path))
    assert loaded == dataclasses.replace(DEFAULT_THRESHOLDS, skip_streak_warning=8, skip_streak_window_s=30)


def test_thresholds_written_as_json_load_back_equal(tmp_path):
    demo = load_thresholds("demo")
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(dataclasses.asdict(demo)))  # every field, as a user's file may hold them
    assert load_thresholds(str(path)) == demo != DEFAULT_THRESHOLDS


@pytest.mark.parametrize("content, message", [
    ('{"skip_streak_warning": 5}', "skip_streak_warning=5 is not on the collector's streak ladder"),
    ('{"skip_streek_warning": 8}', r"unknown field\(s\) skip_streek_warning; the fields are"),
    ('{"backoff_window_s": "5m"}', "backoff_window_s='5m' must be a number"),
    ("[8]", "must hold one JSON object"),
    ("{oops", "cannot read it as JSON"),
])
def test_a_bad_thresholds_file_is_refused_naming_the_option_and_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "thresholds.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="--alert-thresholds / AMPWATCH_SERVER_ALERT_THRESHOLDS=.*" + message):
        load_thresholds(str(path))


def test_the_command_line_refuses_a_missing_thresholds_file_before_serving(tmp_path):
    result = subprocess.run([sys.executable, "-m", "ampwatch.server", "--db", str(tmp_path / "a.db"),
                             "--alert-thresholds", str(tmp_path / "missing.json")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "no such file" in result.stderr and "default, demo" in result.stderr


@pytest.mark.parametrize("content, message", [
    ('{"storm_rank_share": 0}', "storm_rank_share=0 must be in (0, 1]"),
    ('{"storm_rank_share": 1.5}', "storm_rank_share=1.5 must be in (0, 1]"),
    ('{"backoff_rank_share": 0.0}', "backoff_rank_share=0.0 must be in (0, 1]"),
    ('{"collapsed_loss_scale": NaN}', "collapsed_loss_scale=nan must be > 0 and finite"),  # JSON as Python reads it
    ('{"skip_streak_warning": 16.0}', "skip_streak_warning=16.0 must be a whole number"),
    ('{"origin_window_s": -1}', "origin_window_s=-1 must be > 0 seconds"),
])
def test_a_collector_started_with_a_threshold_outside_its_limits_exits_naming_the_field(tmp_path, content, message):
    path = tmp_path / "thresholds.json"
    path.write_text(content)
    # (A port of its own: a collector that took the file would serve there until the timeout.)
    result = subprocess.run([sys.executable, "-m", "ampwatch.server", "--db", str(tmp_path / "a.db"),
                             "--port", str(free_port()), "--alert-thresholds", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    # One line, before serving: the option, the file, the field and what it must be.
    assert result.stderr == f"ampwatch-server: --alert-thresholds / AMPWATCH_SERVER_ALERT_THRESHOLDS={str(path)!r}: " \
                            f"{message}\n"


def test_the_demo_profile_fires_the_streak_alert_at_four_skips_where_the_default_needs_sixteen(config_for):
    for profile, fires_at in (("demo", 4), (None, 16)):
        with TestClient(create_app(config_for(alert_thresholds=load_thresholds(profile)))) as client:
            run = f"streak-{profile}"
            for seq, length in enumerate((fires_at - 1, fires_at), start=1):
                batch = make_batch(run=run, seq=seq, iteration=300 + length, optimizers=_streak_of(length))
                assert client.post("/v1/ingest", json=batch).status_code == 200
                firing = [a for a in client.get("/v1/alerts").json()["firing"] if a["labels"]["run"] == run]
                assert len(firing) == (length == fires_at), (profile, length, firing)


def test_with_seconds_long_windows_a_streak_alert_resolves_one_window_after_the_streak_not_later():
    from ampwatch.server._state import RankSnapshot
    from ampwatch.server._totals import OptimizerTotals, ladder
    from ampwatch.server.alerting.evaluator import BuiltinAlerts

    demo = load_thresholds("demo")
    alerts = BuiltinAlerts(demo)
    resolved_at = None
    for tick in range(0, 100):  # a batch every 0.25 s for 25 s; a 4-skip streak at t = 10 s
        now = tick * 0.25
        reached = {1: 1, 2: 1, 4: 1} if now >= 10 else {}
        snapshot = RankSnapshot(run="r", rank=0, last_seen=now, iteration=100 + tick,
                                optimizers={"gen": OptimizerTotals(steps=tick, skipped=4 * (now >= 10),
                                                                   streaks_reached=ladder(reached))})
        for change in alerts.observe(snapshot, now=now):
            if change.status == "resolved":
                resolved_at = now
    # The ladder counter rose at t = 10; it leaves the window at 10 + window (+ one batch, + a tenth of the window).
    assert resolved_at is not None
    assert demo.skip_streak_window_s + 10 <= resolved_at <= demo.skip_streak_window_s * 1.1 + 10.25, resolved_at
