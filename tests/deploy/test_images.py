"""The CPU image built and run for real, by the engine scripts/image.sh picks (Docker, else podman, installed
with apt-get when neither is there): it serves the baked-in default model as its non-root user, turns healthy
by its own HEALTHCHECK, answers chat and a streamed completion, exports /metrics, and on `stop` drains its
running request and exits 0. Then docker/compose.yaml comes up with the same engine, and Prometheus scrapes
the kvserve service.

The first build on a machine takes minutes (and makes the offline base images where Docker Hub cannot be
reached); later ones reuse the engine's layer cache and take seconds."""

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.deploy_files import DOCKER, REPO, venv_tool
from tests.helpers.live_server import free_port

SCRIPT = REPO / "scripts/image.sh"
MODEL = "smollm2-135m-instruct"  # the default model, fetched into the image's /models at build time
SHUTDOWN_TIMEOUT = 30  # the image's KVSERVE_SHUTDOWN_TIMEOUT
BUILD_TIMEOUT = 2400  # a cold build with the offline base images: ~6 min measured; generous for a busy host
COLD = BUILD_TIMEOUT + 600


def image_sh(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    # podman-compose comes with the test extras, beside this interpreter.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    if check:
        assert result.returncode == 0, (
            f"image.sh {' '.join(args)}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    return result


@pytest.fixture(scope="module")
def oci_engine() -> list[str]:
    """The engine command with the flags this host needs, e.g. ['podman', '--cgroup-manager', 'cgroupfs']."""
    result = image_sh("engine", timeout=600, check=False)
    if result.returncode == 3:  # the one case the script reports as "no engine can be had here"
        pytest.skip(f"no container engine: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.fixture(scope="module")
def run_flags(oci_engine) -> list[str]:
    return image_sh("run-flags").stdout.split()


@pytest.fixture(scope="module")
def cpu_image(oci_engine) -> Iterator[str]:
    """kvserve:cpu, also tagged for this run alone: another checkout's build may move kvserve:cpu meanwhile."""
    tag = f"kvserve:test-{os.getpid()}"
    start = time.monotonic()
    image_sh("build", "cpu", "-t", tag, timeout=BUILD_TIMEOUT)
    print(f"\nkvserve:cpu built in {time.monotonic() - start:.0f} s ({' '.join(oci_engine)})")
    inspected = subprocess.run([*oci_engine, "image", "inspect", tag], capture_output=True, timeout=30)
    assert inspected.returncode == 0
    yield tag
    subprocess.run([*oci_engine, "rmi", tag], capture_output=True, timeout=120)  # the tag; kvserve:cpu stays


def inspect(engine: list[str], container: str, template: str) -> str:
    result = subprocess.run(
        [*engine, "inspect", "--format", template, container], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def logs(engine: list[str], container: str) -> str:
    result = subprocess.run([*engine, "logs", container], capture_output=True, text=True, timeout=30)
    return (result.stdout + result.stderr)[-4000:]


def wait_healthy(engine: list[str], container: str, timeout: float) -> float:
    """Seconds until the engine reports the image's HEALTHCHECK healthy. Docker runs the check on its interval;
    podman without systemd has no timer for it, so `podman healthcheck run` runs the same check each poll."""
    start = time.monotonic()
    while True:
        if engine[0] == "podman":
            subprocess.run([*engine, "healthcheck", "run", container], capture_output=True, timeout=30)
        status = inspect(engine, container, "{{.State.Status}} {{.State.Health.Status}}")
        if status == "running healthy":
            return time.monotonic() - start
        assert status.startswith("running"), f"{container}: {status}\n{logs(engine, container)}"
        assert time.monotonic() - start < timeout, f"never healthy ({status}):\n{logs(engine, container)}"
        time.sleep(1)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def sse_payloads(lines: list[str]) -> list[dict]:
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def metric(text: str, name: str) -> float:
    """The sum of one metric's samples (over its labels) in a /metrics page."""
    values = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    assert values, f"{name} not in /metrics"
    return sum(values)


@pytest.mark.slow
@pytest.mark.timeout(COLD)
def test_cpu_image_serves_turns_healthy_and_drains_on_stop(oci_engine, run_flags, cpu_image):
    container = f"kvserve-test-{os.getpid()}"
    port = free_port()
    run = [*oci_engine, "run", "-d", "--name", container, *run_flags, "-p", f"127.0.0.1:{port}:8000",
           "-e", "KVSERVE_KV_CACHE_MEMORY=256MiB", cpu_image]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    started = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    try:
        # The image's user, not root, owns the server process (PID 1, exec form).
        uid = subprocess.run(
            [*oci_engine, "exec", container, "id", "-u"], capture_output=True, text=True, timeout=30
        )
        assert uid.stdout.strip() == "10001", uid.stdout + uid.stderr
        pid1 = subprocess.run(
            [*oci_engine, "exec", container, "cat", "/proc/1/cmdline"], capture_output=True, timeout=30
        ).stdout.split(b"\0")
        assert Path(pid1[0].decode()).name.startswith("python") and b"serve" in pid1, pid1

        healthy_after = wait_healthy(oci_engine, container, timeout=300)
        print(f"healthy {healthy_after:.0f} s after start")
        assert "is already in /models" in logs(oci_engine, container), "the baked-in model was not used"
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]] == [MODEL]

        chat = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": MODEL, "temperature": 0, "max_tokens": 16,
                  "messages": [{"role": "user", "content": "What is the capital of France?"}]},
            timeout=120,
        )  # fmt: skip
        assert chat.status_code == 200, chat.text
        # on France: Paris on most tiers, but the first token is a near-tie that AVX2's float32 activations rounded
        # to int8 tip ("L'Étoile, la Cité, la France"; llama.cpp answers "L'Étoile, ..." from this file too)
        assert "France" in chat.json()["choices"][0]["message"]["content"], chat.json()

        # greedy: a sampled token may end mid-character, and its text then rides in the next token's event
        body = {
            "model": MODEL,
            "prompt": "Once upon a time",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**body, "logprobs": 0}, timeout=120
        ) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith(
                "text/event-stream"
            )
            payloads = sse_payloads([line for line in response.iter_lines() if line])
        # each event holds one token or more (drafts, or steps merged while the reader was behind)
        tokens = sum(len(p["choices"][0]["logprobs"]["tokens"]) for p in payloads)
        assert tokens == 8 and payloads[-1]["choices"][0]["finish_reason"] == "length"

        page = httpx.get(f"{url}/metrics", timeout=10).text
        assert (
            metric(page, "kvserve:generation_tokens_total") >= 8 + chat.json()["usage"]["completion_tokens"]
        )
        assert metric(page, "kvserve:request_success_total") >= 2

        # stop: SIGTERM to the server, which lets the running stream finish, then exits 0. The stream must still
        # be running when the stop arrives (16 tokens took 0.1 s, less than `podman stop` takes to signal: the
        # drain found no request in flight) and end well inside the drain (1,500 tokens outlasted its 30 s on a
        # host busy with a build): sized to a quarter of the drain at the rate this container decodes now.
        start = time.monotonic()
        timed = httpx.post(
            f"{url}/v1/completions", json={**body, "max_tokens": 128, "stream": False}, timeout=120
        )
        assert timed.status_code == 200, timed.text
        rate = 128 / (time.monotonic() - start)
        stream_tokens = int(min(1500, max(64, rate * SHUTDOWN_TIMEOUT / 4)))
        print(f"{rate:.0f} tokens/s: a stream of {stream_tokens} tokens to drain")
        lines: list[str] = []

        def stream() -> None:
            request = {**body, "max_tokens": stream_tokens}
            with httpx.stream("POST", f"{url}/v1/completions", json=request, timeout=120) as r:
                lines.extend(line for line in r.iter_lines() if line)

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 60
        while len(lines) < 2:  # the request is generating
            assert time.monotonic() < deadline and reader.is_alive(), lines
            time.sleep(0.05)
        start = time.monotonic()
        stop = subprocess.run([*oci_engine, "stop", "-t", str(SHUTDOWN_TIMEOUT + 15), container],
                              capture_output=True, text=True, timeout=SHUTDOWN_TIMEOUT + 60)  # fmt: skip
        took = time.monotonic() - start
        reader.join(30)
        assert stop.returncode == 0, stop.stderr
        print(f"stopped in {took:.1f} s")
        assert took < SHUTDOWN_TIMEOUT + 5, f"stop took {took:.0f} s"
        assert inspect(oci_engine, container, "{{.State.ExitCode}}") == "0", logs(oci_engine, container)
        finished = sse_payloads(lines)
        assert finished[-1]["choices"][0]["finish_reason"] == "length", "the drain cut the request short"
        assert "draining: 1 requests in flight" in logs(oci_engine, container), logs(oci_engine, container)
    finally:
        subprocess.run([*oci_engine, "rm", "-f", container], capture_output=True, timeout=120)


