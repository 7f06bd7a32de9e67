"""Loss-scale values a float32 GradScaler can hold (0, subnormal, NaN, infinities) and the `restored` transition.

None of them may make the collector refuse a batch: they are states to report and alert on, exactly
when a rank is in trouble. JSON has no NaN or infinity: the protocol writes them as the strings
"NaN", "Infinity" and "-Infinity"; old agents sent null, which stays valid.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess

import pytest
from fastapi.testclient import TestClient

from ampwatch.server import create_app
from ampwatch_support.batches import DUPLICATE, make_batch
from ampwatch_support.exposition import value

SUBNORMAL = 2.0 ** -149  # the smallest float32 above 0, as torch reads it back as a Python float
# (name, what the agent sends, the value it stands for, how /metrics writes it, how the JSON API gives it back)
SCALES = [
    ("zero", 0.0, 0.0, "0.0", 0.0),
    ("subnormal", SUBNORMAL, SUBNORMAL, repr(SUBNORMAL), SUBNORMAL),
    ("negative", -4.0, -4.0, "-4.0", -4.0),
    ("nan", "NaN", math.nan, "NaN", "NaN"),
    ("inf", "Infinity", math.inf, "+Inf", "Infinity"),
    ("minus-inf", "-Infinity", -math.inf, "-Inf", "-Infinity"),
]


def _metric_line(text: str, name: str, run: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(name + "{") and f'run="{run}"' in line)


def _promtool_check(text: str) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: install the Debian package 'prometheus' (.ci/run does)"
    result = subprocess.run([promtool, "check", "metrics"], input=text, text=True, capture_output=True, timeout=60)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr


def test_every_value_a_scaler_can_hold_is_applied_exposed_and_given_back_as_sent(client):
    for name, sent, _, _, _ in SCALES:
        batch = make_batch(run=f"scale-{name}", loss_scale=sent, events=[
            {"id": 1, "kind": "scale_change", "time": 1.0, "iteration": 7, "cause": "backoff",
             "before": 1.0, "after": sent}])
        batch["scaler"]["init_scale"] = sent
        answer = client.post("/v1/ingest", content=json.dumps(batch, allow_nan=False),
                             headers={"Content-Type": "application/json"})
        assert answer.status_code == 200, answer.text
    text = client.get("/metrics").text
    _promtool_check(text)
    for name, _, _, exposed, given_back in SCALES:
        run = f"scale-{name}"
        assert _metric_line(text, "ampwatch_loss_scale", run).split()[-1] == exposed
        assert _metric_line(text, "ampwatch_run_loss_scale_min", run).split()[-1] == exposed
        rank = client.get(f"/v1/runs/{run}").json()["ranks"][0]
        assert rank["loss_scale"] == given_back and rank["scaler"]["init_scale"] == given_back
        event = client.get(f"/v1/runs/{run}/events").json()["events"][0]
        assert (event["before"], event["after"]) == (1.0, given_back)


def test_python_json_tokens_and_the_null_of_old_agents_are_accepted_too(client):
    # json.dumps writes NaN/Infinity tokens (not JSON, but what a Python client sends by default).
    tokens = json.dumps(make_batch(run="tokens", loss_scale=math.nan, events=[
        {"id": 1, "kind": "scale_change", "time": 1.0, "iteration": 1, "cause": "growth",
         "before": math.inf, "after": -math.inf}]))
    assert "NaN" in tokens and client.post("/v1/ingest", content=tokens,
                                           headers={"Content-Type": "application/json"}).status_code == 200
    event = client.get("/v1/runs/tokens/events").json()["events"][0]
    assert (event["before"], event["after"]) == ("Infinity", "-Infinity")
    # Agents before this protocol text sent non-finite floats as null.
    old = make_batch(run="old-agent", loss_scale=None, events=[
        {"id": 1, "kind": "scale_change", "time": 1.0, "iteration": 1, "cause": "backoff", "before": None,
         "after": None}])
    old["scaler"]["init_scale"] = None
    assert client.post("/v1/ingest", json=old).status_code == 200
    assert value(client.get("/metrics").text, "ampwatch_loss_scale", run="old-agent", rank="0") is None


@pytest.mark.parametrize("bad", ["nan", "inf", "1.5", "", "Inf"])
def test_other_strings_for_a_scale_are_refused_naming_the_accepted_ones(client, bad):
    answer = client.post("/v1/ingest", json=make_batch(loss_scale=bad))
    assert answer.status_code == 422
    assert any('"NaN", "Infinity", "-Infinity"' in line and line.startswith("state.loss_scale")
               for line in answer.json()["detail"]), answer.json()


@pytest.mark.parametrize("field", ["sent_at", "time"])
def test_non_finite_times_are_still_refused(client, field):
    batch = make_batch(events=[{"id": 1, "kind": "close", "time": 1.0, "iteration": 0}])
    (batch["events"][0] if field == "time" else batch)[field] = "NaN"
    assert client.post("/v1/ingest", json=batch).status_code == 422


def test_non_finite_scales_survive_a_collector_restart(config_for):
    config = config_for()
    batch = make_batch(run="restart", loss_scale="NaN", events=[
        {"id": 1, "kind": "scale_change", "time": 1.0, "iteration": 3, "cause": "growth", "before": 2.0 ** 127,
         "after": "Infinity"}])
    with TestClient(create_app(config)) as client:
        assert client.post("/v1/ingest", json=batch).status_code == 200
        # An event-free batch is stored as sent, one with events re-serialised: both must read back.
        assert client.post("/v1/ingest", json=make_batch(run="restart", seq=2, loss_scale="Infinity")) \
            .status_code == 200
    with TestClient(create_app(config)) as client:
        text = client.get("/metrics").text
        assert _metric_line(text, "ampwatch_loss_scale", "restart").split()[-1] == "+Inf"
        assert client.get("/v1/runs/restart").json()["ranks"][0]["loss_scale"] == "Infinity"
        assert client.get("/v1/runs/restart/events").json()["events"][0]["after"] == "Infinity"


def test_a_nan_scale_fires_the_built_in_collapse_alert_and_the_alerts_api_stays_json(client):
    assert client.post("/v1/ingest", json=make_batch(run="collapsed", loss_scale="NaN")).status_code == 200
    service = client.app.state.alert_service
    service.tick(client.app.state.collector_state, now=10 ** 10)  # long after the alert's for: duration
    answer = client.get("/v1/alerts")
    assert answer.status_code == 200
    firing = [a for a in answer.json()["firing"] if a["name"] == "AmpLossScaleCollapsed"]
    assert [(a["labels"]["run"], a["value"]) for a in firing] == [("collapsed", "NaN")]
    assert " is NaN, " in firing[0]["annotations"]["description"]


def test_a_restored_scale_is_its_own_transition_and_the_latest_scaler_settings_are_kept(config_for):
    config = config_for()
    first = make_batch(run="resume", seq=1, iteration=10, loss_scale=65536.0, backoffs=2)
    # The job loaded a checkpoint (scaler.load_state_dict) or bound a new scaler: the scale and the settings
    # change outside update(). The agent reports a `restored` transition, never a backoff or a growth.
    restored = make_batch(run="resume", seq=2, iteration=11, loss_scale=1024.0, backoffs=2, events=[
        {"id": 1, "kind": "scale_change", "time": 2.0, "iteration": 10, "cause": "restored",
         "before": 65536.0, "after": 1024.0}])
    restored["scaler"].update(init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=100)
    with TestClient(create_app(config)) as client:
        assert client.post("/v1/ingest", json=first).status_code == 200
        assert client.post("/v1/ingest", json=restored).status_code == 200
        # A late retry of the first batch must not bring the old settings back.
        assert client.post("/v1/ingest", json=first).json() == DUPLICATE
        answers = [client.get("/v1/runs/resume").json()]
    with TestClient(create_app(config)) as client:  # and after a collector restart
        answers.append(client.get("/v1/runs/resume").json())
        events = client.get("/v1/runs/resume/events", params={"kind": "scale_change"}).json()["events"]
        text = client.get("/metrics").text
    for run in answers:
        rank = run["ranks"][0]
        assert rank["scaler"] == {"enabled": True, "kind": "GradScaler", "init_scale": 1024.0, "growth_factor": 4.0,
                                  "backoff_factor": 0.25, "growth_interval": 100}
        assert (rank["loss_scale"], rank["backoffs"], rank["growths"], rank["manual_sets"]) == (1024.0, 2, 0, 0)
    assert [(e["cause"], e["before"], e["after"], e["iteration"]) for e in events] == \
        [("restored", 65536.0, 1024.0, 10)]
    assert value(text, "ampwatch_loss_scale", run="resume", rank="0") == 1024.0
    assert value(text, "ampwatch_loss_scale_backoffs_total", run="resume", rank="0") == 2
    assert value(text, "ampwatch_loss_scale_growths_total", run="resume", rank="0") == 0
