"""docker-compose.yml and deploy/: checked statically with the real docker-compose, promtool and amtool."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ampwatch.dashboards.dashboard import DATASOURCE_UID
from ampwatch.dashboards.generate import VMALERT_EVALUATION_S, VMALERT_RULES_FILE

REPO = Path(__file__).resolve().parents[2]
SERVICES = {"collector", "prometheus", "alertmanager", "grafana"}
CENTRAL = {"victoria-metrics", "vmagent", "vmalert"}  # profile "central" (docs/central-store.md)


@pytest.fixture(scope="module")
def compose() -> dict:
    """Return the compose file as docker-compose resolves it (``docker-compose config``)."""
    result = _compose_config(AMPWATCH_TOKEN="compose-test-token")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def _compose_config(**environ: str) -> subprocess.CompletedProcess:
    """Run ``docker-compose config`` with only ``environ`` of the AMPWATCH_/GRAFANA_ variables set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AMPWATCH_", "GRAFANA_"))}
    docker_compose = shutil.which("docker-compose") or "/usr/bin/docker-compose"
    if not Path(docker_compose).exists():
        pytest.fail("docker-compose is not installed: run .ci/run (it installs it from Debian)")
    return subprocess.run([docker_compose, "-f", "docker-compose.yml", "config"], cwd=REPO, env={**env, **environ},
                          capture_output=True, text=True, timeout=60)


def test_the_stack_refuses_to_start_without_an_ingest_token_and_passes_it_to_the_collector(compose):
    missing = _compose_config()
    assert missing.returncode != 0 and "set AMPWATCH_TOKEN" in missing.stderr
    assert compose["services"]["collector"]["environment"]["AMPWATCH_SERVER_TOKEN"] == "compose-test-token"


def _bind_mounts(service: dict) -> list[tuple[Path, str]]:
    mounts = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2] if isinstance(volume, str) else (volume["source"], volume["target"])
        if source.startswith("/"):
            mounts.append((Path(source), target))
    return mounts


def test_the_compose_file_has_the_four_services_with_pinned_images_and_healthchecks(compose):
    services = compose["services"]
    assert {name for name, service in services.items() if not service.get("profiles")} == SERVICES
    assert {name: service["profiles"] for name, service in services.items() if service.get("profiles")} == \
        dict.fromkeys(CENTRAL, ["central"])
    for name, service in services.items():
        assert "healthcheck" in service, name
        if name != "collector":
            assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", service["image"]), service["image"]
    assert services["collector"]["build"]["dockerfile"] == "server/Dockerfile"


def test_every_file_the_compose_file_mounts_exists(compose):
    mounts = [m for service in compose["services"].values() for m in _bind_mounts(service)]
    assert len(mounts) >= 9  # prometheus 2, alertmanager 2, grafana 3, vmagent 1, vmalert 1
    for source, target in mounts:
        assert source.exists(), f"{source} (mounted at {target}) is missing"


def test_services_reach_each_other_by_service_name_not_localhost():
    texts = [(REPO / "deploy" / "prometheus.yml").read_text(),
             (REPO / "deploy" / "grafana" / "provisioning" / "datasources" / "ampwatch.yaml").read_text()]
    assert '"collector:9457"' in texts[0] and '"alertmanager:9093"' in texts[0]
    assert "url: http://prometheus:9090" in texts[1]


def _flags(service: dict) -> dict[str, str]:
    return dict(arg.lstrip("-").split("=", 1) for arg in service["command"])


def test_the_central_profile_labels_what_vmagent_sends_with_the_cluster_and_chains_it_to_alertmanager():
    result = _compose_config(AMPWATCH_TOKEN="t", AMPWATCH_CLUSTER="eu-1")
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    vmagent, vmalert = _flags(services["vmagent"]), _flags(services["vmalert"])
    assert vmagent["remoteWrite.label"] == "cluster=eu-1"
    assert vmagent["remoteWrite.url"] == "http://victoria-metrics:8428/api/v1/write"
    assert {vmalert[k] for k in ("datasource.url", "remoteWrite.url", "remoteRead.url")} == \
        {"http://victoria-metrics:8428"}
    assert vmalert["notifier.url"] == "http://alertmanager:9093"
    # vmalert evaluates the rules generated for it, at the interval they were generated for (docs/central-store.md).
    assert vmalert["evaluationInterval"] == f"{VMALERT_EVALUATION_S}s"
    assert [source.name for source, _ in _bind_mounts(services["vmalert"])] == [VMALERT_RULES_FILE]
    # Another cluster points its scraper at the central store; without AMPWATCH_CLUSTER it is "local".
    other = _compose_config(AMPWATCH_TOKEN="t", AMPWATCH_CENTRAL_WRITE_URL="http://store.example:8428/api/v1/write")
    flags = _flags(yaml.safe_load(other.stdout)["services"]["vmagent"])
    assert (flags["remoteWrite.url"], flags["remoteWrite.label"]) == (
        "http://store.example:8428/api/v1/write", "cluster=local")


