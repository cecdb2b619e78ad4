"""`kvserve serve` as a real process on a free loopback port, with its output kept in a file, and small helpers
the reliability tests share (SSE reading, /metrics scraping, resident memory, error bodies)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL_NAME = "m"


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_bytes(self) -> int:
        """VmRSS of the server process, from /proc (no psutil)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS line")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model_dir, log_path: Path, *flags: str, ready_timeout: float = 240, port: int | None = None
) -> Server:
    """Start `kvserve serve` with the given flags (on `port`, or a free one) and wait until /health says 200."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--served-model-name", MODEL_NAME, "--kv-cache-memory", "64MiB", *flags]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_")}
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + ready_timeout
    while True:
        assert proc.poll() is None, server.log()
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise AssertionError(f"the server did not become ready:\n{server.log()[-3000:]}")
        time.sleep(0.1)


def sse_payloads(raw: bytes) -> list[dict]:
    """The JSON events of a complete SSE body; fails unless the body is strict UTF-8 and ends with [DONE]."""
    text = raw.decode("utf-8")
    assert text.endswith("data: [DONE]\n\n"), text[-300:]
    blocks = text.split("\n\n")[:-2]
    assert all(b.startswith("data: ") for b in blocks), text[-300:]
    return [json.loads(b.removeprefix("data: ")) for b in blocks]


def named_sse_payloads(raw: bytes) -> list[dict]:
    """The JSON events of a complete SSE body of named events (/v1/responses, /v1/messages): strict UTF-8, each
    `event: <name>` then `data: <JSON of that type>`, no [DONE]."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n") and "[DONE]" not in text, text[-300:]
    payloads = []
    for block in text.split("\n\n")[:-1]:
        head, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}" and data.startswith("data: "), block
        payloads.append(payload)
    return payloads


def completion_text(payloads: list[dict]) -> tuple[str, str | None]:
    """(text, finish reason) of a one-choice completion stream; fails on an error event."""
    assert not any("error" in p for p in payloads), payloads
    text = "".join(c["text"] for p in payloads for c in p["choices"])
    reasons = [c["finish_reason"] for p in payloads for c in p["choices"] if c["finish_reason"]]
    return text, reasons[-1] if reasons else None


def scrape(url: str) -> dict[str, float]:
    """/metrics as {sample name: value}, model label dropped."""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            labels = ",".join(v for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def wait_idle(url: str, timeout: float = 20) -> dict[str, float]:
    """/metrics once nothing runs, waits or holds KV blocks (the engine's snapshot trails the last answer a little)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        busy = (
            m["kvserve:num_requests_running"]
            + m["kvserve:num_requests_waiting"]
            + m["kvserve:kv_cache_usage_perc"]
        )
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def assert_openai_error(r: httpx.Response, status: int | tuple[int, ...]) -> dict:
    """An OpenAI-shaped JSON error body with the given status(es), leaking no code or paths."""
    statuses = status if isinstance(status, tuple) else (status,)
    assert r.status_code in statuses, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and 0 < len(error["message"]) <= 300
    assert_no_leak(r.text)
    return error


def assert_anthropic_error(r: httpx.Response, status: int | tuple[int, ...]) -> dict:
    """An Anthropic-shaped JSON error body (what /v1/messages answers) with the given status(es)."""
    statuses = status if isinstance(status, tuple) else (status,)
    assert r.status_code in statuses, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert isinstance(body["error"]["message"], str) and 0 < len(body["error"]["message"]) <= 300
    assert_no_leak(r.text)
    return body["error"]


def assert_no_leak(text: str) -> None:
    assert "Traceback" not in text and 'File "' not in text, text[:500]
    assert ".py" not in text and "/server/" not in text and "site-packages" not in text, text[:500]
