"""When batches go: news soon and coalesced, the cumulative state once per heartbeat (a clock passed in)."""

from __future__ import annotations

import doctest
import random
from itertools import pairwise

import pytest

from ampwatch.agent import _schedule
from ampwatch.agent._schedule import (
    NEWS_GAP,
    NEWS_HOLD,
    NEWS_SPREAD,
    RANKS_PER_SECOND,
    PushSchedule,
    default_heartbeat,
    is_news,
)
from ampwatch.contract.protocol import (
    EVENT_KINDS,
    HEARTBEAT_INTERVAL_S,
    KEEP_ALIVE_S,
    MAX_HEARTBEAT_INTERVAL_S,
    NEWS_WITHIN_S,
)
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS


def test_the_examples_in_the_docstrings_hold():
    assert doctest.testmod(_schedule).failed == 0


def test_the_first_batch_goes_at_once_then_one_per_heartbeat_when_nothing_happens():
    schedule = PushSchedule(heartbeat=15.0)
    schedule.begin(0.0)
    assert schedule.due() == 0.0
    built = []
    for now in (k / 100 for k in range(6000)):  # a clock stepping every 10 ms for 60 s, building when due
        if now >= schedule.due():
            schedule.built(now)
            built.append(now)
    assert built == [0.0, 15.0, 30.0, 45.0]


def test_news_after_a_quiet_spell_goes_after_the_hold_and_news_within_the_gap_waits_for_its_end():
    schedule = PushSchedule(heartbeat=15.0)
    schedule.begin(100.0)
    schedule.built(100.0)
    schedule.news(107.0)
    assert schedule.due() == pytest.approx(107.0 + NEWS_HOLD)
    schedule.built(107.05)
    schedule.news(107.3)  # soon after: it waits for the gap, and everything until then shares one batch
    schedule.news(107.9)
    assert schedule.due() == pytest.approx(107.05 + NEWS_GAP)
    schedule.built(108.05)
    assert schedule.due() == 130.0  # on the grid (100 + k * 15); 115 is left out, 7 s after a batch


def test_a_heartbeat_right_after_a_news_batch_is_left_out():
    schedule = PushSchedule(heartbeat=15.0)
    schedule.begin(0.0)
    schedule.built(0.0)
    schedule.news(14.0)
    schedule.built(14.05)
    assert schedule.due() == 30.0  # not 15: a batch went 1 s before it


def test_batches_never_come_closer_than_the_gap_nor_further_apart_than_one_and_a_half_heartbeats():
    rng = random.Random(18)
    schedule = PushSchedule(heartbeat=15.0, ranks=4096, rng=rng)
    schedule.begin(0.0)
    built = []
    for now in (k / 100 for k in range(60_000)):  # 10 minutes of random news, in 10 ms steps
        if rng.random() < 0.002:
            schedule.news(now)
        if now >= schedule.due():
            schedule.built(now)
            built.append(now)
    gaps = [b - a for a, b in pairwise(built)]
    assert min(gaps) >= NEWS_GAP - 1e-9 and max(gaps) <= 1.5 * 15.0 + 0.01
    assert 600 / 15.0 <= len(built) <= 600 / NEWS_GAP


def test_a_big_jobs_ranks_spread_their_first_batches_and_their_news_a_small_jobs_do_not():
    big = [PushSchedule(heartbeat=15.0, ranks=16384, rng=random.Random(seed)) for seed in range(2000)]
    first = sorted(s.first_delay for s in big)
    news = sorted(s.news_delay for s in big)
    spread = 16383 / RANKS_PER_SECOND  # about 33 s: about 500 first batches per second
    assert first[0] < 0.1 and spread - 0.1 < first[-1] <= spread
    assert NEWS_HOLD <= news[0] < NEWS_HOLD + 0.01  # some ranks' news goes at once,
    assert NEWS_HOLD + NEWS_SPREAD - 0.01 < news[-1] <= NEWS_HOLD + NEWS_SPREAD < NEWS_WITHIN_S  # the last within 2 s
    # A lockstep skip of 1,024 ranks: their news over 1.5 s, not one second (about 680 batches a second).
    job = sorted(PushSchedule(heartbeat=15.0, ranks=1024, rng=random.Random(seed)).news_delay for seed in range(1024))
    assert max(sum(1 for d in job if t <= d < t + 1.0) for t in job) < 0.75 * 1024
    small = [PushSchedule(heartbeat=15.0, ranks=2, rng=random.Random(seed)) for seed in range(100)]
    assert max(s.first_delay for s in small) <= 1 / RANKS_PER_SECOND
    assert max(s.news_delay for s in small) <= NEWS_HOLD + 1 / RANKS_PER_SECOND


