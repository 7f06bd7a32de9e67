"""Write (or check) the generated rule file and dashboard JSON in ``dashboards/generated/`` (and any other files)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS, AlertThresholds

from .dashboard import render_dashboard
from .rules import DEFAULT_RUNBOOK_BASE_URL, render_rules

__all__ = ["DASHBOARD_FILE", "NEW_SERIES_DELAY_S", "RULES_FILE", "VMALERT_EVALUATION_S", "VMALERT_RULES_FILE",
           "for_vmalert", "generated_files", "stale_files", "stale_names", "write_files",
           "write_generated"]

RULES_FILE = "ampwatch-rules.yaml"
DASHBOARD_FILE = "ampwatch-dashboard.json"
VMALERT_RULES_FILE = "ampwatch-rules-vmalert.yaml"
"""The same rules for vmalert against a central store (docs/central-store.md): only ``storm_edge_for_s`` differs."""

NEW_SERIES_DELAY_S = 10
"""How long VictoriaMetrics (1.79, measured) takes to show a new series to queries: vmalert writes a recording
rule's result to the store and the next rule reads it back, so each level of recordings whose series appear with
an event (non-zero, alerting, ranks, share) comes up to an evaluation and this much later."""

VMALERT_EVALUATION_S = 15
"""vmalert's ``-evaluationInterval`` that :data:`VMALERT_RULES_FILE` is generated for (docker-compose.yml's)."""


def for_vmalert(t: AlertThresholds, evaluation_s: int = VMALERT_EVALUATION_S) -> AlertThresholds:
    """Return ``t`` for vmalert evaluating every ``evaluation_s`` seconds: a per-rank alert that a run-wide one
    speaks for waits out the chain of recordings the run-wide one reads (the per-rank alert's own level, then
    alerting, ranks, share, and one for good measure), in Prometheus a single evaluation."""
    return dataclasses.replace(t, storm_edge_for_s=max(t.storm_edge_for_s, 5 * (evaluation_s + NEW_SERIES_DELAY_S)))


def generated_files(
    t: AlertThresholds = DEFAULT_THRESHOLDS,
    runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL,
) -> dict[str, str]:
    """Return every generated file as ``{file name: content}``."""
    return {RULES_FILE: render_rules(t, runbook_base_url), DASHBOARD_FILE: render_dashboard(t),
            VMALERT_RULES_FILE: render_rules(for_vmalert(t), runbook_base_url)}


def write_generated(out_dir: Path, t: AlertThresholds = DEFAULT_THRESHOLDS,
                    runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> list[Path]:
    """Write the generated files into ``out_dir`` and return their paths."""
    return write_files(out_dir, generated_files(t, runbook_base_url))


def stale_files(out_dir: Path, t: AlertThresholds = DEFAULT_THRESHOLDS,
                runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL) -> list[str]:
    """Return the names of generated files in ``out_dir`` that are missing or differ from the code."""
    return stale_names(out_dir, generated_files(t, runbook_base_url))


def write_files(out_dir: Path, files: dict[str, str]) -> list[Path]:
    """Write ``files`` (``{name: content}``) into ``out_dir`` and return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in files.items():
        path = out_dir / name
        path.write_text(content, encoding="utf-8")
        written.append(path)
    return written


def stale_names(out_dir: Path, files: dict[str, str]) -> list[str]:
    """Return the names of ``files`` that are missing from ``out_dir`` or differ there."""
    return [name for name, content in files.items()
            if not (out_dir / name).is_file() or (out_dir / name).read_text(encoding="utf-8") != content]
