"""OpenAI's Codex CLI (`codex exec`, pinned) against a live kvserve on the default model, through the Responses
API, with the config.toml the README gives (read from it, plus a one-tool MCP server). Codex offers its tools as
it does against OpenAI: functions, a namespace (the MCP server's tools; its sub-agent tools are another, turned
off by that config for length) and the built-in web_search. The tests assert the protocol, not the 135M model's
judgment: every request answered 200, the turn completed with a final message, and a namespaced call (the model
made to call the MCP tool) run by Codex, its output sent back.

Codex is installed once with npm into the user's cache folder (its native binary comes as an optional
dependency of the npm package), never into the repository. Run with -s to see Codex's events.
"""

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from server.api.app import create_app
from server.api.config import ServerConfig
from tests.helpers.agent_cli import Recorded, npm_command
from tests.helpers.thinking_models import think_model

CODEX = "0.169.0"
MODEL = "smollm2-135m-instruct"  # as the README's config names it
PROMPT = "Say hello."
# The small model sometimes writes until its context is full: the response is then `incomplete` and Codex fails
# the turn. That is its judgment, not the protocol; such a run is retried, any other failure is not.
ATTEMPTS = 4
MAX_MODEL_LEN = 2560  # Codex's prompt here is ~1,810 tokens: a rambling reply ends within ~750 more

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

README = Path(__file__).resolve().parents[2] / "README.md"
MCP_CONFIG = """
[mcp_servers.notes]
command = "{python}"
args = ["{mcp_server}"]
default_tools_approval_mode = "approve"  # approval_policy "never" refuses MCP calls that need one
"""
INSTRUCTIONS = (
    "You are a coding agent running in the Codex CLI. Answer briefly. Use a tool only when needed.\n"
)
MCP_SERVER = '''\
"""A stdio MCP server with one tool, echo: Codex offers an MCP server's tools as a namespace."""
import json
import sys

for line in sys.stdin:
    message = json.loads(line)
    if "id" not in message:
        continue
    method, params = message["method"], message.get("params", {})
    if method == "initialize":
        result = {"protocolVersion": params.get("protocolVersion", "2025-06-18"), "capabilities": {"tools": {}},
                  "serverInfo": {"name": "notes", "version": "1"}}
    elif method == "tools/list":
        schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
        result = {"tools": [{"name": "echo", "description": "Echo a text back.", "inputSchema": schema}]}
    elif method == "tools/call":
        result = {"content": [{"type": "text", "text": params["arguments"].get("text", "")}]}
    else:
        result = {}
    print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}), flush=True)
'''


@pytest.fixture(scope="session")
def codex() -> Path:
    """The codex command, installed once into the user's cache folder."""
    command = npm_command("@openai/codex", CODEX, "codex")
    version = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=60)
    assert version.stdout.split() == ["codex-cli", CODEX], version
    return command


def forcing(choices: list | None):
    """A rewrite for Recorded that puts the next of `choices` as the tool_choice of each /v1/responses request,
    so that the model calls a tool, or answers in words, whatever its judgment (Codex itself always sends
    "auto"); None when there are none."""
    if not choices:
        return None
    left = list(choices)

    def rewrite(path: str, request: dict) -> dict | None:
        if path != "/v1/responses" or not left:
            return None
        return {**request, "tool_choice": left.pop(0), "parallel_tool_calls": False}

    return rewrite


@contextmanager
def live_codex(
    new_engine,
    default_model_dir,
    serve_app,
    tmp_path,
    forced_choices=None,
    extra_config="",
    max_model_len=MAX_MODEL_LEN,
) -> Iterator[tuple]:
    """(the recorded server, CODEX_HOME, the folder Codex works in) around a kvserve on the default model (or the
    model folder given), with the README's config.toml plus a one-tool MCP server (and `extra_config`)."""
    engine = new_engine(default_model_dir, max_model_len=max_model_len)
    server = Recorded(create_app(engine, ServerConfig(served_model_name=MODEL)), forcing(forced_choices))
    home, workdir = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    workdir.mkdir()
    (home / "short-instructions.md").write_text(INSTRUCTIONS)
    (home / "mcp_notes.py").write_text(MCP_SERVER)
    config = readme_config()
    assert f'model = "{MODEL}"' in config and "http://127.0.0.1:8000/v1" in config
    with serve_app(server) as url:
        config = config.replace("http://127.0.0.1:8000", url)
        config = (
            extra_config + config + MCP_CONFIG.format(python=sys.executable, mcp_server=home / "mcp_notes.py")
        )
        (home / "config.toml").write_text(config)
        yield server, home, workdir


def readme_config() -> str:
    """The config.toml of the README's Codex section."""
    section = README.read_text().split("\n### Codex\n", 1)[1]
    return section.split("```toml\n", 1)[1].split("```", 1)[0]


def run_codex(codex: Path, home: Path, workdir: Path, prompt: str) -> tuple[int, list[dict], str]:
    """(exit status, the JSONL events, stderr) of one `codex exec`."""
    command = [codex, "exec", "--json", "--strict-config", "--ephemeral", "--skip-git-repo-check"]
    env = {**os.environ, "CODEX_HOME": str(home), "KVSERVE_API_KEY": "unused", "NO_COLOR": "1"}
    done = subprocess.run(
        [*command, "--cd", str(workdir), prompt],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
    )
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, events, done.stderr


