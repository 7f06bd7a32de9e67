"""The generated Prometheus rules: in sync with the code, valid in Prometheus and vmalert, and unit-tested with
promtool."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from ampwatch.contract.alerts import ALERT_NAMES, ALERTS, SPEAKERS
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS, PROFILES, AlertThresholds
from ampwatch.dashboards.generate import (
    NEW_SERIES_DELAY_S,
    RULES_FILE,
    VMALERT_EVALUATION_S,
    VMALERT_RULES_FILE,
    for_vmalert,
    stale_files,
)
from ampwatch.dashboards.rules import RecordedSeries, render_rules, rule_groups

REPO = Path(__file__).resolve().parents[2]
GENERATED = REPO / "dashboards" / "generated"
RULE_TESTS = Path(__file__).resolve().parent / "rules"
RULE_TEST_FILES = sorted(RULE_TESTS.glob("*.test.yaml"))


def _rules() -> list[dict]:
    return [rule for group in rule_groups()["groups"] for rule in group["rules"]]


def _alerts() -> list[dict]:
    return [rule for rule in _rules() if "alert" in rule]


def test_the_committed_generated_files_match_the_code():
    assert stale_files(GENERATED) == [], "run `ampwatch-dashboards generate` and commit dashboards/generated/"


def test_promtool_check_rules_accepts_the_generated_rules(run_tool):
    result = run_tool("promtool", "check", "rules", str(GENERATED / RULES_FILE), cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


@pytest.mark.parametrize("rules", [RULES_FILE, VMALERT_RULES_FILE, "demo"])
def test_vmalert_loads_the_generated_rules_unchanged(rules, run_tool, tmp_path):
    # vmalert's dry run parses every expression with the MetricsQL engine, every template, and refuses a rule
    # field it does not know (keep_firing_for, in the Debian vmalert 1.79): the file Prometheus loads, as is.
    path = GENERATED / rules
    if rules == "demo":
        path = tmp_path / RULES_FILE
        path.write_text(render_rules(PROFILES["demo"]))
    result = run_tool("vmalert", f"-rule={path}", "-dryRun", "-loggerLevel=ERROR", cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_vmalert_rules_differ_only_in_how_long_the_held_back_per_rank_alerts_wait():
    # vmalert reads back the recordings it writes, each level of them up to an evaluation and a new series'
    # delay later: the per-rank alerts a run-wide one holds back wait out the chain (docs/central-store.md).
    prometheus, vmalert = (yaml.safe_load((GENERATED / f).read_text())["groups"][0]["rules"]
                           for f in (RULES_FILE, VMALERT_RULES_FILE))
    waits = 5 * (VMALERT_EVALUATION_S + NEW_SERIES_DELAY_S)
    assert for_vmalert(DEFAULT_THRESHOLDS) == dataclasses.replace(DEFAULT_THRESHOLDS, storm_edge_for_s=waits)
    assert len(prometheus) == len(vmalert)
    for ours, theirs in zip(prometheus, vmalert, strict=True):
        assert {k: v for k, v in ours.items() if k != "for"} == {k: v for k, v in theirs.items() if k != "for"}
        if ours.get("alert") in SPEAKERS:  # held back: at least the chain's wait, its own for when longer
            assert _seconds(theirs["for"]) == max(_seconds(ours["for"]), waits), ours["alert"]
        else:
            assert ours.get("for") == theirs.get("for")


def _seconds(duration: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([smh])", duration).groups()
    return int(number) * {"s": 1, "m": 60, "h": 3600}[unit]


@pytest.mark.parametrize("test_file", RULE_TEST_FILES, ids=lambda p: p.name)
def test_promtool_unit_tests_pass(test_file, run_tool):
    result = run_tool("promtool", "test", "rules", str(test_file), cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test_that_fires_and_one_that_stays_silent():
    fires, silent = set(), set()
    for test_file in RULE_TEST_FILES:
        for case in yaml.safe_load(test_file.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    assert set(ALERT_NAMES) <= fires, f"no firing case for {sorted(set(ALERT_NAMES) - fires)}"
    assert set(ALERT_NAMES) <= silent, f"no silent case for {sorted(set(ALERT_NAMES) - silent)}"


def test_the_rule_unit_tests_load_the_committed_generated_rules():
    for test_file in RULE_TEST_FILES:
        rule_files = yaml.safe_load(test_file.read_text())["rule_files"]
        assert [(test_file.parent / f).resolve() for f in rule_files] == [GENERATED / RULES_FILE]


def test_every_alert_has_for_severity_summary_description_and_runbook_url():
    alerts = _alerts()
    assert sorted({a["alert"] for a in alerts}) == sorted(ALERT_NAMES)
    for alert in alerts:
        assert re.fullmatch(r"\d+[smh]", alert["for"]), alert
        assert alert["labels"]["severity"] in {"warning", "critical"}
        assert set(alert["annotations"]) == {"summary", "description", "runbook_url"}
        assert alert["annotations"]["runbook_url"].endswith("#" + alert["alert"].lower())


def test_descriptions_name_the_run_rank_optimizer_and_value_the_alert_carries():
    for alert in _alerts():
        description, name = alert["annotations"]["description"], alert["alert"]
        assert "{{ $labels.run }}" in description and "$value" in description, name
        for label in ("rank", "optimizer"):  # the description names what the alert is about, no more
            assert ("{{ $labels." + label + " }}" in description) == (label in ALERTS[name].labels), name


def _changed(field: str) -> AlertThresholds:
    """The default thresholds with ``field`` at another valid value, far from its default: thirty times it, else
    half, else one more (a new field needs nothing here). Far, so that a wait passes any other it is compared with
    (``storm_edge_for_s``, 30 s, with a per-rank alert's own ``for``, up to 10 min)."""
    default = getattr(DEFAULT_THRESHOLDS, field)
    whole = isinstance(default, int)
    for value in (default * 30, default // 2 if whole else default / 2, default + 1):
        try:
            changed = dataclasses.replace(DEFAULT_THRESHOLDS, **{field: value})
        except ValueError:  # outside its limits (a rung off the ladder, a share above 1, ...)
            continue
        if value != default:
            return changed
    raise AssertionError(f"no other valid value for {field} near its default {default!r}: give one here")


def _alert_and_its_recordings(t: AlertThresholds, name: str) -> list[tuple]:
    """The expressions and ``for`` of alert ``name``'s rules (and of the per-rank alert it speaks for, whose rules
    hold back on it) and of every recording rule they read (not the texts)."""
    rules = rule_groups(t)["groups"][0]["rules"]
    recorded = {rule["record"]: rule for rule in rules if "record" in rule}
    found = [rule for rule in rules if rule.get("alert") in (name, ALERTS[name].speaks_for)]
    pending = [rule["expr"] for rule in found]
    while pending:
        expr = pending.pop()
        for record, rule in recorded.items():
            if record in expr and rule not in found:
                found.append(rule)
                pending.append(rule["expr"])
    return [(rule["expr"], rule.get("for")) for rule in found]


@pytest.mark.parametrize("name", ALERT_NAMES)
def test_each_alert_rule_changes_with_every_threshold_its_definition_says_it_reads(name):
    definition = ALERTS[name]
    read = definition.thresholds_read
    before = _alert_and_its_recordings(DEFAULT_THRESHOLDS, name)
    for field in read:
        after = _alert_and_its_recordings(_changed(field), name)
        assert after != before, f"{name}'s rule does not change with {field}"


def test_consecutive_skips_have_a_warning_and_a_critical_rule_on_the_streak_ladder():
    streak = [a for a in _alerts() if a["alert"] == "AmpConsecutiveSkippedSteps"]
    assert [a["labels"]["severity"] for a in streak] == ["warning", "critical"]
    recorded = RecordedSeries(DEFAULT_THRESHOLDS)
    for alert, threshold in zip(streak, (DEFAULT_THRESHOLDS.skip_streak_warning,
                                         DEFAULT_THRESHOLDS.skip_streak_critical), strict=True):
        assert f'{recorded.streaks_rose}{{min_length="{threshold}"}}' in alert["expr"]
        assert f"{recorded.in_streak} >= {threshold}" in alert["expr"]


def test_changing_a_threshold_changes_the_ladder_series_and_windows_the_rules_read():
    text = render_rules(AlertThresholds(skip_streak_warning=8, skip_streak_critical=32, skip_streak_window_s=120))
    assert 'ampwatch_optimizer_skip_streaks_total{min_length=~"8|32"} offset 2m' in text
    assert 'min_length="16"' not in text


def test_rules_never_read_a_collectors_run_level_convenience_series():
    assert "ampwatch_run_" not in (GENERATED / RULES_FILE).read_text()


def test_every_collector_metric_the_rules_read_is_in_the_metrics_contract():
    contract = set(re.findall(r"`(ampwatch_[a-z_]+)`", (REPO / "docs" / "metrics.md").read_text()))
    recorded = {rule["record"] for rule in _rules() if "record" in rule}
    used = set(re.findall(r"(?<![:\w])(ampwatch_[a-z_]+)", (GENERATED / RULES_FILE).read_text()))
    used -= {name.split(":")[1] for name in recorded}  # the metric part of a recorded name
    assert used and used <= contract, sorted(used - contract)


def test_recording_rules_are_named_level_metric_operation():
    for rule in _rules():
        if "record" in rule:
            level, metric, operation = rule["record"].split(":")
            assert re.fullmatch(r"run(_rank)?(_optimizer)?", level), rule["record"]
            assert metric.startswith("ampwatch_") and re.fullmatch(r"[a-z0-9_]+", operation), rule["record"]
    assert RecordedSeries(DEFAULT_THRESHOLDS).backoffs == "run_rank:ampwatch_loss_scale_backoffs:increase15m"


def test_every_runbook_url_points_at_a_section_of_docs_alerts_md():
    headings = re.findall(r"^#+ (.+)$", (REPO / "docs" / "alerts.md").read_text(), flags=re.M)
    anchors = {re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-") for h in headings}
    for alert in _alerts():
        assert alert["annotations"]["runbook_url"].rsplit("#", 1)[1] in anchors, alert["alert"]


def _run_tests_against(run_tool, tmp_path: Path, rules_text: str, test_file: Path):
    (tmp_path / "rules.yaml").write_text(rules_text)
    case = yaml.safe_load(test_file.read_text())
    case["rule_files"] = ["rules.yaml"]
    (tmp_path / test_file.name).write_text(yaml.safe_dump(case, sort_keys=False))
    return run_tool("promtool", "test", "rules", str(tmp_path / test_file.name), cwd=tmp_path)


def test_the_unit_tests_catch_rules_that_count_calibration_backoffs(tmp_path, run_tool):
    result = _run_tests_against(run_tool, tmp_path, render_rules(AlertThresholds(calibration_iterations=0)),
                                RULE_TESTS / "sustained_loss_scale_backoff.test.yaml")
    assert result.returncode != 0
    assert "early calibration backoffs at start-up stay silent" in result.stdout + result.stderr


def test_the_unit_tests_catch_rules_that_miss_streaks_between_scrapes(tmp_path, run_tool):
    # Record no streak counter, leaving only the gauge branch: what a naive "consecutive >= N" rule would see.
    naive = render_rules().replace('ampwatch_optimizer_skip_streaks_total{min_length=~"16|64"} > 0', "vector(0) > 1",
                                   1)
    assert naive != render_rules()
    result = _run_tests_against(run_tool, tmp_path, naive, RULE_TESTS / "consecutive_skipped_steps.test.yaml")
    assert result.returncode != 0
    assert "a streak that began and ended between two scrapes fires" in result.stdout + result.stderr


def test_the_unit_tests_catch_rules_that_show_a_storms_edges_rank_by_rank(tmp_path, run_tool):
    # No wait on the per-rank streak alert: a scrape between the ranks' batches shows them for an evaluation.
    edgy = render_rules(dataclasses.replace(DEFAULT_THRESHOLDS, storm_edge_for_s=0))
    result = _run_tests_against(run_tool, tmp_path, edgy, RULE_TESTS / "run_skip_storm.test.yaml")
    assert result.returncode != 0
    assert "a storm whose edges straddle a scrape shows no per-rank alert" in result.stdout + result.stderr


def test_the_unit_tests_catch_rules_that_count_only_open_ranks_in_a_storms_share(tmp_path, run_tool):
    # The share over the run's open ranks instead of all its ranks: a job that ends in a storm would lose it (no
    # open rank left) and a few ranks in a streak beside finished ones would make one.
    r = RecordedSeries(DEFAULT_THRESHOLDS)
    open_only = render_rules().replace(f"group_left {r.ranks}\n", f"group_left {r.ranks_open}\n")
    assert open_only.count(r.ranks_open) == render_rules().count(r.ranks_open) + len(SPEAKERS)  # a share per speaker
    result = _run_tests_against(run_tool, tmp_path, open_only, RULE_TESTS / "run_skip_storm.test.yaml")
    assert result.returncode != 0
    for case in ("a job that ends in a storm stays one run alert after its ranks closed",
                 "healthy ranks that closed count in the share and two of five in a streak keep their own alerts"):
        assert case in result.stdout + result.stderr


def test_the_alert_table_of_the_runbooks_lists_every_alert_in_order():
    page = "docs/alerts.md"  # the one alert table: the README links it
    text = (REPO / page).read_text()
    table = text[text.index("| alert |"):]
    table = table[:table.index("\n\n")]
    listed = re.findall(r"^\| `(Amp\w+)` \|", table, flags=re.M)
    assert listed == list(ALERT_NAMES), f"{page}'s alert table must list each alert of ampwatch.contract.alerts once"
