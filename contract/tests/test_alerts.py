"""The alert definitions: complete against the thresholds, with texts that fill in."""

from __future__ import annotations

import dataclasses
import re

import pytest

from ampwatch.contract.alerts import ALERT_NAMES, ALERTS, DEFAULT_RUNBOOK_BASE_URL, SPEAKERS, Severity, speakers_of
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS, DEMO_THRESHOLDS, AlertThresholds

FIELDS = {"run": "exp-1", "rank": "3", "optimizer": "gen", "host": "node-7", "local_rank": "3", "device": "GPU-1",
          "value": "7", "percent": "50%", "duration": "2m 5s"}


# Thresholds judged before any alert, by the agent (a spike) or by the collector (a gradient outlier): no alert's
# condition reads them; the texts of the alerts that report what they judged name them.
JUDGED_UPSTREAM = {"spike_window_iterations", "spike_sigma", "outlier_sigma", "outlier_rank_share",
                   "outlier_after_iterations"}


def test_every_threshold_is_read_by_some_alert_and_every_alert_reads_only_real_thresholds():
    known = {field.name for field in dataclasses.fields(AlertThresholds)}
    read = {field for definition in ALERTS.values() for field in definition.thresholds_read}
    assert read == known - JUDGED_UPSTREAM
    named = {field for d in ALERTS.values() for field in re.findall(r"\{(\w+)\}", d.summary + d.description)}
    assert JUDGED_UPSTREAM <= named, f"name each in the texts of an alert that reports it: {JUDGED_UPSTREAM - named}"


def test_names_are_unique_and_each_alert_has_a_known_scope_and_severity():
    assert len(set(ALERT_NAMES)) == len(ALERT_NAMES) == len(ALERTS)
    for definition in ALERTS.values():
        assert definition.scope in ("run", "rank", "optimizer", "host")
        assert definition.severities and {s.level for s in definition.severities} <= {"warning", "critical"}


@pytest.mark.parametrize("t", [DEFAULT_THRESHOLDS, DEMO_THRESHOLDS], ids=["default", "demo"])
@pytest.mark.parametrize("name", ALERT_NAMES)
def test_every_text_fills_in_with_the_thresholds_and_the_evaluators_fields(name, t):
    definition = ALERTS[name]
    for severity in definition.severities:
        texts = definition.annotations(t, FIELDS, severity.level)
        assert "{" not in texts["summary"] + texts["description"], texts
        assert texts["runbook_url"] == f"{DEFAULT_RUNBOOK_BASE_URL}#{name.lower()}"
        if severity.threshold:
            assert str(getattr(t, severity.threshold)) in texts["summary"]


def test_thresholds_show_in_the_texts_as_durations_and_short_numbers():
    texts = ALERTS["AmpSustainedLossScaleBackoff"].annotations(
        dataclasses.replace(DEFAULT_THRESHOLDS, backoff_window_s=600, backoff_min_count=5), FIELDS)
    assert "at least 5 times in the last 10m" in texts["description"]
    texts = ALERTS["AmpLossScaleCollapsed"].annotations(DEFAULT_THRESHOLDS, FIELDS)
    assert texts["summary"] == "The loss scale collapsed below 1, or is NaN or infinite"


def test_the_for_window_is_read_from_the_thresholds():
    t = dataclasses.replace(DEFAULT_THRESHOLDS, desync_for_s=42)
    assert ALERTS["AmpLossScaleDesync"].for_seconds(t) == 42
    assert ALERTS["AmpPoisonedStep"].for_seconds(t) == 0