@pytest.mark.slow
@pytest.mark.timeout(COLD)
def test_compose_stack_prometheus_scrapes_kvserve(oci_engine, cpu_image, tmp_path):
    """docker/compose.yaml as it is, but for an override file: free loopback ports instead of its published
    ones, and the image built above. Prometheus is the real image, or its offline stand-in."""
    project = f"kvserve-test-{os.getpid()}"
    kvserve_port, prometheus_port = free_port(), free_port()
    override = tmp_path / "override.yaml"
    # !override replaces a list instead of appending to it (compose's merge rule for ports).
    override.write_text(
        "services:\n"
        f"  kvserve:\n    image: {cpu_image}\n    ports: !override ['127.0.0.1:{kvserve_port}:8000']\n"
        "    environment: ['KVSERVE_KV_CACHE_MEMORY=256MiB']\n"
        f"  prometheus:\n    ports: !override ['127.0.0.1:{prometheus_port}:9090']\n"
    )
    compose = ("compose", "-p", project, "-f", str(override))
    prometheus = f"http://127.0.0.1:{prometheus_port}"
    try:
        start = time.monotonic()
        image_sh(*compose, "up", "-d", timeout=BUILD_TIMEOUT)  # no build: the image is there

        def targets() -> dict[str, str]:
            try:
                body = httpx.get(f"{prometheus}/api/v1/targets", timeout=5).json()
            except (httpx.TransportError, ValueError):
                return {}
            return {t["labels"]["instance"]: t["health"] for t in body["data"]["activeTargets"]}

        # docker/prometheus.yml scrapes every 15 s; the server needs ~15 s to load.
        deadline = time.monotonic() + 240
        while targets().get("kvserve:8000") != "up":
            assert time.monotonic() < deadline, f"kvserve target never up: {targets()}"
            time.sleep(2)
        print(f"Prometheus scraped kvserve {time.monotonic() - start:.0f} s after `compose up`")
        # Listed, never up: the GPU service runs only with --profile gpu (down, or unknown before its scrape).
        assert targets().get("kvserve-gpu:8000") in ("down", "unknown"), targets()

        # The service answers on its published port once loaded, from the model the named volume got from
        # the image.
        deadline = time.monotonic() + 240
        while not healthy(f"http://127.0.0.1:{kvserve_port}"):
            assert time.monotonic() < deadline, "kvserve never ready"
            time.sleep(1)
        models = httpx.get(f"http://127.0.0.1:{kvserve_port}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        query = httpx.get(
            f"{prometheus}/api/v1/query", params={"query": 'up{job="kvserve"}'}, timeout=10
        ).json()
        up = {r["metric"]["instance"]: r["value"][1] for r in query["data"]["result"]}
        assert up.get("kvserve:8000") == "1", up
    finally:
        down = image_sh(*compose, "down", "-v", timeout=300, check=False)
    assert down.returncode == 0, down.stderr[-3000:]
    left = subprocess.run([*oci_engine, "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True)
    assert not [n for n in left.stdout.split() if n.startswith(project)], left.stdout
    volumes = subprocess.run(
        [*oci_engine, "volume", "ls", "--format", "{{.Name}}"], capture_output=True, text=True
    )
    assert not [v for v in volumes.stdout.split() if v.startswith(project)], volumes.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", sorted((DOCKER / "offline").glob("*.Containerfile")), ids=lambda p: p.stem)
def test_offline_standins_pass_hadolint(path):
    result = subprocess.run(
        [venv_tool("hadolint"), "--no-color", "--failure-threshold", "warning", str(path)],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert result.returncode == 0, f"hadolint {path}:\n{result.stdout}{result.stderr}"