def test_codex_exec_against_kvserve(codex, new_engine, default_model_dir, serve_app, tmp_path):
    with live_codex(new_engine, default_model_dir, serve_app, tmp_path) as (server, home, workdir):
        for attempt in range(ATTEMPTS):
            status, events, stderr = run_codex(codex, home, workdir, PROMPT)
            show(f"codex exec, attempt {attempt + 1}: exit {status}", events)
            if status == 0:
                break
            assert model_rambled(events), (status, events, stderr[-2000:])
    assert status == 0, f"the model wrote until its context was full {ATTEMPTS} times"
    assert events[0]["type"] == "thread.started" and events[-1]["type"] == "turn.completed"
    messages = [e["item"]["text"] for e in events if e.get("item", {}).get("type") == "agent_message"]
    assert messages and messages[-1].strip()
    # what Codex sent, and what kvserve answered
    calls = answered(server)
    first = json.loads(calls[0]["body"])
    kinds = {t["type"]: t for t in first["tools"]}
    assert kinds["namespace"]["name"] == "mcp__notes" and "web_search" in kinds and first["stream"] is True
    assert calls[0]["response_headers"]["x-kvserve-ignored-tools"] == "web_search"
    for field in ("reasoning", "include", "prompt_cache_key", "client_metadata"):
        assert field in first
    assert first["store"] is False


def test_codex_runs_a_namespaced_call(codex, new_engine, default_model_dir, serve_app, tmp_path):
    """The model is made to call the MCP server's tool, which it knows as mcp__notes.echo: Codex gets the call
    as `name` echo, `namespace` mcp__notes, runs it, and sends its output back in the next request, which the
    model is made to answer in words."""
    forced = [{"type": "function", "name": "mcp__notes.echo"}, "none"]
    for attempt in range(ATTEMPTS):
        attempt_dir = tmp_path / f"attempt{attempt}"
        attempt_dir.mkdir()
        with live_codex(new_engine, default_model_dir, serve_app, attempt_dir, forced) as (
            server,
            home,
            workdir,
        ):
            status, events, stderr = run_codex(codex, home, workdir, "Echo the word hello.")
        show(f"codex exec, a forced call, attempt {attempt + 1}: exit {status}", events)
        # the words after the call are the model's judgment: a reply cut at the context's end is no failure here
        assert status == 0 or model_rambled(events), (status, events, stderr[-2000:])
        items = [e["item"] for e in events if e["type"] == "item.completed"]
        if any(item["type"] == "mcp_tool_call" for item in items):
            break
        # Codex samples (temperature 1): the forced call's free-text argument may ramble to max_output_tokens
    (tool,) = [item for item in items if item["type"] == "mcp_tool_call"]
    assert (tool["server"], tool["tool"], tool["status"]) == ("notes", "echo", "completed"), tool
    calls = answered(server)
    history = json.loads(calls[1]["body"])["input"]
    (call,) = [item for item in history if item["type"] == "function_call"]
    (output,) = [item for item in history if item["type"] == "function_call_output"]
    assert (call["name"], call["namespace"], output["call_id"]) == ("echo", "mcp__notes", call["call_id"])
    assert "unsupported call" not in json.dumps(output["output"]), output
    print("\ncall:", call, "\noutput:", output)


# Codex shows reasoning summaries of the models it knows; for others it is told the model has them, and asked to
# show the raw reasoning too (top-level keys: before the README's tables)
THINKER_LEN = 12288
THINKING_CONFIG = """model_reasoning_summary = "auto"
show_raw_agent_reasoning = true
"""


def test_codex_shows_a_thinking_models_reasoning_apart(codex, new_engine, serve_app, tmp_path):
    """A thinking model (tiny, its reply "<think>Sum: 4</think>OK" scripted by its weights): Codex gets the
    reasoning as a reasoning item and shows it apart from the answer, its agent message."""
    # its tokenizer spells Codex's prompt a byte a token: ~7,000
    thinker = think_model(tmp_path / "thinker", max_len=THINKER_LEN)
    with live_codex(new_engine, thinker, serve_app, tmp_path, None, THINKING_CONFIG, THINKER_LEN) as (
        server,
        home,
        workdir,
    ):
        status, events, stderr = run_codex(codex, home, workdir, PROMPT)
    show("codex exec, a thinking model", events)
    assert status == 0, (events, stderr[-2000:])
    items = [e["item"] for e in events if e["type"] == "item.completed"]
    reasoning = [item["text"] for item in items if item["type"] == "reasoning"]
    messages = [item["text"] for item in items if item["type"] == "agent_message"]
    assert reasoning and all("Sum: 4" in text for text in reasoning), items
    assert messages == ["OK"], items
    first = json.loads(answered(server)[0]["body"])
    assert first["reasoning"]["summary"] == "auto"


def model_rambled(events: list[dict]) -> bool:
    """The turn failed because the model wrote until its context was full: the response was incomplete."""
    failed = [e["error"]["message"] for e in events if e["type"] == "turn.failed"]
    return bool(failed) and "max_output_tokens" in failed[0]


def answered(server: Recorded) -> list[dict]:
    """The /v1/responses exchanges, having checked that kvserve answered every request with 200."""
    statuses = [(x["path"], x.get("status")) for x in server.exchanges]
    assert all(status == 200 for _, status in statuses), statuses
    calls = [x for x in server.exchanges if x["path"] == "/v1/responses"]
    assert calls
    return calls


def show(title: str, events: list[dict]) -> None:
    print(f"\n--- {title}")
    for event in events:
        print(" ", json.dumps(event)[:300])