def test_each_whole_job_trouble_has_one_run_wide_alert_with_the_per_rank_ones_severities():
    assert SPEAKERS == {"AmpConsecutiveSkippedSteps": "AmpRunSkipStorm",
                        "AmpLossScaleCollapsed": "AmpRunLossScaleCollapsed",
                        "AmpHighSkippedStepRatio": "AmpRunHighSkippedStepRatio",
                        "AmpLossSpike": "AmpRunLossSpike", "AmpGradNormSpike": "AmpRunGradNormSpike"}
    for spoken, speaker in SPEAKERS.items():
        assert ALERTS[spoken].scope in ("rank", "optimizer") and ALERTS[speaker].scope == "run"
        assert ALERTS[speaker].severities == ALERTS[spoken].severities
    # Its condition is the per-rank one's, counted across the run: never one of its own.
    for wrong in (dict(scope="rank"), dict(window="skip_streak_window_s", rises=("streaks_reached",))):
        with pytest.raises(ValueError, match="speaks for a per-rank one is of scope run and reads no counters"):
            dataclasses.replace(ALERTS["AmpRunSkipStorm"], **wrong)


def _with(*changed) -> dict:
    """The alert definitions with ``changed`` ones swapped in (by name)."""
    return {**ALERTS, **{d.name: d for d in changed}}


_STORM, _STREAK = ALERTS["AmpRunSkipStorm"], ALERTS["AmpConsecutiveSkippedSteps"]


def test_the_declared_run_wide_alerts_and_those_they_speak_for_pass_the_check():
    assert speakers_of(ALERTS) == SPEAKERS


@pytest.mark.parametrize("definitions, says", [
    # The run-wide alert's severities are not the per-rank one's: a level missing, another added, or a threshold
    # another than the one the ranks' alert holds at.
    (_with(dataclasses.replace(_STORM, severities=(Severity("critical", "skip_streak_critical"),))),
     "AmpRunSkipStorm speaks for AmpConsecutiveSkippedSteps, whose severities (warning at skip_streak_warning, "
     "critical at skip_streak_critical) are not its own (critical at skip_streak_critical)"),
    (_with(dataclasses.replace(_STREAK, severities=(Severity("warning", "skip_streak_warning"),))),
     "AmpRunSkipStorm speaks for AmpConsecutiveSkippedSteps, whose severities (warning at skip_streak_warning) are "
     "not its own"),
    (_with(dataclasses.replace(_STORM, severities=(Severity("warning", "skip_streak_critical"),
                                                   Severity("critical", "skip_streak_critical")))),
     "AmpRunSkipStorm speaks for AmpConsecutiveSkippedSteps, whose severities .* are not its own"),
    (_with(dataclasses.replace(ALERTS["AmpRunLossScaleCollapsed"], severities=(Severity("warning"),))),
     "AmpRunLossScaleCollapsed speaks for AmpLossScaleCollapsed, whose severities (critical) are not its own "
     "(warning)"),
    # What it speaks for is no per-rank alert, or no alert at all, or has a speaker already.
    (_with(dataclasses.replace(_STORM, speaks_for="AmpLossScaleDesync")),
     "AmpRunSkipStorm speaks for AmpLossScaleDesync, of scope run: it must be an alert of scope rank or optimizer"),
    (_with(dataclasses.replace(_STORM, speaks_for="AmpSkipStreak")),
     "AmpRunSkipStorm speaks for AmpSkipStreak, which is no alert"),
    (_with(dataclasses.replace(ALERTS["AmpRunHighSkippedStepRatio"], speaks_for="AmpConsecutiveSkippedSteps",
                               severities=_STREAK.severities)),
     "AmpRunHighSkippedStepRatio speaks for AmpConsecutiveSkippedSteps, as AmpRunSkipStorm does"),
], ids=["speaker-lacks-a-level", "spoken-lacks-a-level", "another-threshold", "another-level", "run-scope",
        "no-such-alert", "two-speakers"])
def test_a_run_wide_alert_that_cannot_speak_for_its_per_rank_alert_is_refused_naming_both(definitions, says):
    with pytest.raises(ValueError, match=re.escape(says).replace(re.escape(".*"), ".*")):
        speakers_of(definitions)
