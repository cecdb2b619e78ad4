"""docker/k8s/, offline: the core kinds against the Kubernetes schemas (kubernetes-validate), and what no schema
checks: the probes, grace period, Service, ServiceMonitor, HPA and Prometheus adapter rule fit together."""

import re

import kubernetes_validate
import pytest
import yaml

from tests.helpers.deploy_files import DOCKERFILES, REPO, parse_dockerfile

K8S = REPO / "docker" / "k8s"
CORE_API_VERSIONS = {"v1", "apps/v1", "autoscaling/v2"}
# The oldest Kubernetes still in wide use, and the newest schema kubernetes-validate ships.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
DEFAULT_SHUTDOWN_TIMEOUT = 30  # kvserve serve --shutdown-timeout
SETUPS_BESIDE = ("router", "llm-d")  # set-ups in front of these pods, checked in test_k8s_router.py


def manifests() -> list[dict]:
    docs = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.relative_to(K8S).parts[0] not in SETUPS_BESIDE:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def one(kind: str) -> dict:
    (doc,) = [d for d in manifests() if d["kind"] == kind]
    return doc


def container() -> dict:
    (c,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def env_value(c: dict, name: str) -> str | None:
    return next((e.get("value") for e in c.get("env", []) if e["name"] == name), None)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("version", VERSIONS)
def test_core_kinds_validate(version):
    docs = [d for d in manifests() if d["apiVersion"] in CORE_API_VERSIONS]
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises with the failing field


@pytest.mark.timeout(10)
def test_deployment_probes_and_graceful_shutdown():
    spec = one("Deployment")["spec"]["template"]["spec"]
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000}, "the image EXPOSEs 8000"

    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert (get["path"], get["port"]) == ("/health", "http"), probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, (
        "startup must allow a first model load"
    )

    # The kubelet counts the grace period from the start of preStop: it must cover the pause and the drain.
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    pause = int(command[1])
    shutdown = int(env_value(c, "KVSERVE_SHUTDOWN_TIMEOUT") or DEFAULT_SHUTDOWN_TIMEOUT)
    assert spec["terminationGracePeriodSeconds"] >= pause + shutdown + 5

    # The pod runs as the image's non-root user.
    for path in DOCKERFILES.values():
        user = [i.args for i in parse_dockerfile(path) if i.keyword == "USER"][-1]
        assert str(spec["securityContext"]["runAsUser"]) == user.split(":")[0], path.name
    assert spec["securityContext"]["runAsNonRoot"] is True

    (api_key,) = [e for e in c["env"] if e["name"] == "KVSERVE_API_KEY"]
    assert api_key["valueFrom"]["secretKeyRef"].get("optional") is True, "the API key must stay optional"


@pytest.mark.timeout(10)
def test_service_selects_the_pods_with_client_affinity():
    deployment, service = one("Deployment"), one("Service")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    container_ports = {p["name"] for p in container()["ports"]} | {
        p["containerPort"] for p in container()["ports"]
    }
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in container_ports, port
    assert service["spec"]["sessionAffinity"] == "ClientIP", "affinity keeps clients on their prefix cache"


@pytest.mark.timeout(10)
def test_servicemonitor_scrapes_the_service():
    monitor, service = one("ServiceMonitor"), one("Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["name"]
    spec = monitor["spec"]
    assert spec["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items(), (
        "the ServiceMonitor selects Services by their own labels"
    )
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert spec["endpoints"], "no endpoints to scrape"
    for endpoint in spec["endpoints"]:
        assert endpoint["port"] in port_names, endpoint
        assert endpoint.get("path", "/metrics") == "/metrics"
        if "interval" in endpoint:
            assert re.fullmatch(r"\d+[smh]", endpoint["interval"]), endpoint["interval"]
    namespaces = spec.get("namespaceSelector", {})
    assert (
        namespaces.get("any")
        or not namespaces.get("matchNames")
        or (service["metadata"].get("namespace", "default") in namespaces["matchNames"])
    )


@pytest.mark.timeout(10)
def test_hpa_metric_is_served_by_the_adapter_rule():
    hpa, deployment = one("HorizontalPodAutoscaler"), one("Deployment")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        deployment["apiVersion"],
        deployment["kind"],
        deployment["metadata"]["name"],
    )
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert wanted == {"kvserve:num_requests_waiting"}

    configmaps = [d for d in manifests() if d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {})]
    assert configmaps, "the Prometheus adapter rule is missing"
    rules = [r for cm in configmaps for r in yaml.safe_load(cm["data"]["config.yaml"])["rules"]]
    served = {}
    for rule in rules:
        series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"].strip("'\" "))
        assert series, f"seriesQuery must name its series: {rule['seriesQuery']}"
        name = rule.get("name", {})
        matches, exposed = name.get("matches", ".*"), name.get("as", "$0")
        # The adapter's `as` uses Go's ${1} / $1 groups.
        exposed = re.sub(r"\$\{?(\d+)\}?", r"\\\1", exposed)
        served[re.sub(matches, exposed, series.group(0))] = rule
    assert wanted <= served.keys(), f"the adapter serves {sorted(served)}"
    for metric in wanted:
        rule = served[metric]
        overrides = rule["resources"]["overrides"]
        # A Pods metric needs the series' pod and namespace labels mapped to those resources.
        assert {overrides[label]["resource"] for label in ("namespace", "pod")} == {"namespace", "pod"}
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
        assert "<<.GroupBy>>" in rule["metricsQuery"]
        # The series is one the server exports (tests/deploy/test_prometheus_scrape.py sees it scraped).
        exported = metric.removeprefix("kvserve:")
        assert f'"{exported}"' in (REPO / "server/api/metrics.py").read_text(), exported


@pytest.mark.timeout(10)
def test_kubectl_apply_of_the_folder_leaves_the_adapter_config_alone():
    """`kubectl apply -f docker/k8s/` is not recursive: the adapter ConfigMap (which replaces the adapter's
    whole configuration) must sit in a sub-folder, applied on purpose."""
    top = [d for p in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    assert not [d for d in top if d["kind"] == "ConfigMap"]
    assert {d["kind"] for d in top} == {"Deployment", "Service", "HorizontalPodAutoscaler", "ServiceMonitor"}
