"""The set-ups that put kvserve replicas behind a router, offline: docker/compose.router.yaml,
docker/Dockerfile.router, docker/k8s/router/ (SGLang's model gateway) and docker/k8s/llm-d/ (a Gateway API
InferencePool for llm-d's endpoint picker).

What is checked how: the core kinds (Deployment, Service, ServiceAccount, Role, RoleBinding, ConfigMap)
against the Kubernetes schemas (kubernetes-validate); every router flag by the pinned router's own argument
parser (sglang-router, a test extra); the InferencePool, the HTTPRoute and the endpoint picker's configuration
by structure only (their CRDs are not vendored here): the fields they use, and that they point at the kvserve
pods, port and metrics. tests/reliability/test_router.py runs the router itself against live replicas.
"""

import re
import subprocess
import tomllib

import kubernetes_validate
import pytest
import yaml
from sglang_router.launch_router import parse_router_args

from tests.helpers.deploy_files import DOCKER, REPO, parse_dockerfile, venv_tool

K8S = DOCKER / "k8s"
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
DEFAULT_SHUTDOWN_TIMEOUT = 30  # kvserve serve --shutdown-timeout
# llm-d's endpoint picker reads these by default (its --*-metric flags)
EPP_METRICS = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
               "vllm:cache_config_info")  # fmt: skip

pytestmark = pytest.mark.timeout(60)


