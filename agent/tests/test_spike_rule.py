"""The spike rule of one signal series (docs/agent.md, "Spikes"): one test per row of the rule's table.

Pure: the rule is plain arithmetic over a window, so these feed it numbers; the real training loops that feed it
are in test_spikes.py.
"""

from __future__ import annotations

import doctest
import math
import random
import statistics

import pytest

from ampwatch.agent import _spikes
from ampwatch.agent._spikes import SpikeSeries

NAN, INF = float("nan"), float("inf")


def _filled(window: int = 8, sigma: float = 6.0, values=None) -> SpikeSeries:
    series = SpikeSeries(window=window, sigma=sigma)
    for v in values if values is not None else [1.0 + 0.01 * (k % 3) for k in range(window)]:
        assert series.observe(v) is None
    return series


def test_the_examples_in_the_docstrings_hold():
    assert doctest.testmod(_spikes).failed == 0


def test_row_1_an_iteration_without_a_value_is_no_spike_adds_nothing_and_ends_a_streak():
    series = _filled()
    before = (len(series), series.level())
    assert series.observe(None) is None
    assert (len(series), series.level(), series.spikes) == (*before, 0)
    assert series.observe(NAN).streak == 1
    assert series.observe(None) is None
    assert series.streak == 0
    assert series.observe(NAN).streak == 1  # not right after a spiking iteration: a new run


def test_row_2_a_non_finite_value_is_a_spike_from_the_first_iteration_and_stays_out_of_the_window():
    series = SpikeSeries(window=8, sigma=6.0)
    first = series.observe(NAN)
    assert first is not None and math.isnan(first.value)
    assert (first.mean, first.std, first.z, first.streak) == (None, None, None, 1)
    series.observe(2.0)
    second = series.observe(-INF)
    assert (second.value, second.mean, second.z) == (-INF, 2.0, None)
    assert len(series) == 1 and series.spikes == 2


def test_row_3_no_spike_is_judged_before_the_window_holds_its_size_in_finite_values():
    series = SpikeSeries(window=8, sigma=6.0)
    for v in [1.0] * 7:
        series.observe(v)
    assert series.observe(1e9) is None  # the 8th value: the window held 7
    assert len(series) == 8 and series.spikes == 0


def test_row_4_a_value_sigma_deviations_above_a_full_windows_mean_spikes_and_enters_the_window():
    values = [1.0, 1.2, 0.8, 1.1, 0.9, 1.0, 1.05, 0.95]
    series = _filled(values=values)
    mean, std = statistics.fmean(values), statistics.pstdev(values)
    at = mean + 6.0 * std
    spike = series.observe(at + 1e-9)
    assert spike is not None and spike.z == pytest.approx(6.0, abs=1e-6) and spike.z >= 6.0
    assert (spike.mean, spike.std) == (pytest.approx(mean), pytest.approx(std))
    assert spike.streak == 1 and series.spikes == 1
    assert series.level()["mean"] == _spikes.rounded(statistics.fmean([*values[1:], at + 1e-9]))  # oldest left


def test_row_5_a_value_just_below_sigma_deviations_or_below_the_mean_is_no_spike_and_enters_the_window():
    values = [1.2, 1.0, 0.8, 1.1, 0.9, 1.0, 1.05, 0.95]
    series = _filled(values=values)
    mean, std = statistics.fmean(values), statistics.pstdev(values)
    below = mean + 5.999 * std
    assert series.observe(below) is None
    window = [*values[1:], below]  # the oldest left
    assert series.level() == {"mean": _spikes.rounded(statistics.fmean(window)),
                              "std": _spikes.rounded(statistics.pstdev(window))}
    assert series.observe(-1e6) is None  # far below the mean: never a spike
    assert series.spikes == 0 and len(series) == 8
    assert series.level()["mean"] == _spikes.rounded(statistics.fmean([*window[1:], -1e6]))


def test_a_constant_series_does_not_spike_at_a_rounding_but_the_std_floor_lets_a_real_jump_spike():
    series = _filled(values=[2.5] * 8)
    assert series.observe(2.5 * (1 + 1e-7)) is None  # within the 1e-6 relative floor
    jump = series.observe(2.6)
    assert jump is not None and jump.std == pytest.approx(2.5e-6)


def test_row_6_spikes_in_consecutive_iterations_count_up_their_streak_and_a_quiet_one_ends_it():
    series = _filled(window=4, values=[1.0, 1.01, 0.99, 1.0])
    assert [series.observe(NAN).streak for _ in range(3)] == [1, 2, 3]
    assert series.observe(1.0) is None and series.streak == 0
    assert series.observe(INF).streak == 1


def test_rows_7_and_8_a_streaks_spikes_are_sent_at_positions_1_2_4_8_and_all_counted():
    series = _filled()
    spikes = [series.observe(NAN) for _ in range(20)]
    assert [s.streak for s in spikes if s.rung] == [1, 2, 4, 8, 16]
    assert series.spikes == 20


def test_a_lasting_level_becomes_the_new_normal_after_a_window():
    series = _filled(window=8)
    judged = [series.observe(10.0) for _ in range(10)]
    assert judged[0] is not None and all(s is None for s in judged[8:])


