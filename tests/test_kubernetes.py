"""deploy/kubernetes/: rendered with the real `kubectl kustomize`, checked against the image and a real collector.

The kustomization must render on a clean clone, its PrometheusRule and dashboard ConfigMap must say
exactly what dashboards/generated/ says, and the StatefulSet must run the image the way
server/Dockerfile does, with probes on endpoints a real collector answers.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import yaml

from ampwatch.dashboards.dashboard import DATASOURCE_UID
from ampwatch.dashboards.generate import DASHBOARD_FILE, RULES_FILE, stale_names
from ampwatch.dashboards.kubernetes import KUBERNETES_DIR, kubernetes_files
from ampwatch.dashboards.rules import rule_groups
from ampwatch_support.batches import APPLIED, make_batch, optimizer
from ampwatch_support.collector_process import CollectorProcess

REPO = Path(__file__).resolve().parents[1]
KUSTOMIZATION = REPO / "deploy" / "kubernetes"
DOCKERFILE = (REPO / "server" / "Dockerfile").read_text()
TOKEN_SECRET = "ampwatch-collector-token"


def _kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: run .ci/run (it installs Debian's kubernetes-client)")
    return kubectl


def _kustomize(folder: Path) -> list[dict]:
    """Return the objects `kubectl kustomize FOLDER` renders."""
    result = subprocess.run([_kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    """Return the objects `kubectl kustomize deploy/kubernetes` renders."""
    return _kustomize(KUSTOMIZATION)


def _one(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def _container(objects: list[dict]) -> dict:
    (container,) = _one(objects, "StatefulSet", "ampwatch-collector")["spec"]["template"]["spec"]["containers"]
    return container


def _environment(container: dict, namespace: str) -> dict[str, str]:
    """The container's plain variables as the kubelet sets them: the namespace from the downward API, and
    ``$(VAR)`` of a variable defined before it expanded (Secrets are left out)."""
    env: dict[str, str] = {}
    for item in container["env"]:
        if item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[item["name"]] = namespace
        elif "value" in item:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"])
    return env


def _dockerfile_env() -> dict[str, str]:
    (block,) = re.findall(r"^ENV ((?:.*\\\n)*.*)$", DOCKERFILE, re.M)
    return dict(re.findall(r"(\w+)=(\S+)", block))


def test_the_kustomization_renders_the_collector_and_its_monitoring_objects(objects):
    assert Counter((o["apiVersion"], o["kind"]) for o in objects) == Counter({
        ("apps/v1", "StatefulSet"): 1,
        ("v1", "Service"): 2,
        ("monitoring.coreos.com/v1", "ServiceMonitor"): 1,
        ("monitoring.coreos.com/v1", "PrometheusRule"): 1,
        ("v1", "ConfigMap"): 2,  # the dashboard and its data source
    })


def test_the_committed_kubernetes_files_match_the_code():
    assert stale_names(REPO / KUBERNETES_DIR, kubernetes_files()) == [], \
        "run `ampwatch-dashboards generate` and commit deploy/kubernetes/generated/"


def test_the_prometheus_rule_holds_exactly_the_generated_rule_file(objects):
    spec = _one(objects, "PrometheusRule", "ampwatch")["spec"]
    assert spec == yaml.safe_load((REPO / "dashboards" / "generated" / RULES_FILE).read_text())
    assert spec == rule_groups()
    assert sum(1 for rule in spec["groups"][0]["rules"] if "alert" in rule) >= 5


def test_the_dashboard_configmap_holds_the_generated_dashboard_for_the_grafana_sidecar(objects):
    configmap = _one(objects, "ConfigMap", "ampwatch-grafana-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert list(configmap["data"]) == [DASHBOARD_FILE]
    assert json.loads(configmap["data"][DASHBOARD_FILE]) == \
        json.loads((REPO / "dashboards" / "generated" / DASHBOARD_FILE).read_text())


def test_the_datasource_configmap_gives_grafana_the_uid_the_dashboard_queries(objects):
    configmap = _one(objects, "ConfigMap", "ampwatch-grafana-datasource")
    assert configmap["metadata"]["labels"]["grafana_datasource"] == "1"
    (source,) = yaml.safe_load(configmap["data"]["ampwatch-datasource.yaml"])["datasources"]
    assert source["uid"] == DATASOURCE_UID and source["type"] == "prometheus"


def test_the_container_runs_the_image_as_the_dockerfile_does(objects):
    container = _container(objects)
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", DOCKERFILE, re.M).group(1))
    assert container["command"] == entrypoint
    assert "CMD [" not in DOCKERFILE and "args" not in container  # no arguments either way
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert {name: env[name] for name in _dockerfile_env()} == _dockerfile_env()
    (port,) = container["ports"]
    assert str(port["containerPort"]) == env["AMPWATCH_SERVER_PORT"] == re.search(r"^EXPOSE (\d+)$", DOCKERFILE,
                                                                                  re.M).group(1)
    pod = _one(objects, "StatefulSet", "ampwatch-collector")["spec"]["template"]["spec"]
    assert str(pod["securityContext"]["runAsUser"]) == re.search(r"--uid (\d+)", DOCKERFILE).group(1)
    requests = container["resources"]["requests"]
    assert requests["cpu"] and requests["memory"]


def test_each_replica_keeps_its_database_on_its_own_volume(objects):
    statefulset = _one(objects, "StatefulSet", "ampwatch-collector")
    container = _container(objects)
    db = Path(next(e["value"] for e in container["env"] if e["name"] == "AMPWATCH_SERVER_DB"))
    (mount,) = container["volumeMounts"]
    assert db.parent == Path(mount["mountPath"])
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == mount["name"]
    assert not statefulset["spec"]["template"]["spec"].get("volumes")  # not a shared volume


def test_the_ingest_token_comes_from_the_secret(objects):
    (token,) = [e for e in _container(objects)["env"] if e["name"] == "AMPWATCH_SERVER_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": TOKEN_SECRET, "key": "token"}
    # The command that creates it is the one the docs give.
    for doc in ("docs/collector.md",):  # the README links its section on Kubernetes
        assert f"create secret generic {TOKEN_SECRET} --from-literal=token=" in (REPO / doc).read_text(), doc


def test_services_reach_the_pods_and_the_servicemonitor_scrapes_each_replica_once(objects):
    statefulset = _one(objects, "StatefulSet", "ampwatch-collector")
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    port_names = {p["name"] for p in _container(objects)["ports"]}
    services = [o for o in objects if o["kind"] == "Service"]
    for service in services:
        assert service["spec"]["selector"].items() <= pod_labels.items(), service["metadata"]["name"]
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    headless = _one(objects, "Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    monitor = _one(objects, "ServiceMonitor", "ampwatch-collector")
    selected = [s for s in services
                if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in selected] == ["ampwatch-collector"]  # the headless one would double it
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in selected[0]["spec"]["ports"]}


@pytest.mark.slow
def test_a_real_collector_configured_as_the_manifest_says_answers_the_probes_and_requires_the_token(objects, tmp_path):
    container = _container(objects)
    probes = {kind: container[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {p["port"] for p in probes.values()} == {"http"}
    assert {p["path"] for p in probes.values()} == {"/healthz", "/readyz"}
    env = _environment(container, namespace="ampwatch")
    env["AMPWATCH_SERVER_TOKEN"] = "k8s-test-token"  # what the Secret would hold
    env["AMPWATCH_SERVER_HOST"] = "127.0.0.1"          # loopback here; the manifest's 0.0.0.0 is checked above
    # CollectorProcess passes --port and --db, which win over the manifest's env (checked above).
    with CollectorProcess(db=str(tmp_path / "c.db"), env=env) as collector:
        for kind, probe in probes.items():
            with urllib.request.urlopen(collector.url + probe["path"], timeout=10) as answer:
                assert answer.status == 200, kind
        # The names agents use (README: each replica under the headless Service) are served; others are not.
        for host, status in (("ampwatch-collector-0.ampwatch-collector-replicas.ampwatch.svc", 200),
                             ("ampwatch-collector-1.ampwatch-collector-replicas.ampwatch.svc.cluster.local", 200),
                             ("ampwatch-collector.ampwatch.svc", 200), ("ampwatch-collector", 200),
                             ("ampwatch-collector.attacker.example", 421)):
            request = urllib.request.Request(collector.url + "/healthz", headers={"Host": f"{host}:9457"})
            try:
                with urllib.request.urlopen(request, timeout=10) as answer:
                    assert answer.status == status, host
            except urllib.error.HTTPError as refused:
                assert refused.code == status, host
        body = json.dumps(make_batch(optimizers={"gen": optimizer(steps=3)})).encode()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(collector.url + "/v1/ingest", data=body), timeout=10)
        assert refused.value.code == 401
        request = urllib.request.Request(collector.url + "/v1/ingest", data=body,
                                         headers={"Authorization": "Bearer k8s-test-token",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert json.loads(answer.read()) == APPLIED


def test_the_overlay_of_the_docs_sets_namespace_image_replicas_labels_and_prometheus_url(tmp_path):
    version = subprocess.run([_kubectl(), "version", "--client"], capture_output=True, text=True, timeout=60).stdout
    if "Kustomize Version: v" not in version:  # kubectl before 1.21 (Debian 12's) embeds kustomize v2
        pytest.skip(f"the documented overlay needs kubectl 1.21 or later; this one: {version.strip()}")
    docs = (REPO / "docs" / "collector.md").read_text()
    overlay = re.search(r"`my-overlay/kustomization.yaml`.*?```yaml\n(.*?)```", docs, re.S).group(1)
    (tmp_path / "my-overlay").mkdir()
    (tmp_path / "my-overlay" / "kustomization.yaml").write_text(overlay)
    (tmp_path / "deploy").symlink_to(REPO / "deploy")
    rendered = _kustomize(tmp_path / "my-overlay")
    assert {o["metadata"].get("namespace") for o in rendered} == {"ampwatch"}
    statefulset = _one(rendered, "StatefulSet", "ampwatch-collector")
    assert statefulset["spec"]["replicas"] == 2
    env = {e["name"]: e.get("value") for e in _container(rendered)["env"]}
    agents = re.search(r"name: AMPWATCH_URL\n\s+value: (\S+)", docs).group(1)
    assert env["AMPWATCH_SERVER_PEERS"] == agents  # the replicas place runs on the list the agents place them on
    for replica in range(2):  # and each finds itself in it
        pod = env["AMPWATCH_SERVER_ADVERTISE_URL"].replace("$(POD_NAME)", f"ampwatch-collector-{replica}")
        assert pod.replace("$(POD_NAMESPACE)", "ampwatch") == agents.split(",")[replica]
    assert _container(rendered)["image"] == "registry.example.com/ml/ampwatch-collector:0.1.0"
    for kind, name in (("ServiceMonitor", "ampwatch-collector"), ("PrometheusRule", "ampwatch")):
        assert _one(rendered, kind, name)["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    datasource = _one(rendered, "ConfigMap", "ampwatch-grafana-datasource")["data"]["ampwatch-datasource.yaml"]
    (source,) = yaml.safe_load(datasource)["datasources"]
    assert source["uid"] == DATASOURCE_UID and source["url"] == "http://prometheus-operated.monitoring.svc:9090"


CENTRAL_OVERLAY = REPO / "deploy" / "overlays" / "central"


def _vmagent_args(objects: list[dict]) -> dict[str, str]:
    """The vmagent container's flags as the kubelet runs them: ``$(VAR)`` expanded from the ConfigMap keys."""
    (container,) = _one(objects, "Deployment", "ampwatch-vmagent")["spec"]["template"]["spec"]["containers"]
    env = {}
    for item in container["env"]:
        ref = item["valueFrom"]["configMapKeyRef"]
        env[item["name"]] = _one(objects, "ConfigMap", ref["name"])["data"][ref["key"]]
    expanded = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in container["args"]]
    return dict(arg.lstrip("-").split("=", 1) for arg in expanded)


