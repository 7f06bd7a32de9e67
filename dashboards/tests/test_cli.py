"""The `ampwatch-dashboards generate` command: writes the files, and --check catches drift."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ampwatch.dashboards.generate import DASHBOARD_FILE, RULES_FILE, VMALERT_RULES_FILE, generated_files
from ampwatch.dashboards.kubernetes import DASHBOARD_CONFIGMAP_FILE, PROMETHEUS_RULE_FILE, kubernetes_files


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ampwatch.dashboards", *args],
                          capture_output=True, text=True, timeout=60)


def _outs(tmp_path: Path) -> list[str]:
    return ["--out", str(tmp_path / "generated"), "--kubernetes-out", str(tmp_path / "kubernetes")]


def test_generate_writes_the_rules_and_the_dashboard_and_their_kubernetes_objects(tmp_path):
    result = _cli("generate", *_outs(tmp_path))
    assert result.returncode == 0, result.stderr
    generated, kubernetes = tmp_path / "generated", tmp_path / "kubernetes"
    assert sorted(p.name for p in generated.iterdir()) == sorted([RULES_FILE, DASHBOARD_FILE, VMALERT_RULES_FILE])
    assert (generated / RULES_FILE).read_text() == generated_files()[RULES_FILE]
    assert sorted(p.name for p in kubernetes.iterdir()) == sorted([PROMETHEUS_RULE_FILE, DASHBOARD_CONFIGMAP_FILE])
    assert (kubernetes / PROMETHEUS_RULE_FILE).read_text() == kubernetes_files()[PROMETHEUS_RULE_FILE]


@pytest.mark.parametrize("folder, name, old, new", [
    ("generated", RULES_FILE, "for: 2m", "for: 9m"),
    ("kubernetes", PROMETHEUS_RULE_FILE, "for: 2m", "for: 9m"),
    ("kubernetes", DASHBOARD_CONFIGMAP_FILE, "grafana_dashboard: '1'", "grafana_dashboard: '0'"),
])
def test_check_passes_on_fresh_files_and_fails_naming_the_stale_one(tmp_path, folder, name, old, new):
    _cli("generate", *_outs(tmp_path))
    assert _cli("generate", "--check", *_outs(tmp_path)).returncode == 0
    stale = tmp_path / folder / name
    assert old in stale.read_text()
    stale.write_text(stale.read_text().replace(old, new))
    result = _cli("generate", "--check", *_outs(tmp_path))
    assert result.returncode == 1
    assert f"out of date in {tmp_path / folder}: {name}; run `ampwatch-dashboards generate`" in result.stderr


def test_a_custom_runbook_base_url_is_used_in_every_alert(tmp_path):
    _cli("generate", *_outs(tmp_path), "--runbook-base-url", "https://wiki.example/ampwatch")
    for written in (tmp_path / "generated" / RULES_FILE, tmp_path / "kubernetes" / PROMETHEUS_RULE_FILE):
        assert "runbook_url: https://wiki.example/ampwatch#amprankSilent".lower() in written.read_text().lower()
