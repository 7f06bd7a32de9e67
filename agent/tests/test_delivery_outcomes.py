"""How long a failed batch waits before it goes again, on an injected clock: no test here waits for real time.

The sender honours these waits against a real server: test_sender.py checks the gaps between the attempts.
"""

from __future__ import annotations

import json
import random

import pytest

from ampwatch.agent._http import Answer
from ampwatch.agent._outcomes import DeliveryOutcomes

NOW = 1000.0
URL = "http://127.0.0.1:1"
REFUSED = Answer(None, "connection refused")


class Draws(random.Random):
    """A generator whose uniform() draws are the ``fraction`` of the way from ``a`` to ``b``."""

    def __init__(self, fraction: float) -> None:
        super().__init__(0)
        self.fraction = fraction

    def uniform(self, a: float, b: float) -> float:
        return a + (b - a) * self.fraction


def _delays(outcomes: DeliveryOutcomes, answers: list[Answer]) -> list[float]:
    """Fail one batch with each answer in turn; return how long each retry waits."""
    delays = []
    for answer in answers:
        outcomes.failed(URL, 1, answer)
        delays.append(round(outcomes.retry_at - NOW, 6))
    return delays


@pytest.mark.parametrize("fraction, expected", [(1.0, [0.05, 0.1, 0.2, 0.4, 0.4, 0.4]),
                                                (0.0, [0.025, 0.05, 0.1, 0.2, 0.2, 0.2])])
def test_a_retry_waits_double_the_last_from_the_push_interval_up_to_the_cap_jittered_down_to_half(fraction,
                                                                                                 expected):
    outcomes = DeliveryOutcomes(push_interval=0.05, max_backoff=0.4, rng=Draws(fraction), clock=lambda: NOW)
    assert _delays(outcomes, [REFUSED] * 6) == expected
    assert outcomes.send_failures == 6 and outcomes.failures_in_row == 6


def test_a_long_push_interval_starts_the_backoff_at_one_second():
    outcomes = DeliveryOutcomes(push_interval=15.0, max_backoff=60.0, rng=Draws(1.0), clock=lambda: NOW)
    assert _delays(outcomes, [REFUSED] * 8) == [1, 2, 4, 8, 16, 32, 60, 60]


def test_an_acknowledged_batch_starts_the_backoff_over():
    outcomes = DeliveryOutcomes(push_interval=0.05, max_backoff=0.4, rng=Draws(1.0), clock=lambda: NOW)
    _delays(outcomes, [REFUSED] * 4)
    assert outcomes.acked(URL) is True, "the first acknowledgement after failures says delivery resumed"
    assert outcomes.acked(URL) is False
    assert _delays(outcomes, [REFUSED]) == [0.05]


def test_retry_after_is_waited_at_least_within_the_cap():
    outcomes = DeliveryOutcomes(push_interval=0.05, max_backoff=10.0, rng=Draws(1.0), clock=lambda: NOW)
    busy = json.dumps({"error": "cardinality", "retry": True, "message": "retry later"})
    assert _delays(outcomes, [Answer(429, busy, retry_after=2.0), Answer(429, busy, retry_after=60.0),
                              Answer(503, "", retry_after=0.0)]) == [2.0, 10.0, 0.2]


def test_the_wait_is_on_the_clock_given():
    ticks = iter([50.0, 80.0])
    outcomes = DeliveryOutcomes(push_interval=0.05, max_backoff=0.4, rng=Draws(1.0), clock=lambda: next(ticks))
    outcomes.failed(URL, 1, REFUSED)
    assert outcomes.retry_at == 50.05
    outcomes.failed(URL, 1, REFUSED)
    assert outcomes.retry_at == 80.1
