"""The periodic alert pass runs in a worker thread while batches are observed on the event loop's thread."""

from __future__ import annotations

import threading

from ampwatch.server.alerting.evaluator import BuiltinAlerts
from ampwatch_support.alert_ranks import FakeRank


class _ParkingLock:
    """The evaluator's own lock, which parks the evaluating thread before its second slice of ranks.

    Not a mock: every acquire is a real lock's. It only makes the interleaving the test needs
    happen every time (the pass has read the first slice of histories; a batch arrives).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.evaluator: threading.Thread | None = None
        self.entered = 0
        self.parked, self.resume = threading.Event(), threading.Event()

    def __enter__(self) -> None:
        if threading.current_thread() is self.evaluator:
            self.entered += 1
            if self.entered == 3:  # 1: the pass took its ranks; 2: the first slice; 3: the second slice
                self.parked.set()
                assert self.resume.wait(60)
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_poisoned_step_observed_during_a_pass_that_read_its_rank_before_is_not_resolved_by_that_pass():
    alerts = BuiltinAlerts()
    ranks = [FakeRank(alerts, rank=r) for r in range(600)]  # slices of 16
    for r in ranks:
        r.iterate()
        r.send(100.0)
    lock = alerts._lock = _ParkingLock()
    transitions: list = []
    evaluating = threading.Thread(target=lambda: transitions.extend(alerts.evaluate(101.0)))
    lock.evaluator = evaluating
    evaluating.start()
    assert lock.parked.wait(60)
    # Rank 0 was read by the first slice, healthy; its batch now carries a poisoned step, which fires at once.
    ranks[0].poisoned += 1
    ranks[0].iterate()
    fired = ranks[0].send(101.0)
    assert [(a.name, a.status) for a in fired] == [("AmpPoisonedStep", "firing")]
    lock.resume.set()
    evaluating.join(60)
    assert not evaluating.is_alive()
    assert transitions == []  # the pass's older reading of rank 0 does not resolve what its batch fired
    assert [(a.name, a.labels["rank"]) for a in alerts.firing()] == [("AmpPoisonedStep", "0")]
    # The next pass reads the streak itself and keeps it firing.
    assert alerts.evaluate(102.0) == [] and len(alerts.firing()) == 1


def test_passes_in_a_thread_and_batches_on_another_end_in_the_same_alerts_as_one_thread_would():
    alerts, alone = BuiltinAlerts(), BuiltinAlerts()
    ranks = [FakeRank(alerts, rank=r) for r in range(1000)]
    twins = [FakeRank(alone, rank=r) for r in range(1000)]
    stop = threading.Event()
    failures: list[BaseException] = []

    def passes() -> None:
        try:
            # A pass, a short breath, the next: as the service ticks (every second there), never a tight loop that
            # would keep the evaluator's lock from the batches' thread (Python's locks are not fair).
            while not stop.wait(0.002):
                alerts.evaluate(150.0)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)

    evaluating = threading.Thread(target=passes)
    evaluating.start()
    try:
        for second in range(100, 150):
            for rank, twin in zip(ranks, twins, strict=True):
                skip = rank.rank % 10 == 0 and second >= 120  # a tenth of the ranks start a long streak
                for r in (rank, twin):
                    r.iterate(skipped=skip)
                    r.send(float(second))
    finally:
        stop.set()
        evaluating.join(60)
    assert not failures
    for _ in range(2):  # a streak on several ranks of a run fires once two passes in a row found it
        alerts.evaluate(150.0)
        alone.evaluate(150.0)
    final = {(a.name, tuple(sorted(a.labels.items()))) for a in alerts.firing()}
    assert final == {(a.name, tuple(sorted(a.labels.items()))) for a in alone.firing()}
    assert any(name == "AmpConsecutiveSkippedSteps" for name, _ in final)