def docs(path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(items: list[dict]) -> dict[str, dict]:
    out = {}
    for d in items:
        assert d["kind"] not in out, f"two {d['kind']}s"
        out[d["kind"]] = d
    return out


def kvserve_pods() -> tuple[dict, int]:
    """The kvserve Deployment's pod labels and container port (docker/k8s/deployment.yaml)."""
    (deployment,) = [d for d in docs(K8S / "deployment.yaml") if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment["spec"]["template"]["metadata"]["labels"], container["ports"][0]["containerPort"]


def pinned_router() -> str:
    test_extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "test"
    ]
    (spec,) = [r for r in test_extra if r.startswith("sglang-router")]
    return spec


def flag(args: list[str], name: str) -> str:
    """The value of --name=value or --name value."""
    for i, a in enumerate(args):
        if a.startswith(f"{name}="):
            return a.split("=", 1)[1]
        if a == name:
            return args[i + 1]
    raise AssertionError(f"{name} not given")


@pytest.mark.parametrize("version", VERSIONS)
def test_core_kinds_validate(version):
    items = docs(K8S / "router" / "router.yaml") + docs(K8S / "llm-d" / "inferencepool.yaml")
    core = [d for d in items if d["apiVersion"] in {"v1", "apps/v1", "rbac.authorization.k8s.io/v1"}]
    assert {d["kind"] for d in core} == {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Deployment",
        "Service",
        "ConfigMap",
    }
    for doc in core:
        kubernetes_validate.validate(doc, version, strict=True)


def test_router_discovers_the_kvserve_pods_with_the_rights_it_needs():
    kinds = by_kind(docs(K8S / "router" / "router.yaml"))
    deployment, service = kinds["Deployment"], kinds["Service"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = container["args"]
    parsed = parse_router_args(args)  # SystemExit on a flag the pinned router does not know
    assert parsed.policy == "cache_aware" and parsed.service_discovery
    labels, port = kvserve_pods()
    assert parsed.selector and parsed.selector.items() <= labels.items(), parsed.selector
    assert parsed.service_discovery_port == port
    assert flag(args, "--service-discovery-namespace") == "$(POD_NAMESPACE)"
    assert any(e["name"] == "POD_NAMESPACE" for e in container["env"])

    # the service account may watch pods, and the pods run as it
    account = kinds["ServiceAccount"]["metadata"]["name"]
    assert pod["spec"]["serviceAccountName"] == account
    binding, role = kinds["RoleBinding"], kinds["Role"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"] and binding["roleRef"]["kind"] == "Role"
    assert {"kind": "ServiceAccount", "name": account} in binding["subjects"]
    (rule,) = role["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])

    # the Service reaches the router's port; the router's own labels do not select kvserve pods
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == parsed.port and ports["metrics"] == parsed.prometheus_port
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports.keys()
    assert not labels.items() <= pod["metadata"]["labels"].items()
    # the image's user
    user = [i.args for i in parse_dockerfile(DOCKER / "Dockerfile.router") if i.keyword == "USER"][-1]
    assert str(pod["spec"]["securityContext"]["runAsUser"]) == user.split(":")[0]


def test_router_image_installs_the_tested_router():
    instructions = parse_dockerfile(DOCKER / "Dockerfile.router")
    (install,) = [i.args for i in instructions if i.keyword == "RUN" and "pip install" in i.args]
    assert pinned_router() in install.split(), "the image runs the version the tests run"
    (entrypoint,) = [i.exec_form() for i in instructions if i.keyword == "ENTRYPOINT"]
    assert entrypoint == ["python", "-m", "sglang_router.launch_router"]
    lint = subprocess.run([venv_tool("hadolint"), "--failure-threshold", "warning", str(DOCKER / "Dockerfile.router")],
                          capture_output=True, text=True)  # fmt: skip
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_compose_puts_every_replica_behind_the_router():
    spec = yaml.safe_load((DOCKER / "compose.router.yaml").read_text())
    services = spec["services"]
    replicas = {n: s for n, s in services.items() if n.startswith("kvserve")}
    assert len(replicas) >= 2
    router = services["router"]
    parsed = parse_router_args(router["command"])
    assert parsed.policy == "cache_aware"
    _, port = kvserve_pods()
    assert sorted(parsed.worker_urls) == sorted(f"http://{n}:{port}" for n in replicas)
    assert set(router["depends_on"]) == set(replicas)
    assert all(d["condition"] == "service_healthy" for d in router["depends_on"].values())
    assert any(p.startswith(f"{parsed.port}:") for p in router["ports"])
    assert (REPO / router["build"]["dockerfile"]).is_file()
    for name, service in replicas.items():
        assert service["build"]["dockerfile"] == "docker/Dockerfile"
        assert "ports" not in service, f"{name}: clients go through the router"
        env = dict(e.partition("=")[::2] for e in service["environment"])
        shutdown = float(env.get("KVSERVE_SHUTDOWN_TIMEOUT") or DEFAULT_SHUTDOWN_TIMEOUT)
        grace = int(re.fullmatch(r"(\d+)s", service["stop_grace_period"]).group(1))
        assert grace >= shutdown + 5, f"{name}: SIGKILL would cut the drain short"
    # the router notices a draining replica (503 on /health) well within its drain
    assert parsed.health_check_interval_secs * parsed.health_failure_threshold < DEFAULT_SHUTDOWN_TIMEOUT


def test_inference_pool_selects_the_kvserve_pods():
    kinds = by_kind(docs(K8S / "llm-d" / "inferencepool.yaml"))
    pool, route = kinds["InferencePool"], kinds["HTTPRoute"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    labels, port = kvserve_pods()
    spec = pool["spec"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in spec["targetPorts"]] == [port]
    picker = spec["endpointPickerRef"]
    assert picker["name"] and 0 < picker["port"]["number"] < 65536

    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool["metadata"]["name"],
    )
    assert route["spec"]["parentRefs"][0]["kind"] == "Gateway"


def test_endpoint_picker_config_is_complete_and_reads_metrics_kvserve_exports():
    config = yaml.safe_load(
        by_kind(docs(K8S / "llm-d" / "inferencepool.yaml"))["ConfigMap"]["data"]["config.yaml"]
    )
    assert config["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    assert config["kind"] == "EndpointPickerConfig"
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    types = {p["type"] for p in config["plugins"]}
    assert "prefix-cache-scorer" in types and "max-score-picker" in types
    assert any(t.endswith("profile-handler") for t in types)
    for profile in config["schedulingProfiles"]:
        refs = [p["pluginRef"] for p in profile["plugins"]]
        assert set(refs) <= declared, refs
    # the scorers read these from each pod's /metrics; kvserve exports them (tests/api/test_metrics.py)
    source = (REPO / "server/api/metrics.py").read_text()
    for metric in EPP_METRICS:
        assert f'"{metric.removeprefix("vllm:")}"' in source, metric
