"""The condition forms a common alert declares: what a definition takes from its form, and what it refuses."""

from __future__ import annotations

import dataclasses
import re

import pytest

from ampwatch.contract.alerts import ALERTS, AlertDefinition, Severity, check_hand_written, hand_written
from ampwatch.contract.conditions import Outside, Rose, RoseBy, Share


def _alert(condition, scope: str = "optimizer", **changed) -> AlertDefinition:
    return AlertDefinition(**{**dict(name="AmpTest", scope=scope, severities=(Severity("warning"),), for_field=None,
                                     summary="s {run}", description="d {value}", condition=condition), **changed})


_RATIO = Share(part="skipped", rest="steps", whole="step_calls", window="skip_ratio_window_s", at_least="skip_ratio",
               min_count="skip_ratio_min_steps")

# form -> (scope, window, counts, rises, context, parameters): what the definition reads follows from its form.
DERIVED = [
    (Rose("poisoned_steps", window="poisoned_window_s"), "optimizer",
     ("poisoned_window_s", (), ("poisoned_steps",), (), ())),
    (Rose("conflicts", window="conflict_window_s"), "rank", ("conflict_window_s", (), ("conflicts",), (), ())),
    (RoseBy("backoffs", window="backoff_window_s", at_least="backoff_min_count"), "rank",
     ("backoff_window_s", ("backoffs",), (), (), ("backoff_min_count",))),
    (_RATIO, "optimizer",
     ("skip_ratio_window_s", ("skipped", "steps"), (), ("steps",), ("skip_ratio", "skip_ratio_min_steps"))),
    (Outside("loss_scale", low="collapsed_loss_scale"), "rank", (None, (), (), (), ("collapsed_loss_scale",))),
    (Outside("loss_scale", low="collapsed_loss_scale", high="desync_scale_ratio"), "rank",
     (None, (), (), (), ("collapsed_loss_scale", "desync_scale_ratio"))),
]


@pytest.mark.parametrize("condition, scope, reads", DERIVED, ids=lambda v: type(v).__name__ if v else "")
def test_a_definition_takes_its_window_counters_and_parameters_from_its_condition(condition, scope, reads):
    d = _alert(condition, scope)
    assert (d.window, d.counts, d.rises, d.context, d.parameters) == reads
    assert set(d.thresholds_read) == {*filter(None, (reads[0],)), *reads[4]}
    assert dataclasses.replace(d) == d  # a copy passes the fields it took back: they agree


def test_the_declared_common_alerts_read_what_they_read_before_their_conditions_were_declared():
    # The definitions as they were written by hand before the forms: the forms must derive the same.
    before = {"AmpLossScaleCollapsed": (None, (), (), (), ("collapsed_loss_scale",)),
              "AmpHighSkippedStepRatio": ("skip_ratio_window_s", ("skipped", "steps"), (), ("steps",),
                                          ("skip_ratio", "skip_ratio_min_steps")),
              "AmpSchedulerStepsOnSkipped": ("scheduler_window_s", (), ("scheduler_steps_after_skip",), (), ()),
              "AmpPoisonedStep": ("poisoned_window_s", (), ("poisoned_steps",), (), ()),
              "AmpRankConflict": ("conflict_window_s", (), ("conflicts",), (), ())}
    for name, reads in before.items():
        d = ALERTS[name]
        assert d.condition is not None and (d.window, d.counts, d.rises, d.context, d.parameters) == reads, name


@pytest.mark.parametrize("make, says", [
    (lambda: _alert(Rose("poisoned", window="poisoned_window_s")),
     "'poisoned' is not a counter of ampwatch.contract.counters.COUNTERS"),
    (lambda: _alert(Rose("streaks_reached", window="skip_streak_window_s")),
     "'streaks_reached' counts per rung of the streak ladder: no condition form reads it"),
    (lambda: _alert(Share(part="skipped", rest="backoffs", whole="x", window="skip_ratio_window_s",
                          at_least="skip_ratio", min_count="skip_ratio_min_steps")),
     "skipped, backoffs are not all counters of a rank, or all of an optimizer"),
    (lambda: _alert(Outside("scale", low="collapsed_loss_scale"), "rank"),
     "'scale' is not a gauge of ampwatch.contract.counters.GAUGES"),
    (lambda: _alert(Outside("consecutive_skipped", low="collapsed_loss_scale")),
     "'consecutive_skipped' is a gauge of each optimizer: Outside judges a rank's"),
    (lambda: _alert(Rose("conflicts", window="conflict_window_s"), "optimizer"),
     "its condition reads values of each rank, so its scope is rank, not optimizer"),
    (lambda: _alert(Rose("poisoned_steps", window="poisoned_window"), "optimizer"),
     "'poisoned_window' is not a field of AlertThresholds"),
    (lambda: _alert(Rose("poisoned_steps", window="poisoned_window_s"), rises=("scheduler_steps_after_skip",)),
     "leave rises out, it follows from its condition (('poisoned_steps',)); it declares "
     "('scheduler_steps_after_skip',)"),
    (lambda: _alert(Rose("poisoned_steps", window="poisoned_window_s"),
                    severities=(Severity("warning", "skip_streak_warning"), Severity("critical"))),
     "an alert with a condition has one severity, without a threshold of its own"),
    (lambda: _alert(Rose("poisoned_steps", window="poisoned_window_s"), speaks_for="AmpPoisonedStep"),
     "an alert with a condition neither speaks for another nor names gauges"),
], ids=["unknown-counter", "ladder-counter", "mixed-counters", "unknown-gauge", "optimizer-gauge", "wrong-scope",
        "unknown-threshold", "declared-twice", "two-severities", "speaks-for"])
def test_a_condition_that_reads_what_the_contract_lacks_or_disagrees_with_its_definition_is_refused(make, says):
    with pytest.raises(ValueError, match="alert AmpTest: " + re.escape(says)):
        make()


def test_the_hand_written_conditions_must_be_exactly_the_bespoke_alerts_and_the_error_names_each_one_off():
    bespoke = hand_written(ALERTS)
    assert bespoke == {name for name, d in ALERTS.items() if d.condition is None and not d.speaks_for}
    check_hand_written("here", bespoke, ALERTS)  # exactly those: nothing to say
    with pytest.raises(RuntimeError, match=re.escape("here must hold") + ".*" + re.escape(
            "missing: ['AmpRankSilent'], extra: [AmpNoSuchAlert (no such alert), AmpPoisonedStep (its condition is "
            "declared), AmpRunSkipStorm (it speaks for another)]")):
        check_hand_written("here", bespoke - {"AmpRankSilent"} | {"AmpNoSuchAlert", "AmpPoisonedStep",
                                                                  "AmpRunSkipStorm"}, ALERTS)
    with pytest.raises(RuntimeError, match=re.escape("missing: [], extra: [AmpNoSuchAlert (no such alert)]")):
        check_hand_written("here", bespoke | {"AmpNoSuchAlert"}, ALERTS)