def test_the_central_overlay_runs_vmagent_remote_writing_with_the_cluster_label_and_no_operator_objects(tmp_path):
    objects = _kustomize(CENTRAL_OVERLAY)
    kinds = Counter(o["kind"] for o in objects)
    # The central store's vmalert evaluates the rules: no PrometheusRule, no ServiceMonitor, no operator needed.
    assert kinds["PrometheusRule"] == kinds["ServiceMonitor"] == 0
    assert _one(objects, "StatefulSet", "ampwatch-collector")  # the base's collector, as it is
    args = _vmagent_args(objects)
    assert args["remoteWrite.label"] == "cluster=my-cluster"
    assert args["remoteWrite.url"] == "http://victoria-metrics.central.example.com:8428/api/v1/write"
    # The scrape config it mounts is one the Debian vmagent accepts (strictly: no unknown field) ...
    pod = _one(objects, "Deployment", "ampwatch-vmagent")["spec"]["template"]["spec"]
    (config,) = [v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v]
    (mount,) = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] == "config"]
    scrape = tmp_path / Path(args["promscrape.config"]).relative_to(mount)
    scrape.write_text(_one(objects, "ConfigMap", config)["data"][scrape.name])
    check = subprocess.run([shutil.which("vmagent") or "/usr/bin/vmagent", f"-promscrape.config={scrape}", "-dryRun",
                            "-loggerLevel=ERROR"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    # ... that keeps the Service the base labels for scraping (each replica once), and the Role lets it list it.
    (job,) = yaml.safe_load(scrape.read_text())["scrape_configs"]
    keep = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"]
            if r.get("action") == "keep"}
    service = _one(objects, "Service", "ampwatch-collector")
    assert keep[("__meta_kubernetes_service_label_ampwatch_dev_scrape",)] == \
        service["metadata"]["labels"]["ampwatch.dev/scrape"]
    assert keep[("__meta_kubernetes_endpoint_port_name",)] == service["spec"]["ports"][0]["name"]
    binding = _one(objects, "RoleBinding", "ampwatch-vmagent")
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]
    assert {"endpoints", "services", "pods"} <= set(_one(objects, "Role", binding["roleRef"]["name"])["rules"][0]
                                                    ["resources"])


def test_the_central_overlays_documented_cluster_name_and_store_url_reach_vmagent(tmp_path):
    # The overlay's own comment shows how to set them; that snippet, in an overlay on top of it, does.
    text = (CENTRAL_OVERLAY / "kustomization.yaml").read_text()
    snippet = re.search(r"your own overlay on top of this one:\n#\n((?:#   .*\n)+)", text).group(1)
    (tmp_path / "eu-1").mkdir()
    (tmp_path / "eu-1" / "kustomization.yaml").write_text(
        "resources: [../central]\n" + re.sub(r"^#   ", "", snippet, flags=re.M))
    (tmp_path / "central").symlink_to(CENTRAL_OVERLAY)
    (tmp_path / "kubernetes").symlink_to(KUSTOMIZATION)
    args = _vmagent_args(_kustomize(tmp_path / "eu-1"))
    assert args["remoteWrite.label"] == "cluster=eu-1"
    assert args["remoteWrite.url"] == "https://vminsert.example.com/insert/0/prometheus/api/v1/write"
