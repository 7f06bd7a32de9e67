"""What `make demo` prints: live progress, alert transitions and the closing summary, from the collector's JSON API."""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from typing import Any

__all__ = ["CollectorView", "scale_text"]


def scale_text(scale: float | str | None) -> str:
    """Render a loss scale: powers of two as ``2^k`` (as the status page does), else ``%g``."""
    if scale is None:
        return "-"
    if isinstance(scale, str):  # the query API writes NaN and infinities as "NaN", "Infinity", "-Infinity"
        return scale
    exponent = math.log2(scale) if scale > 0 else None
    return f"2^{int(exponent)}" if exponent is not None and exponent.is_integer() else f"{scale:g}"


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return json.loads(answer.read())


class CollectorView:
    """Poll one run on a collector and print what changed since the last poll."""

    def __init__(self, url: str, run: str, iterations: int, trouble: range, print_=print) -> None:
        self.url, self.run, self.iterations, self.trouble = url, run, iterations, trouble
        self.print = print_
        self.started = time.monotonic()
        self.ranks: list[dict] = []
        self._seen: set[tuple] = set()
        self._events_since = 0.0
        self._newest = 0.0
        self.firing: dict[str, dict] = {}
        self.fired: dict[str, dict] = {}
        self.resolved: dict[str, dict] = {}
        self.skips: list[dict] = []
        self.phase = ""
        self._last_line = ""
        self._last_line_at = 0.0
        self._run_path = urllib.parse.quote(run, safe="")

    def poll(self) -> None:
        """Read the run, its new events and the alerts; print what is new."""
        try:
            self.ranks = _get(f"{self.url}/v1/runs/{self._run_path}")["ranks"]
        except urllib.error.HTTPError as error:
            if error.code != 404:  # 404: no batch of this run yet
                raise
        self._poll_events()
        self._poll_alerts()
        self._progress()

    def _elapsed(self) -> str:
        return f"[{time.monotonic() - self.started:5.1f}s]"

    def _progress(self) -> None:
        if not self.ranks:
            return
        iteration = min(r["iteration"] for r in self.ranks)
        phase = ("warm-up" if iteration < self.trouble.start else
                 "trouble" if iteration < self.trouble.stop else "recovery")
        if phase != self.phase:
            self.phase = phase
            self.print(self._phase_banner(phase))
        scales = " ".join(f"r{r['rank']}={scale_text(r['loss_scale'])}" for r in self.ranks)
        skipped = Counter()
        streak = 0
        for r in self.ranks:
            for name, opt in r["optimizers"].items():
                skipped[name] = max(skipped[name], opt["skipped"])
                streak = max(streak, opt["consecutive_skipped"])
        line = (f"iteration {iteration:4d}/{self.iterations} | loss scale {scales} | skipped "
                + " ".join(f"{name}={n}" for name, n in sorted(skipped.items()))
                + (f" | skip streak {streak}" if streak else ""))
        now = time.monotonic()
        # A line when something changed, at most one a second: live, but readable in a log too.
        if line != self._last_line and now - self._last_line_at >= 1.0:
            self.print(f"{self._elapsed()} {line}")
            self._last_line, self._last_line_at = line, now

    def _phase_banner(self, phase: str) -> str:
        first, last = self.trouble.start, self.trouble.stop - 1
        return {
            "warm-up": f"--- warm-up: clean AMP steps (trouble at iterations {first}-{last}) ---",
            "trouble": f"--- trouble: rank 0's input is inf at iterations {first}-{last}; DDP's all-reduce "
                       "spreads it, so every rank skips and backs the loss scale off ---",
            "recovery": "--- recovery: clean inputs again; steps update, the scale grows back ---",
        }[phase]

    def _poll_events(self) -> None:
        if not self.ranks:
            return
        grouped: dict[tuple, list[int]] = {}
        for event in self._new_events():
            if event["kind"] == "skip":
                self.skips.append(event)
                if event["streak"] == 1:
                    grouped.setdefault(("skip", event["iteration"], event["optimizer"],
                                        _params_text(event["params"])), []).append(event["rank"])
            elif event["kind"] == "scale_change":
                grouped.setdefault((event["cause"], event["iteration"], event["before"], event["after"]),
                                   []).append(event["rank"])
            elif event["kind"] == "streak_end":
                grouped.setdefault(("streak_end", event["iteration"], event["optimizer"], event["length"]),
                                   []).append(event["rank"])
        for key, ranks in sorted(grouped.items(), key=lambda item: item[0][1]):
            self.print(f"{self._elapsed()} {_event_text(key)} (rank{'s' if len(ranks) > 1 else ''} "
                       f"{', '.join(map(str, sorted(ranks)))})")

    def _new_events(self) -> list[dict]:
        # As the status page does: re-read a minute back (batches arrive late), keep events not seen yet.
        after, new = 0, []
        while True:
            page = _get(f"{self.url}/v1/runs/{self._run_path}/events?limit=1000&after={after}"
                        f"&since={self._events_since - 60}")
            for event in page["events"]:
                key = (event["rank"], event["incarnation"], event["id"])
                if key not in self._seen:
                    self._seen.add(key)
                    new.append(event)
                    self._newest = max(self._newest, event["time"])
            if page["next"] is None:
                self._events_since = self._newest
                return sorted(new, key=lambda e: (e["iteration"], e["rank"]))
            after = page["next"]

    def _poll_alerts(self) -> None:
        alerts = _get(f"{self.url}/v1/alerts")
        ours = [a for a in alerts["firing"] + alerts["resolved"] if a["labels"].get("run") == self.run]
        for alert in ours:
            key = f"{alert['fingerprint']}@{alert['starts_at']}"
            if alert["status"] == "firing" and key not in self.firing:
                self.firing[key] = self.fired[key] = alert
                self.print(f"{self._elapsed()} ALERT FIRING   {_alert_text(alert)}")
            elif alert["status"] == "resolved" and key not in self.resolved:
                self.firing.pop(key, None)
                self.resolved[key] = alert
                self.fired.setdefault(key, alert)
                self.print(f"{self._elapsed()} ALERT RESOLVED {_alert_text(alert)} "
                           f"(fired for {alert['ends_at'] - alert['starts_at']:.1f} s)")

    def summary(self) -> str:
        """Return the closing summary: skips per optimizer, transitions, offending parameters, alerts."""
        lines = [f"Summary of run {self.run}:"]
        for r in self.ranks:
            opts = ", ".join(f"{name} skipped {o['skipped']} of {o['skipped'] + o['steps']} steps "
                             f"(longest streak {o['longest_streak']})"
                             for name, o in sorted(r["optimizers"].items()))
            lines.append(f"  rank {r['rank']}: {r['iteration']} iterations; {opts}; "
                         f"loss scale: {r['backoffs']} backoffs, {r['growths']} growths, "
                         f"now {scale_text(r['loss_scale'])}")
        offending = Counter()
        for event in self.skips:
            for param in event["params"]:
                offending[f"{event['optimizer']}: {param['name']}"] += 1
        lines.append("  offending parameters (skips that named them): "
                     + (", ".join(f"{name} x{n}" for name, n in offending.most_common(8)) or "none"))
        for key, alert in sorted(self.fired.items(), key=lambda item: item[1]["starts_at"]):
            where = ", ".join(f"{k}={v}" for k, v in sorted(alert["labels"].items()) if k != "severity")
            state = "fired, then resolved" if key in self.resolved else "fired, still firing"
            lines.append(f"  alert {alert['name']} ({alert['labels'].get('severity')}, {where}): {state}")
        if not self.fired:
            lines.append("  alerts: none fired")
        return "\n".join(lines)

    def alerts_firing(self) -> int:
        """Return how many alerts of the run fire now."""
        return len(self.firing)


def _params_text(params: list[dict]) -> str:
    return ", ".join(f"{p['name']} (inf {p['inf']}, nan {p['nan']})" for p in params[:3])


def _event_text(key: tuple) -> str:
    kind, iteration = key[0], key[1]
    if kind == "skip":
        return f"skipped: {key[2]} at iteration {iteration}, non-finite gradients in {key[3] or 'not inspected'}"
    if kind == "streak_end":
        return f"recovered: {key[2]} steps again at iteration {iteration} after {key[3]} skips in a row"
    verb = {"backoff": "backoff", "growth": "growth", "manual": "manual set"}[kind]
    return f"{verb}: loss scale {scale_text(key[2])} -> {scale_text(key[3])} at iteration {iteration}"


def _alert_text(alert: dict) -> str:
    where = " ".join(f"{key} {alert['labels'][key]}" for key in ("rank", "optimizer") if key in alert["labels"])
    return (f"{alert['name']} [{alert['labels'].get('severity')}]{' ' + where if where else ''}: "
            f"{alert['annotations'].get('summary', '')}")