def test_a_storm_of_news_makes_at_most_one_batch_per_gap():
    schedule = PushSchedule(heartbeat=15.0)
    schedule.begin(0.0)
    schedule.built(0.0)
    built = 0
    for now in (k / 100 for k in range(3000)):  # news every 10 ms for 30 s
        schedule.news(now)
        if now >= schedule.due():
            schedule.built(now)
            built += 1
    assert 30.0 / NEWS_GAP - 1 <= built <= 30.0 / NEWS_GAP


def test_a_push_interval_shorter_than_the_gap_sends_news_as_often_as_state():
    schedule = PushSchedule(heartbeat=0.05)
    schedule.begin(10.0)
    schedule.built(10.0)
    schedule.news(10.01)
    assert schedule.due() == pytest.approx(10.05)


def test_the_defaults_keep_the_first_skip_of_a_streak_within_two_seconds_and_state_within_a_scrape():
    assert NEWS_GAP < NEWS_WITHIN_S  # worst case: news just after a batch waits out the gap (hold and spread within it)
    assert HEARTBEAT_INTERVAL_S <= 30  # Prometheus scrapes every 15-30 s


CASES = [
    ({"kind": "skip", "streak": 1}, True),
    ({"kind": "skip", "streak": 2}, True),
    ({"kind": "skip", "streak": 16}, True),
    ({"kind": "skip", "streak": 3}, False),
    ({"kind": "skip", "streak": 17}, False),
    ({"kind": "streak_end", "length": 5}, True),
    ({"kind": "scale_change", "cause": "backoff"}, False),
    ({"kind": "scale_change", "cause": "growth"}, False),
    ({"kind": "scale_change", "cause": "manual"}, True),
    ({"kind": "scale_change", "cause": "restored"}, True),
    ({"kind": "poisoned_step"}, True),
    ({"kind": "warning", "code": "stepped_unknown_optimizer"}, True),
    ({"kind": "scheduler_after_skip"}, False),
    ({"kind": "scaler_disabled"}, True),
    ({"kind": "close"}, True),
    ({"kind": "loss_spike", "streak": 1}, True),  # sent at its rungs only, each one news (an alert)
    ({"kind": "grad_norm_spike", "streak": 2}, True),
    ({"kind": "grad_norm_spike", "streak": 1, "local": True}, True),  # the collector compares it across ranks
]


@pytest.mark.parametrize("event, news", CASES)
def test_news_is_what_changes_an_alert_or_the_operators_picture(event, news):
    assert is_news(event) is news


def test_every_event_kind_of_the_protocol_is_classified_above():
    assert {event["kind"] for event, _ in CASES} == set(EVENT_KINDS)  # a new kind must be decided on here


def test_the_default_heartbeat_is_15_s_until_a_job_would_ask_one_collector_for_more_than_500_a_second():
    assert default_heartbeat(1) == default_heartbeat(7_500) == HEARTBEAT_INTERVAL_S
    assert default_heartbeat(10_000) == pytest.approx(10_000 / RANKS_PER_SECOND)  # 20 s: 500 heartbeats/s
    assert default_heartbeat(16_384) == default_heartbeat(10 ** 6) == MAX_HEARTBEAT_INTERVAL_S


def test_the_longest_default_heartbeat_keeps_a_healthy_rank_far_from_silent_and_on_its_connection():
    longest_gap = 1.5 * MAX_HEARTBEAT_INTERVAL_S  # the schedule leaves at most 1.5 heartbeats between batches
    assert DEFAULT_THRESHOLDS.silent_after_s >= 4 * MAX_HEARTBEAT_INTERVAL_S  # docs/alerts.md's rule
    assert longest_gap < KEEP_ALIVE_S
    schedule = PushSchedule(heartbeat=default_heartbeat(10 ** 6), ranks=10 ** 6, rng=random.Random(1))
    schedule.begin(0.0)
    built, now = [], 0.0
    while now < 600.0:  # 10 minutes on a 50 ms clock, news now and then
        if random.Random(int(now * 20)).random() < 0.002:
            schedule.news(now)
        if now >= schedule.due():
            schedule.built(now)
            built.append(now)
        now += 0.05
    assert max(b - a for a, b in pairwise(built)) <= longest_gap + 0.05
