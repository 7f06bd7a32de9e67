"""The `ampwatch-dashboards generate` command: writes the files, and --check catches drift."""

from __future__ import annotations

import subprocess
import sys

from ampwatch.dashboards.generate import DASHBOARD_FILE, RULES_FILE, generated_files


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ampwatch.dashboards", *args],
                          capture_output=True, text=True, timeout=60)


def test_generate_writes_the_rules_and_the_dashboard(tmp_path):
    result = _cli("generate", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([RULES_FILE, DASHBOARD_FILE])
    assert (tmp_path / RULES_FILE).read_text() == generated_files()[RULES_FILE]


def test_check_passes_on_fresh_files_and_fails_naming_the_stale_one(tmp_path):
    _cli("generate", "--out", str(tmp_path))
    assert _cli("generate", "--check", "--out", str(tmp_path)).returncode == 0
    rules = tmp_path / RULES_FILE
    rules.write_text(rules.read_text().replace("for: 2m", "for: 9m"))
    result = _cli("generate", "--check", "--out", str(tmp_path))
    assert result.returncode == 1
    assert f"out of date in {tmp_path}: {RULES_FILE}; run `ampwatch-dashboards generate`" in result.stderr


def test_a_custom_runbook_base_url_is_used_in_every_alert(tmp_path):
    _cli("generate", "--out", str(tmp_path), "--runbook-base-url", "https://wiki.example/ampwatch")
    assert "runbook_url: https://wiki.example/ampwatch#amprankSilent".lower() in (tmp_path / RULES_FILE).read_text().lower()
