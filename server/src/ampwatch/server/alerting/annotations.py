"""Summary, description and runbook link of a built-in alert: the definition's texts, filled in as Prometheus would."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from ampwatch.contract.alerts import ALERTS
from ampwatch.contract.thresholds import AlertThresholds

__all__ = ["annotations_for", "AlertTexts", "BlockTexts", "diagnosis_texts"]

_SAMPLE_IDS_SHOWN = 8  # the ids a notification names (the count says how many the iteration had)
_BEFORE_IDS_SHOWN = 4  # per iteration before the streak


def annotations_for(name: str, labels: Mapping[str, Any], value: float, thresholds: AlertThresholds,
                    level: str | None = None) -> dict[str, str]:
    """Return the summary, description and runbook_url of one instance of alert ``name``.

    The texts are those of the Prometheus rules (one definition, ``ampwatch.contract.alerts``), with
    the labels and the value filled in as Prometheus fills its templates; ``level`` is the severity
    whose threshold the text names (the streak alert has two). Costs a few string formats.
    """
    fields = {"run": "", "rank": "", "optimizer": "", "host": "", "local_rank": "", "device": "",
              **{k: str(v) for k, v in labels.items()},
              "value": _number(value), "percent": _percent(value), "duration": _duration(value)}
    return ALERTS[name].annotations(thresholds, fields, level)


def diagnosis_texts(diagnosis: tuple | None) -> dict[str, str]:
    """Return the ``began``, ``samples`` and ``samples_before`` annotations of a rank's latest skip or poisoned step
    (``(event id, began, samples, samples before)`` of ``RankSnapshot.diagnosis``): where its inf/NaN began, on which
    samples, and those of the iterations before its streak began, when known."""
    if diagnosis is None:
        return {}
    _, began, samples, before = diagnosis
    texts = {}
    if began is not None and began.stage is not None:
        where = f" in {began.module or 'the model'}" if began.module is not None else ""
        where += f" ({began.module_type})" if where and began.module_type else ""
        at = f", at {began.param}" if began.stage == "backward" and began.param else ""
        texts["began"] = f"{began.stage}{where}{at}" + ("" if began.stage == "backward" or where else
                                                        " (the loss was not finite)")
    if samples is not None:
        ids = ", ".join(str(i) for i in samples.ids[:_SAMPLE_IDS_SHOWN])
        more = f" … {samples.count} in all" if samples.count > min(len(samples.ids), _SAMPLE_IDS_SHOWN) else ""
        texts["samples"] = f"{ids}{more} (digest {samples.digest})"
    if before:
        texts["samples_before"] = "; ".join(
            f"iteration {entry.iteration}: " + ", ".join(str(i) for i in entry.samples.ids[:_BEFORE_IDS_SHOWN])
            + (f" … {entry.samples.count} in all" if entry.samples.count > _BEFORE_IDS_SHOWN else "")
            for entry in before)
    return texts


class _RenderedTexts(Mapping[str, str]):
    """Annotations rendered when first read (:meth:`_rendered`, written by each subclass), then read as a mapping."""

    __slots__ = ()

    def _rendered(self) -> dict[str, str]:
        raise NotImplementedError

    def __getitem__(self, key: str) -> str:
        return self._rendered()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rendered())

    def __len__(self) -> int:
        return len(self._rendered())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._rendered()!r})"


class AlertTexts(_RenderedTexts):
    """The annotations of one alert instance, rendered by :func:`annotations_for` when first read, then kept.

    An alert that keeps firing is re-judged on every batch its rank sends (in a storm, thousands a
    second) while its texts are read only when someone looks (``GET /v1/alerts``, a notification):
    building this costs one small object, rendering it happens at most once.
    """

    __slots__ = ("_args", "_texts", "_diagnosis")

    def __init__(self, name: str, labels: Mapping[str, Any], value: float, thresholds: AlertThresholds,
                 level: str | None = None, diagnosis: tuple | None = None) -> None:
        self._args: tuple | None = (name, labels, value, thresholds, level)
        self._texts: dict[str, str] = {}
        self._diagnosis = diagnosis

    def _rendered(self) -> dict[str, str]:
        args = self._args
        if args is not None:
            self._texts = {**annotations_for(*args), **diagnosis_texts(self._diagnosis)}
            self._args = self._diagnosis = None  # the labels may belong to a caller; keep only the texts
        return self._texts


class BlockTexts(_RenderedTexts):
    """An alert's annotations with what its split run adds (``_placement_view.RunPlacement.texts``): the ``block`` this
    collector holds, the ``other_blocks`` with their replicas' pages, and a sentence each at the end of the summary
    and the description. Merged when first read, as :class:`AlertTexts` renders."""

    __slots__ = ("_texts", "_block", "_merged")

    def __init__(self, texts: Mapping[str, str], block: Mapping[str, str]) -> None:
        self._texts, self._block = texts, block
        self._merged: dict[str, str] | None = None

    def _rendered(self) -> dict[str, str]:
        if self._merged is None:
            merged = dict(self._texts)
            for key, text in self._block.items():
                merged[key] = merged[key] + text if key in ("summary", "description") and key in merged else text
            self._merged = merged
        return self._merged


def _number(value: float) -> str:
    # As Prometheus's {{ $value }} (Go's %v): "0.25", "65536", and "NaN", "+Inf", "-Inf" for the non-finite.
    if math.isfinite(value):
        return f"{value:g}"
    return "NaN" if value != value else ("+Inf" if value > 0 else "-Inf")


def _percent(value: float) -> str:
    # As Prometheus's humanizePercentage: 0.5 -> "50%", 0.1234 -> "12.34%".
    return f"{value * 100:.4g}%"


def _duration(seconds: float) -> str:
    # Close to Prometheus's humanizeDuration: "45.5s", "2m 5s", "1h 2m 3s" (NaN and infinities as they are).
    if not math.isfinite(seconds):
        return _number(seconds)
    if seconds < 60:
        return f"{seconds:.4g}s"
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return " ".join(f"{n}{unit}" for n, unit in ((hours, "h"), (minutes, "m"), (secs, "s")) if n or unit == "s")