def test_a_long_healthy_series_with_a_large_mean_does_not_drift_into_a_spike():
    # Running sums of a series with a large mean and a small spread: without the shift and the exact recompute,
    # cancellation and drift would make the std wrong (zero, or noise) after many values.
    rng = random.Random(7)
    series = SpikeSeries(window=128, sigma=6.0)
    values = [1e6 + rng.gauss(0.0, 0.01) for _ in range(50_000)]
    assert all(series.observe(v) is None for v in values)
    level = series.level()
    assert level["std"] == pytest.approx(statistics.pstdev(values[-128:]), rel=1e-3)
    assert level["mean"] == _spikes.rounded(statistics.fmean(values[-128:]))


def test_the_level_is_absent_below_two_values_and_rounded_to_four_significant_digits():
    series = SpikeSeries(window=8, sigma=6.0)
    assert series.level() is None
    series.observe(3.14159265)
    assert series.level() is None
    series.observe(2.71828)
    assert series.level() == {"mean": 2.93, "std": 0.2117}


def test_the_event_fields_of_a_spike_are_the_contracts():
    from ampwatch.contract.batch import LossSpikeEvent, fields
    spike = _filled().observe(NAN)
    assert set(spike.fields()) | {"kind"} <= set(fields(LossSpikeEvent))


@pytest.mark.parametrize(("window", "sigma"), [(1, 6.0), (2.5, 6.0), (True, 6.0), (8, 0.0), (8, INF), (8, NAN)])
def test_a_window_below_two_or_a_sigma_not_positive_and_finite_is_refused_by_name(window, sigma):
    with pytest.raises(ValueError, match="spike (window|sigma)"):
        SpikeSeries(window=window, sigma=sigma)


class _InFlight:
    """Stands in for a device-to-host copy (``_device.PendingRead``) on a GPU, which this machine has none of:
    it lands when the test says so. The CPU path of the real PendingRead is read at once, so the order of values
    still in flight can only be shown this way."""

    def __init__(self, tensor) -> None:
        self.value, self.landed = float(tensor), False

    def done(self) -> bool:
        return self.landed

    def wait(self) -> list[float]:
        self.landed = True
        return [self.value]


def test_values_read_later_are_judged_in_the_order_taken_once_landed_and_all_at_close(monkeypatch):
    import torch

    from ampwatch.agent import _spike_watch
    from ampwatch.agent._events import EventBuffer

    reads: list[_InFlight] = []
    monkeypatch.setattr(_spike_watch._device, "read_later", lambda t: reads.append(_InFlight(t)) or reads[-1])
    events = EventBuffer()
    watch = _spike_watch.SpikeWatch(events, window=4, sigma=6.0, samples=lambda: None)
    device = torch.device("cuda")  # the key only: the tensors stay on the CPU, the copies are stood in for
    for iteration, value in enumerate([1.0, 1.1, 0.9, 1.0, 50.0, float("nan")]):
        watch._take("", iteration, 0.0, {device: [torch.tensor(value / 2), torch.tensor(value / 2)]})  # summed
    assert len(watch.series) == 0 and len(reads) == 6  # nothing judged while nothing landed
    reads[1].landed = True
    watch.resolve()
    assert len(watch.series) == 0  # the oldest has not landed: nothing after it is judged before it
    for read in reads[:5]:
        read.landed = True
    watch.resolve()
    assert [(e["iteration"], e["value"]) for e in events.drain()] == [(4, 50.0)]
    watch.close()  # the last one, waited for
    (last,) = events.drain()
    assert last["iteration"] == 5 and last["streak"] == 2 and math.isnan(last["value"])


def test_z_is_what_observe_compares_with_the_sigma_and_judges_nothing():
    values = [1.0, 1.2, 0.8, 1.1, 0.9, 1.0, 1.05, 0.95]
    series = SpikeSeries(window=8, sigma=6.0)
    for v in values:
        assert series.z(v) is None  # the window is not full yet
        series.observe(v)
    mean, std = statistics.fmean(values), statistics.pstdev(values)
    assert series.z(mean + 3 * std) == pytest.approx(3.0) and series.z(NAN) is None and series.spikes == 0
    assert series.z(mean + 7 * std) == pytest.approx(series.observe(mean + 7 * std).z)


def test_a_spike_enters_the_window_clipped_so_the_same_spike_again_within_the_window_still_spikes():
    # One rank's gradients x1,000 three times within one window (issue 40's faulty device): had the first entered
    # whole, it would have lifted the window's deviation so far that the third scored about 8, a smaller one less.
    series = _filled(window=128, values=[1.0 + 0.01 * math.sin(k) for k in range(128)])
    spikes = [series.observe(v) for v in (1000.0, 1.0, 1.01, 1000.0, 0.99, 300.0, 1.0, 1000.0)]
    assert [s is not None for s in spikes] == [True, False, False, True, False, True, False, True]
    assert all(s.z > 1000 for s in spikes if s is not None)
    assert series.level()["mean"] < 1.2  # three 6-sigma values in 128, not three values of 1,000
