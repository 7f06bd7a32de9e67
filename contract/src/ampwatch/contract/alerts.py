"""Every ampwatch alert, defined once: what both evaluators (Prometheus rules, the collector) share.

A common alert declares its *condition* here too, in one of the forms of
:mod:`ampwatch.contract.conditions` (a counter rose within a window, rose by at least a threshold, a
share over a minimum count, a gauge outside a range), which each evaluator compiles
(``ampwatch.dashboards.forms`` to PromQL, ``ampwatch.server.alerting.forms`` to Python). A run-wide
alert that speaks for a per-rank one (``speaks_for``) has its condition from that one's. Only a
bespoke alert's condition is code in each evaluator (a PromQL expression in
``ampwatch.dashboards.rules.CONDITIONS``, Python in ``ampwatch.server.alerting.rank_conditions``
and ``run_conditions``: :func:`hand_written` names them).
Everything else is here: its name, the labels it carries, its severities, its
``for:`` window, the thresholds its condition reads, the window it looks back
over and the counters it compares there (names from :mod:`ampwatch.contract.counters`),
its summary and description, and the anchor of its runbook section in docs/alerts.md.
The collector's alert history keeps exactly the counters the definitions name, back to
the longest window, and skips a rank none of whose declared counters moved.

Texts are templates. Threshold fields are filled in from an
:class:`~ampwatch.contract.thresholds.AlertThresholds` (durations as PromQL
writes them, ``10m``), ``{threshold}`` with the severity's threshold (the
streak length), and the rest by the evaluator: ``{run}``, ``{rank}``,
``{optimizer}``, ``{host}``, ``{local_rank}`` (labels) and ``{value}``, ``{percent}``, ``{duration}`` (the
value as a number, a percentage, a duration): Go templates for Prometheus,
the values themselves in the collector.

Example::

    from ampwatch.contract.alerts import ALERTS
    from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS
    ALERTS["AmpLossScaleCollapsed"].annotations(DEFAULT_THRESHOLDS, {"run": "exp-1", "rank": "3", "value": "0.5"})
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from typing import Any

from . import conditions
from .conditions import Condition, Outside, Rose, Share
from .counters import COUNTERS, GAUGES
from .thresholds import AlertThresholds, promql_duration

__all__ = ["ALERTS", "ALERT_NAMES", "DEFAULT_RUNBOOK_BASE_URL", "SPEAKERS", "AlertDefinition", "Severity",
           "check_hand_written", "hand_written", "speakers_of"]

DEFAULT_RUNBOOK_BASE_URL = "https://github.com/ampwatch/ampwatch/blob/main/docs/alerts.md"
"""Where ``runbook_url`` points; each alert appends ``#<its runbook anchor>``."""

_LABELS = {"run": ("run",), "rank": ("run", "rank"), "optimizer": ("run", "rank", "optimizer"),
           "host": ("run", "rank", "host", "local_rank")}


