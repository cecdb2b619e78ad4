"""docker/compose.yaml, parsed: the services, their images' Dockerfiles, the weights volume, the stop grace
period against the drain, the Prometheus config it mounts and the GPU profile."""

import re

import pytest
import yaml

from tests.helpers.deploy_files import DOCKER, REPO

COMPOSE = DOCKER / "compose.yaml"
DEFAULT_SHUTDOWN_TIMEOUT = 30  # kvserve serve --shutdown-timeout


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def environment(service: dict) -> dict[str, str | None]:
    """Compose's two forms; a bare name (value None) passes the variable through from the shell when set."""
    env = service.get("environment", {})
    if isinstance(env, dict):
        return env
    return {k: (v if sep else None) for k, sep, v in (e.partition("=") for e in env)}


def seconds(duration: str) -> float:
    """Compose durations: 45s, 1m30s, 2m, 1h, 500ms."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(a + b for a, b in parts) == duration, duration
    return sum(float(a) * units[b] for a, b in parts)


def kvserve_services() -> dict[str, dict]:
    return {n: s for n, s in compose()["services"].items() if n.startswith("kvserve")}


@pytest.mark.timeout(10)
def test_services_and_their_dockerfiles():
    services = compose()["services"]
    assert {"kvserve", "kvserve-gpu", "prometheus"} <= services.keys()
    expected = {"kvserve": "docker/Dockerfile", "kvserve-gpu": "docker/Dockerfile.cuda"}
    for name, dockerfile in expected.items():
        build = services[name]["build"]
        context = (COMPOSE.parent / build["context"]).resolve()
        assert context == REPO, "the build context is the repository root (.dockerignore lives there)"
        assert build["dockerfile"] == dockerfile and (context / dockerfile).is_file()
        assert any(p.endswith(":8000") for p in services[name]["ports"]), "the image serves on 8000"
    assert "profiles" not in services["kvserve"], "the CPU server starts with a plain `compose up`"
    host_ports = [p.split(":")[0] for s in kvserve_services().values() for p in s["ports"]]
    assert len(host_ports) == len(set(host_ports)), "both servers may run at once: distinct host ports"


@pytest.mark.timeout(10)
def test_gpu_profile_reserves_a_gpu():
    gpu = compose()["services"]["kvserve-gpu"]
    assert gpu["profiles"] == ["gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices), devices


@pytest.mark.timeout(10)
def test_weights_volume_api_key_and_stop_grace_period():
    spec = compose()
    assert "weights" in spec["volumes"], "a named volume keeps the weights across container rebuilds"
    for name, service in kvserve_services().items():
        assert "weights:/models" in service["volumes"], name
        env = environment(service)
        # Optional: passed through from the shell only when set, never an empty key or a key in the file.
        assert "KVSERVE_API_KEY" in env and env["KVSERVE_API_KEY"] in (None, "${KVSERVE_API_KEY}"), name
        shutdown = float(env.get("KVSERVE_SHUTDOWN_TIMEOUT") or DEFAULT_SHUTDOWN_TIMEOUT)
        assert seconds(service["stop_grace_period"]) >= shutdown + 5, (
            f"{name}: SIGKILL would cut the drain short"
        )


@pytest.mark.timeout(10)
def test_prometheus_mounts_the_config_that_scrapes_the_servers():
    spec = compose()
    prometheus = spec["services"]["prometheus"]
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", prometheus["image"]), "pin the Prometheus version"
    mounts = {}
    for volume in prometheus["volumes"]:
        source, target, *_ = volume.split(":")
        mounts[target] = source
    config_flag = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    config_path = config_flag.split("=", 1)[1]
    source = mounts[config_path]
    assert (COMPOSE.parent / source).resolve() == DOCKER / "prometheus.yml"

    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    services = spec["services"]
    for target in targets:
        host, port = target.rsplit(":", 1)
        assert host in services, f"{target}: not a compose service"
        assert any(p.endswith(":" + port) for p in services[host]["ports"]), target
    assert {t.split(":")[0] for t in targets} == set(kvserve_services()), "every server is scraped"
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in config["scrape_configs"])


@pytest.mark.timeout(10)
def test_duration_parser():
    assert seconds("45s") == 45 and seconds("1m30s") == 90 and seconds("2m") == 120
