"""Write (or check) the generated rule file and dashboard JSON in ``dashboards/generated/`` (and any other files)."""

from __future__ import annotations

from pathlib import Path

from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS, AlertThresholds

from .dashboard import render_dashboard
from .rules import DEFAULT_RUNBOOK_BASE_URL, render_rules

__all__ = ["DASHBOARD_FILE", "RULES_FILE", "generated_files", "stale_files", "stale_names", "write_files",
           "write_generated"]

RULES_FILE = "ampwatch-rules.yaml"
DASHBOARD_FILE = "ampwatch-dashboard.json"


def generated_files(
    t: AlertThresholds = DEFAULT_THRESHOLDS,
    runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL,
) -> dict[str, str]:
    """Return every generated file as ``{file name: content}``."""
    return {RULES_FILE: render_rules(t, runbook_base_url), DASHBOARD_FILE: render_dashboard(t)}


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