def test_vmagent_and_vmalert_accept_their_config_where_compose_mounts_it(compose, tmp_path, run_tool):
    # Rebuild each container's file layout from the compose mounts; the Debian vmagent and vmalert check it.
    for name, flag, tool in (("vmagent", "promscrape.config", "vmagent"), ("vmalert", "rule", "vmalert")):
        service = compose["services"][name]
        for source, target in _bind_mounts(service):
            dest = tmp_path / name / target.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, dest)
        path = tmp_path / name / _flags(service)[flag].lstrip("/")
        result = run_tool(tool, f"-{flag}={path}", "-dryRun", "-loggerLevel=ERROR")
        assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_accepts_the_prometheus_config(run_tool):
    result = run_tool("promtool", "check", "config", str(REPO / "deploy" / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_loads_the_generated_rules_where_compose_mounts_them(compose, tmp_path, run_tool):
    # Rebuild the container's file layout from the compose mounts, then check the config there.
    for source, target in _bind_mounts(compose["services"]["prometheus"]):
        dest = tmp_path / target.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, dest)
    result = run_tool("promtool", "check", "config", str(tmp_path / "etc/prometheus/prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"SUCCESS: \d+ rules found", result.stdout), result.stdout


def test_amtool_accepts_the_alertmanager_config(run_tool):
    result = run_tool("amtool", "check-config", str(REPO / "deploy" / "alertmanager.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_render_script_puts_the_webhook_url_from_the_environment_into_a_valid_config(tmp_path, run_tool):
    url = "https://hooks.example/ampwatch?team=ml&route=a|b"
    rendered = tmp_path / "alertmanager.yml"
    amtool = shutil.which("amtool") or "/usr/bin/amtool"
    result = subprocess.run(
        ["sh", str(REPO / "deploy" / "alertmanager-render.sh"), amtool, "check-config", str(rendered)],
        env={**os.environ, "AMPWATCH_AM_CONFIG": str(REPO / "deploy" / "alertmanager.yml"),
             "AMPWATCH_AM_RENDERED": str(rendered), "AMPWATCH_ALERT_WEBHOOK_URL": url},
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"- url: {url}   #" in rendered.read_text()
    assert "ampwatch-webhook.invalid" not in rendered.read_text().split("- url:")[1].split("\n")[0]


def test_grafana_provisions_the_data_source_uid_the_dashboard_uses(compose):
    datasources = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/ampwatch.yaml").read_text())
    assert [d["uid"] for d in datasources["datasources"]] == [DATASOURCE_UID]
    provider = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/ampwatch.yaml").read_text())
    folder = provider["providers"][0]["options"]["path"]
    mounted = {target for source, target in _bind_mounts(compose["services"]["grafana"])
               if source.name == "ampwatch-dashboard.json"}
    assert mounted == {f"{folder}/ampwatch-dashboard.json"}


def _requirements(folder: str) -> set[str]:
    """Names of the distributions ``pip install ./<folder>`` pulls in, local ones followed through."""
    import tomllib
    names = set()
    for spec in tomllib.loads((REPO / folder / "pyproject.toml").read_text())["project"]["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.-]+", spec).group(0).lower()
        names.add(name)
        if name.startswith("ampwatch-"):
            names |= _requirements(name.removeprefix("ampwatch-"))
    return names


def test_the_collector_installs_neither_grafanalib_nor_pyyaml_nor_torch():
    dockerfile = (REPO / "server" / "Dockerfile").read_text()
    copied = re.findall(r"^COPY (\S+) ", dockerfile, flags=re.M)
    assert copied == ["contract", "server"]
    assert re.search(r"pip install --no-cache-dir /src/contract /src/server\b", dockerfile)
    pulled = _requirements("server")
    assert "ampwatch-contract" in pulled and not pulled & {"grafanalib", "pyyaml", "torch", "ampwatch-dashboards"}
    assert _requirements("contract") == set()  # the contract is the standard library only


def test_the_collector_image_is_python_slim_with_the_server_and_no_torch():
    dockerfile = (REPO / "server" / "Dockerfile").read_text()
    assert re.search(r"^FROM python:\d+\.\d+\.\d+-slim", dockerfile, flags=re.M)
    assert "torch" not in dockerfile.replace("no torch", "")
    for source in re.findall(r"^COPY (\S+) ", dockerfile, flags=re.M):
        assert (REPO / source / "pyproject.toml").exists(), source