@dataclasses.dataclass(frozen=True, slots=True)
class Severity:
    """One severity of an alert: its level, and the thresholds field its ``{threshold}`` is read from, if any."""

    level: str
    """``warning`` or ``critical``."""
    threshold: str | None = None
    """The AlertThresholds field that sets this level apart (the streak alert's lengths); None for most alerts."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AlertDefinition:
    """What an alert is, and its condition if it takes a common form (``condition``)."""

    name: str
    """Prometheus's ``alertname``, e.g. ``AmpConsecutiveSkippedSteps``."""
    scope: str
    """``optimizer``, ``rank`` or ``run``: which of run, rank, optimizer label each instance; ``host``: a rank
    labelled with its host and local rank too (what a hardware ticket needs), judged across its run (a bespoke
    condition) or on its own counters (a declared one: :attr:`across_run`)."""
    severities: tuple[Severity, ...]
    """One rule per severity (the streak alert has a warning and a critical one)."""
    for_field: str | None
    """The AlertThresholds field holding its ``for:`` window; None: it fires at the first evaluation."""
    summary: str
    description: str
    condition: Condition | None = None
    """Its condition, in a form both evaluators compile (:mod:`ampwatch.contract.conditions`); its window, counts,
    rises, context and parameters follow from it (declare none of them). None: a bespoke alert, whose condition is
    written in each evaluator, or one that speaks for a per-rank alert (``speaks_for``)."""
    parameters: tuple[str, ...] = ()
    """The AlertThresholds fields its condition reads (besides its window and its severities' thresholds); for one
    that speaks for a per-rank alert (``speaks_for``), also how long that alert waits at its edges."""
    window: str | None = None
    """The AlertThresholds field of the window its condition looks back over (``increase(x[w])``); None: it reads
    the latest state of its ranks only."""
    counts: tuple[str, ...] = ()
    """Counters (:data:`~ampwatch.contract.counters.COUNTERS`) it compares with their value one window ago: how much
    they rose, or what they were then."""
    rises: tuple[str, ...] = ()
    """Counters it asks only whether they rose within the window (a ladder counter: at its severities' lengths)."""
    context: tuple[str, ...] = ()
    """Of ``counts`` and ``rises``, those whose rise alone cannot make it hold (steps beside skips, growths that rule
    it out, the iteration past calibration): a rank where only these moved within the window is quiet for it."""
    gauges: tuple[str, ...] = ()
    """Gauges (:data:`~ampwatch.contract.counters.GAUGES`) that can make it hold on their own while its counters stand
    still (a current streak): while one is above 0 the rank is read in full."""
    speaks_for: str | None = None
    """A run-wide alert that speaks for a per-rank one (scope ``rank`` or ``optimizer``, the same severities): it
    holds at a severity when at least ``storm_rank_share`` of the run's ranks, and two at least, hold that alert at
    that severity (ranks that closed count, as their alerts do within a window). While it holds, those ranks'
    instances of that severity are held back; a rank that stands out (another severity, or not in it) keeps its own.
    Its condition in both evaluators follows from this: it reads nothing of its own."""

    def __post_init__(self) -> None:
        where = f"alert {self.name}"
        if self.condition is not None:
            self._derive(where, self.condition)
        if bool(self.window) != bool(self.counts or self.rises):
            raise ValueError(f"{where}: a window needs counters to compare over it (counts, rises), and they a window")
        for name in (*self.counts, *self.rises):
            if name not in COUNTERS:
                raise ValueError(f"{where}: {name!r} is not a counter of ampwatch.contract.counters.COUNTERS")
        for name in self.gauges:
            if name not in GAUGES:
                raise ValueError(f"{where}: {name!r} is not a gauge of ampwatch.contract.counters.GAUGES")
        if not set(self.context) <= {*self.counts, *self.rises}:
            raise ValueError(f"{where}: context {self.context} must be among its counts and rises")
        if self.window and not set(self.counts + self.rises) - set(self.context):
            raise ValueError(f"{where}: some counter it reads must be able to make it hold (not all context)")
        if self.speaks_for and (self.scope != "run" or self.window or self.gauges):
            raise ValueError(f"{where}: an alert that speaks for a per-rank one is of scope run and reads no counters "
                             "of its own (its condition is the per-rank alert's, counted across the run)")
        fields = {f.name for f in dataclasses.fields(AlertThresholds)}
        for field in (self.window, self.for_field, *self.parameters, *(s.threshold for s in self.severities)):
            if field is not None and field not in fields:
                raise ValueError(f"{where}: {field!r} is not a field of AlertThresholds")

    def _derive(self, where: str, condition: Condition) -> None:
        """Take window, counts, rises, context and parameters from ``condition`` (each as declared, if declared)."""
        conditions.check(condition, where)
        if self.speaks_for or self.gauges:
            raise ValueError(f"{where}: an alert with a condition neither speaks for another nor names gauges")
        if condition.per != self.scope and (condition.per, self.scope) != ("rank", "host"):
            raise ValueError(f"{where}: its condition reads values of each {condition.per}, so its scope is "
                             f"{condition.per}, not {self.scope}")
        if len(self.severities) != 1 or self.severities[0].threshold:
            raise ValueError(f"{where}: an alert with a condition has one severity, without a threshold of its own")
        derived = {"window": condition.window, "counts": condition.counts, "rises": condition.rises,
                   "context": condition.context, "parameters": condition.parameters}
        for field, value in derived.items():
            declared = getattr(self, field)
            if declared and declared != value:
                raise ValueError(f"{where}: leave {field} out, it follows from its condition ({value!r}); it "
                                 f"declares {declared!r}")
            object.__setattr__(self, field, value)

    @property
    def thresholds_read(self) -> tuple[str, ...]:
        """Return every AlertThresholds field it depends on: parameters, window, ``for``, severities' thresholds."""
        return (*self.parameters, *filter(None, (self.window, self.for_field)),
                *(s.threshold for s in self.severities if s.threshold))

    @property
    def across_run(self) -> bool:
        """Whether its condition is judged across a run (scope ``run``, or ``host`` without a declared condition),
        not on one rank's values: a host alert that declares its condition holds on the rank's own counters, its
        host and local rank only labelling it."""
        return self.scope == "run" or (self.scope == "host" and self.condition is None)

    @property
    def labels(self) -> tuple[str, ...]:
        """Return the identifying labels of an instance (``severity`` comes on top)."""
        return _LABELS[self.scope]

    @property
    def runbook_anchor(self) -> str:
        """Return the anchor of its section in docs/alerts.md (the name in lower case)."""
        return self.name.lower()

    def runbook_url(self, base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> str:
        """Return the link to its runbook section."""
        return f"{base_url}#{self.runbook_anchor}"

    def for_seconds(self, t: AlertThresholds) -> int:
        """Return how long its condition must hold before it fires, in seconds."""
        return getattr(t, self.for_field) if self.for_field else 0

    def severity(self, level: str | None = None) -> Severity:
        """Return the severity of that level (None: the only one)."""
        if level is None and len(self.severities) == 1:
            return self.severities[0]
        return next(s for s in self.severities if s.level == level)

    def annotations(self, t: AlertThresholds, fields: Mapping[str, str], level: str | None = None,
                    base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> dict[str, str]:
        """Return summary, description and runbook_url, filled in from ``t`` and the evaluator's ``fields``.

        ``fields`` gives run, rank, optimizer, value, percent and duration (those a
        text uses); ``level`` picks the severity whose threshold ``{threshold}`` is.
        Costs a few string formats (the thresholds are rendered once per ``t``).
        """
        values: dict[str, Any] = dict(_threshold_texts(t))
        severity = self.severity(level) if level or len(self.severities) == 1 else None
        if severity is not None and severity.threshold:
            values["threshold"] = values[severity.threshold]
        values.update(fields)
        return {"summary": self.summary.format_map(values), "description": self.description.format_map(values),
                "runbook_url": self.runbook_url(base_url)}


@functools.lru_cache(maxsize=16)
def _threshold_texts(t: AlertThresholds) -> Mapping[str, str]:
    # Thresholds rarely change (one per collector); rendering them all per alert instance was most of the cost
    # of the texts, which a whole-job storm asks for at every batch of every rank in trouble.
    return {f.name: _text(f.name, getattr(t, f.name)) for f in dataclasses.fields(t)}


def _text(field: str, value: Any) -> str:
    """Render a threshold as the texts show it: durations as PromQL writes them, numbers short."""
    if field.endswith("_s"):
        return promql_duration(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


_WHERE = "optimizer {optimizer} on rank {rank} of run {run}"
_ON_RANK = "rank {rank} of run {run}"
_WARNING = (Severity("warning"),)
_CRITICAL = (Severity("critical"),)
# What an alert that speaks for per-rank ones reads: the share of ranks, and how long theirs wait at its edges.
_SPEAKING = ("storm_rank_share", "storm_edge_for_s")
_SPEAKS = "This alert speaks for those ranks: their own {their} are held back; a rank that stands out keeps its own."

ALERTS: Mapping[str, AlertDefinition] = {d.name: d for d in (
    AlertDefinition(
        name="AmpConsecutiveSkippedSteps", scope="optimizer",
        severities=(Severity("warning", "skip_streak_warning"), Severity("critical", "skip_streak_critical")),
        for_field=None, window="skip_streak_window_s", rises=("streaks_reached",),
        gauges=("consecutive_skipped",),
        summary="An optimizer skipped {threshold} or more steps in a row",
        description=f"The {_WHERE} skipped at least {{threshold}} consecutive steps within the last "
                    "{skip_streak_window_s}: its parameters were not updated (current streak: {value} skipped "
                    "steps)."),
    AlertDefinition(
        name="AmpRunSkipStorm", scope="run",
        severities=(Severity("warning", "skip_streak_warning"), Severity("critical", "skip_streak_critical")),
        for_field=None, parameters=_SPEAKING, speaks_for="AmpConsecutiveSkippedSteps",
        summary="Most ranks of a run skip together: {threshold} or more steps in a row",
        description="{percent} of the ranks of run {run} have an optimizer that skipped at least {threshold} "
                    "consecutive steps within the last {skip_streak_window_s}: the whole job stopped updating its "
                    f"parameters. {_SPEAKS.format(their='streak alerts of this severity')}"),
    AlertDefinition(
        name="AmpSustainedLossScaleBackoff", scope="run", severities=_WARNING, for_field="backoff_for_s",
        parameters=("backoff_min_count", "backoff_rank_share", "calibration_iterations"),
        window="backoff_window_s", counts=("backoffs", "iteration"), rises=("growths",),
        context=("iteration", "growths"),
        summary="Many ranks of a run keep backing off the loss scale",
        description="{percent} of the open ranks of run {run} backed the loss scale off at least "
                    "{backoff_min_count} times in the last {backoff_window_s} without any growth: gradients keep "
                    "overflowing."),
    AlertDefinition(
        name="AmpLossScaleCollapsed", scope="rank", severities=_CRITICAL, for_field="collapsed_for_s",
        condition=Outside("loss_scale", low="collapsed_loss_scale"),
        summary="The loss scale collapsed below {collapsed_loss_scale}, or is NaN or infinite",
        description=f"The loss scale of {_ON_RANK} is {{value}}, not a finite value of at least "
                    "{collapsed_loss_scale}: backoffs keep halving it because gradients are non-finite at any "
                    "scale, or it became 0, NaN or infinite, where every step skips and it can never recover."),
    AlertDefinition(
        name="AmpRunLossScaleCollapsed", scope="run", severities=_CRITICAL, for_field="collapsed_for_s",
        parameters=_SPEAKING, speaks_for="AmpLossScaleCollapsed",
        summary="The loss scale collapsed on most ranks of a run",
        description="{percent} of the ranks of run {run} have a loss scale below {collapsed_loss_scale}, NaN or "
                    "infinite: gradients are non-finite at any scale across the job, or the scale became 0, NaN or "
                    f"infinite, where every step skips. {_SPEAKS.format(their='collapsed-scale alerts')}"),
    AlertDefinition(
        name="AmpLossScaleDesync", scope="run", severities=_WARNING, for_field="desync_for_s",
        parameters=("desync_scale_ratio",),
        summary="Ranks of a run disagree on the loss scale",
        description="The largest loss scale among the open ranks of run {run} is {value} times the smallest: the "
                    "ranks no longer see the same gradients or scaler state."),
    AlertDefinition(
        name="AmpHighSkippedStepRatio", scope="optimizer", severities=_WARNING, for_field="skip_ratio_for_s",
        condition=Share(part="skipped", rest="steps", whole="step_calls", window="skip_ratio_window_s",
                        at_least="skip_ratio", min_count="skip_ratio_min_steps"),
        summary="An optimizer skips a large share of its steps",
        description=f"The {_WHERE} skipped {{percent}} of its steps over the last {{skip_ratio_window_s}}."),
    AlertDefinition(
        name="AmpRunHighSkippedStepRatio", scope="run", severities=_WARNING, for_field="skip_ratio_for_s",
        parameters=_SPEAKING, speaks_for="AmpHighSkippedStepRatio",
        summary="Most ranks of a run skip a large share of their steps",
        description="{percent} of the ranks of run {run} have an optimizer that skipped a share of at least "
                    "{skip_ratio} of its steps over the last {skip_ratio_window_s}: the whole job loses updates. "
                    f"{_SPEAKS.format(their='skip-ratio alerts')}"),
    AlertDefinition(
        name="AmpRankSilent", scope="rank", severities=_WARNING, for_field="silent_for_s",
        parameters=("silent_after_s",),
        summary="A rank stopped reporting without closing",
        description=f"No batch from {_ON_RANK} for {{duration}} and it did not close: the process died, hung, or "
                    "cannot reach the collector."),
    AlertDefinition(
        name="AmpSchedulerStepsOnSkipped", scope="optimizer", severities=_WARNING, for_field=None,
        condition=Rose("scheduler_steps_after_skip", window="scheduler_window_s"),
        summary="An LR scheduler stepped after a skipped optimizer step",
        description=f"The LR scheduler of {_WHERE} stepped right after skipped steps (so far: {{value}}): the "
                    "schedule runs ahead of the real updates."),
    AlertDefinition(
        name="AmpPoisonedStep", scope="optimizer", severities=_CRITICAL, for_field=None,
        condition=Rose("poisoned_steps", window="poisoned_window_s"),
        summary="An optimizer updated its parameters with non-finite gradients",
        description=f"The {_WHERE} stepped although its gradients were non-finite, or its parameters became "
                    "non-finite (poisoned steps so far: {value}): the weights are likely NaN for good."),
    AlertDefinition(
        name="AmpSkipOriginRank", scope="host", severities=_WARNING, for_field=None,
        parameters=("origin_min_count", "origin_rank_share"), window="origin_window_s",
        counts=("origin_iterations",),
        summary="One rank keeps starting the run's skipped steps",
        description="Rank {rank} of run {run} (host {host}, local rank {local_rank}) held non-finite gradients "
                    "of its own before DDP's all-reduce in {value} skipped iterations within the last "
                    "{origin_window_s}, while at most {origin_rank_share} of the run's ranks did: suspect that "
                    "GPU, its host or its data shard."),
    AlertDefinition(
        name="AmpSuspectDevice", scope="rank", severities=_WARNING, for_field=None, gauges=("on_suspect_device",),
        summary="A rank runs on a device suspected of faults",
        description="Rank {rank} of run {run} runs on device {device} (suspect: {value}), which was the sole "
                    "origin of skipped or poisoned steps on different samples, again and again, in this run or "
                    "earlier ones, while the other devices were not: suspect that GPU (GET /v1/suspects lists its "
                    "evidence)."),
    AlertDefinition(
        name="AmpLossSpike", scope="rank", severities=_WARNING, for_field=None,
        condition=Rose("loss_spikes", window="spike_window_s"),
        summary="The loss spiked on a rank",
        description=f"The loss of {_ON_RANK} was at least {{spike_sigma}} standard deviations above its rolling mean "
                    "over {spike_window_iterations} iterations, or non-finite, within the last {spike_window_s} "
                    "(spikes so far: {value}): a bad batch, a too-high learning rate, or the first sign of a "
                    "divergence."),
    AlertDefinition(
        name="AmpRunLossSpike", scope="run", severities=_WARNING, for_field=None,
        parameters=_SPEAKING, speaks_for="AmpLossSpike",
        summary="The loss spiked on most ranks of a run",
        description="{percent} of the ranks of run {run} had a loss spike within the last {spike_window_s}: the "
                    "whole job's loss jumped (learning rate, optimizer state, a bad stretch of data), not one rank's "
                    f"batch. {_SPEAKS.format(their='loss-spike alerts')}"),
    AlertDefinition(
        name="AmpGradNormSpike", scope="optimizer", severities=_WARNING, for_field=None,
        condition=Rose("grad_norm_spikes", window="spike_window_s"),
        summary="The gradient norm spiked",
        description=f"The gradient norm of {_WHERE} was at least {{spike_sigma}} standard deviations above its "
                    "rolling mean over {spike_window_iterations} iterations, or non-finite on a step that went "
                    "through, within the last {spike_window_s} (spikes so far: {value}): what comes before loss "
                    "spikes and skip storms."),
    AlertDefinition(
        name="AmpRunGradNormSpike", scope="run", severities=_WARNING, for_field=None,
        parameters=_SPEAKING, speaks_for="AmpGradNormSpike",
        summary="The gradient norm spiked on most ranks of a run",
        description="{percent} of the ranks of run {run} had a gradient-norm spike within the last "
                    "{spike_window_s}: with DDP every rank steps with the same all-reduced gradients, so one rank's "
                    "bad gradients show on all of them (AmpRankGradientOutlier names the rank they came from). "
                    f"{_SPEAKS.format(their='gradient-norm spike alerts')}"),
    AlertDefinition(
        name="AmpRankGradientOutlier", scope="host", severities=_WARNING, for_field=None,
        condition=Rose("gradient_outliers", window="outlier_window_s"),
        summary="One rank's gradients stand out from the others'",
        description="Rank {rank} of run {run} (host {host}, local rank {local_rank}) had its own gradient norm, "
                    "before DDP's all-reduce, at least {outlier_sigma} robust deviations above the other ranks' "
                    "while at most {outlier_rank_share} of the run's ranks spiked and no other rank's own norm had "
                    "in the {outlier_after_iterations} iterations before, within the last {outlier_window_s} "
                    "(outliers so far: {value}): suspect that GPU, its host or its data shard (GET "
                    "/v1/runs/{run}/events lists the gradient_outlier events)."),
    AlertDefinition(
        name="AmpRankConflict", scope="rank", severities=_WARNING, for_field=None,
        condition=Rose("conflicts", window="conflict_window_s"),
        summary="Two processes claim one run and rank",
        description=f"A second process claimed {_ON_RANK} while the first one kept sending (conflicts so far: "
                    "{value}): two jobs share a run id, or something else writes into the collector. The first "
                    "process stays the rank; the other's later batches are refused."),
)}
"""Every alert, by name, in the order of the generated rules."""

ALERT_NAMES: tuple[str, ...] = tuple(ALERTS)


def speakers_of(alerts: Mapping[str, AlertDefinition]) -> Mapping[str, str]:
    """Return each per-rank alert of ``alerts`` that a run-wide one speaks for -> that run-wide alert.

    Raise a ValueError naming both alerts unless each ``speaks_for`` names an alert of ``alerts`` of scope rank or
    optimizer with the same severities (each level, with the same threshold: the run-wide alert holds at a severity
    when enough ranks hold the per-rank one at it, and holds back their instances of it), spoken for by no other.
    """
    speakers: dict[str, str] = {}
    for d in alerts.values():
        if not d.speaks_for:
            continue
        where = f"alert {d.name} speaks for {d.speaks_for}"
        spoken = alerts.get(d.speaks_for)
        if spoken is None:
            raise ValueError(f"{where}, which is no alert")
        if spoken.scope not in ("rank", "optimizer"):
            raise ValueError(f"{where}, of scope {spoken.scope}: it must be an alert of scope rank or optimizer")
        if spoken.severities != d.severities:
            raise ValueError(f"{where}, whose severities {_levels(spoken)} are not its own {_levels(d)}: they must be "
                             "the same, each with the same threshold")
        if d.speaks_for in speakers:
            raise ValueError(f"{where}, as {speakers[d.speaks_for]} does: each per-rank alert has at most one "
                             "run-wide alert that speaks for it")
        speakers[d.speaks_for] = d.name
    return speakers


def hand_written(alerts: Mapping[str, AlertDefinition]) -> frozenset[str]:
    """Return the alerts of ``alerts`` whose condition each evaluator writes by hand: the bespoke ones, which declare
    no ``condition`` and speak for no other alert."""
    return frozenset(d.name for d in alerts.values() if d.condition is None and not d.speaks_for)


def check_hand_written(where: str, written: Iterable[str], alerts: Mapping[str, AlertDefinition]) -> None:
    """Raise a RuntimeError unless ``written`` (the conditions ``where`` holds) names exactly the bespoke alerts of
    ``alerts`` (:func:`hand_written`), naming those missing and those extra, and why each extra one is."""
    written = set(written)
    bespoke = hand_written(alerts)
    missing, extra = sorted(bespoke - written), sorted(written - bespoke)
    if missing or extra:
        why = {name: "no such alert" if name not in alerts else
               "its condition is declared" if alerts[name].condition else "it speaks for another" for name in extra}
        raise RuntimeError(
            f"{where} must hold a hand-written condition for each bespoke alert of ampwatch.contract.alerts (no "
            f"condition declared, speaking for no other) and for no other; missing: {missing}, extra: "
            + ("[" + ", ".join(f"{name} ({why[name]})" for name in extra) + "]"))


def _levels(d: AlertDefinition) -> str:
    """Its severities as an error names them: ``(warning at skip_streak_warning, critical at ...)``."""
    return "(" + ", ".join(s.level + (f" at {s.threshold}" if s.threshold else "") for s in d.severities) + ")"


SPEAKERS: Mapping[str, str] = speakers_of(ALERTS)
"""Each per-rank alert that a run-wide one speaks for -> that run-wide alert (its ``speaks_for``)."""
