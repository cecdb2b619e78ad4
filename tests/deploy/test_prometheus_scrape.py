"""A real Prometheus scraping a live kvserve with docker/prometheus.yml, only its targets (and, to keep the test
short, the scrape interval) changed. After a few requests Prometheus's HTTP API must return the token counter,
the time-to-first-token histogram, the HPA's queue metric and an answer to every PromQL query the README gives.
The images' HEALTHCHECK command is run against the same server.

Prometheus is Debian's `prometheus` package, installed here with apt-get when it is not on PATH."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers.deploy_files import DOCKER, DOCKERFILES, REPO, parse_dockerfile
from tests.helpers.live_server import free_port

SHUTDOWN_TIMEOUT = 30  # kvserve serve's default drain; the server must exit within it on SIGTERM


def tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


@pytest.fixture(scope="module")
def prometheus_bin() -> str:
    found = shutil.which("prometheus") or shutil.which("prometheus", path="/usr/bin:/usr/sbin")
    if found:
        return found
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = [*sudo, "apt-get", "install", "-y", "--no-install-recommends", "prometheus"]
    result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:  # a stale package list: refresh it once
        subprocess.run([*sudo, "apt-get", "update"], env=env, capture_output=True, timeout=180)
        result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=300)
    found = shutil.which("prometheus", path="/usr/bin:/usr/sbin")
    if result.returncode != 0 or not found:
        pytest.fail(
            "Prometheus is needed and `apt-get install prometheus` failed (Debian's package; run as root or "
            f"with passwordless sudo):\n{result.stdout[-1500:]}{result.stderr[-1500:]}"
        )
    return found


@contextmanager
def kvserve(model_dir: Path, log: Path) -> Iterator[str]:
    """`kvserve serve` in a subprocess on a free loopback port; yields its URL once /health says ready."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_")}  # no API key, no host
    command = [
        sys.executable, "-m", "server.cli", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
        "--port", str(port), "--device", "cpu", "--kv-cache-memory", "64MiB",
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(process, url + "/health", "kvserve serve", log, timeout=120)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)  # what docker stop and the kubelet send
        try:
            process.wait(SHUTDOWN_TIMEOUT + 5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            pytest.fail(f"kvserve ignored SIGTERM for {SHUTDOWN_TIMEOUT + 5} s:\n{tail(log)}")


def wait_until_ready(process: subprocess.Popen, ready_url: str, name: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, f"{name} exited with {process.returncode}:\n{tail(log)}"
        assert time.monotonic() < deadline, f"{name} never became ready:\n{tail(log)}"
        try:
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)


@contextmanager
def prometheus(binary: str, target: str, workdir: Path) -> Iterator[str]:
    """Prometheus on docker/prometheus.yml with every target replaced by `target`; yields its URL."""
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    rewritten = 0
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            static["targets"] = [target]
            rewritten += 1
    assert rewritten, "docker/prometheus.yml has no static targets to point at the server"
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))

    port = free_port()
    log = workdir / "prometheus.log"
    command = [
        binary, f"--config.file={path}", f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(process, url + "/-/ready", "prometheus", log, timeout=60)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def query(prometheus_url: str, promql: str) -> list[dict]:
    response = httpx.get(prometheus_url + "/api/v1/query", params={"query": promql}, timeout=10)
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", f"{promql}: {body}"
    return body["data"]["result"]


def readme_queries() -> list[str]:
    """Every query in a ```promql block of the deployment README (docker/README.md, or README.md once merged)."""
    queries = []
    for path in (DOCKER / "README.md", REPO / "README.md"):
        if path.is_file():
            for block in re.findall(r"```promql\n(.*?)```", path.read_text(), re.S):
                queries += [q.strip() for q in block.splitlines() if q.strip() and not q.startswith("#")]
    return list(dict.fromkeys(queries))


def healthcheck_commands() -> dict[str, list[str]]:
    commands = {}
    for name, path in DOCKERFILES.items():
        (check,) = [i for i in parse_dockerfile(path) if i.keyword == "HEALTHCHECK"]
        command = check.exec_form()
        assert command and command[0] == "python", check.args
        commands[name] = [sys.executable, *command[1:]]
    return commands


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_prometheus_scrapes_a_live_server(prometheus_bin, tiny_llama_dir, tmp_path):
    promtool = shutil.which("promtool", path=str(Path(prometheus_bin).parent))
    if promtool:  # the file compose mounts, as is
        check = subprocess.run(
            [promtool, "check", "config", str(DOCKER / "prometheus.yml")], capture_output=True, text=True
        )
        assert check.returncode == 0, check.stdout + check.stderr
    queries = readme_queries()
    assert len(queries) >= 4, "the README's PromQL (TTFT p99, tokens/s, queue depth, KV usage) is missing"

    with kvserve(tiny_llama_dir, tmp_path / "kvserve.log") as url:
        port = url.rsplit(":", 1)[1]
        for name, command in healthcheck_commands().items():
            env = {**os.environ, "KVSERVE_PORT": port}
            assert subprocess.run(command, env=env, timeout=10).returncode == 0, (
                f"{name} HEALTHCHECK vs healthy"
            )
            env["KVSERVE_PORT"] = str(free_port())
            down = subprocess.run(command, env=env, timeout=10, capture_output=True)
            assert down.returncode != 0, f"{name} HEALTHCHECK passes with no server"

        with prometheus(prometheus_bin, url.removeprefix("http://"), tmp_path) as prom:
            # One scrape before the requests, so that rate() sees the counters move.
            up = wait_for(lambda: [r for r in query(prom, "up") if r["value"][1] == "1"], 30)
            assert up, "Prometheus never scraped kvserve successfully"

            (model,) = [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]]
            for prompt in ("Hello there", "The quick brown fox", "Hello there, again"):
                response = httpx.post(
                    url + "/v1/completions",
                    json={"model": model, "prompt": prompt, "max_tokens": 8, "ignore_eos": True},
                    timeout=60,
                )
                assert response.status_code == 200, response.text
                assert response.json()["usage"]["completion_tokens"] == 8

            def scraped() -> bool:
                generated = query(prom, "sum(kvserve:generation_tokens_total)")
                return (
                    generated
                    and float(generated[0]["value"][1]) >= 24
                    and query(prom, "kvserve:time_to_first_token_seconds_bucket")
                    and query(prom, "kvserve:num_requests_waiting")  # what the HPA scales on
                )

            assert wait_for(scraped, 60), "Prometheus did not ingest kvserve's metrics"

            def unanswered() -> list[str]:
                return [q for q in queries if not query(prom, q)]

            assert wait_for(lambda: not unanswered(), 30), f"README queries with no result: {unanswered()}"


def wait_for(condition, seconds: float):
    """Poll `condition` every half second until it is true or `seconds` have passed; its last value."""
    deadline = time.monotonic() + seconds
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return value
