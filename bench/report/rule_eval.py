"""Section 7's Prometheus part: rule evaluation and the dashboard's queries, earlier rules beside these."""

from __future__ import annotations

from bench.report._format import SIDES, fmt, measured_by, side_rows

__all__ = ["section"]


def section(r: dict | None) -> list[str]:
    """The part's lines, or none when ``bench.experiments.rule_eval`` has not stored a result."""
    if not r:
        return []
    lines = [f"Prometheus rule evaluation at {fmt(r['ranks'])} ranks x {r['optimizers']} optimizers, the earlier "
             "commit's rules beside these:", "",
             "| | rules | group median ms | % of interval | group max ms | % of interval | CPU s per interval |",
             "|---|---|---|---|---|---|---|"]
    lines += side_rows(r, lambda name, x: f"| {name} | {x['rules']} | {fmt(x['group_median_s'] * 1000)} | "
                                          f"{fmt(x['median_percent_of_interval'])}% | {fmt(x['group_max_s'] * 1000)} | "
                                          f"{fmt(x['max_percent_of_interval'])}% | {fmt(x['cpu_s_per_interval'], 2)} |")
    lines += ["", f"{fmt(r['series'])} series evaluated every {r['interval_s']} s over full 30-minute windows "
              f"({fmt(r['samples_per_series_in_30m'])} samples per series in 30m), the real Prometheus, both rule "
              "sets side by side on the same data, a whole-job storm's streak alerts firing "
              f"({fmt(r['after']['firing'].get('AmpConsecutiveSkippedSteps (warning)', 0))} instances). Wall-clock "
              f"times over {r['after']['evaluations']} evaluations each, as `/api/v1/rules` reports them (they "
              "stretch when other jobs share this machine's 2 cores: the caption gives the load), and the CPU each "
              "Prometheus used per interval (evaluation, scrape, the bench's reads)."]
    keys = list(r["before"]["per_rule_ms"])[:6]
    lines += ["", "The heaviest rules before, median ms (after: the same rule; the recording rules it now reads are "
              "in the JSON):", "", "| rule | before | after |", "|---|---|---|"]
    for key in keys:
        after = r["after"]["per_rule_ms"].get(key)
        lines.append(f"| {key} | {fmt(r['before']['per_rule_ms'][key]['median'])} | "
                     f"{fmt(after['median']) if after else '-'} |")
    heaviest = r["after"].get("heaviest_alert")
    if heaviest:
        lines += ["", f"Of the {fmt(heaviest['median_ms'])} ms of {heaviest['rule']} ({fmt(heaviest['instances'])} "
                  f"instances), its expression alone takes {fmt(heaviest['expression_alone_ms'])} ms: the rest is "
                  "Prometheus building the alerts, templating each instance's label and annotations at every "
                  "evaluation, which no rewrite of the expression removes."]
    dash = [r[side].get("dashboard") for side in SIDES]
    if all(dash):
        lines += ["", "The dashboard's queries over its last 30 minutes at 15 s steps, as Grafana sends them (tables: "
                  "instant):", "", "| | panels | most series in one panel | panels over 100 series | MB in all |",
                  "|---|---|---|---|---|"]
        for side, d in zip(SIDES, dash, strict=True):
            lines.append(f"| {side} | {d['panels']} | {fmt(d['max_series'])} | {d['panels_over_100_series']} | "
                         f"{fmt(d['bytes'] / 1e6, 1)} |")
        big = [title for title, cost in dash[1]["per_panel"].items() if cost["series"] > 100]
        if big:
            lines += ["", f"Over 100 series after: {', '.join(big)} (one row per firing alert instance, the storm's "
                      "included)."]
    lines += ["", f"{measured_by(r)}.", ""]
    return lines
