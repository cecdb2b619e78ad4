"""Claude Code (`claude -p`, pinned) against a live kvserve on the default model, through the Messages API, with
the settings the README gives. What this version sends: `HEAD /` as it starts, then each turn a streamed
POST /v1/messages?beta=true (anthropic-version, anthropic-beta, x-api-key) whose messages hold a system message
after the first user turn (its list of agents), with thinking, context_management, output_config and metadata.
The test asserts the protocol, not the 135M model's judgment: every request answered without an error, the
sessions' outcomes, a reply, a tool's result sent back.

Claude Code is installed once with npm into the user's cache folder (its native binary comes as an optional
dependency of the npm package), never into the repository, and runs offline: a fresh HOME, no telemetry, error
reports, update checks or other traffic, every model name set to the served one. SmolLM2's 8K context holds its
prompt with three tools (Read, Bash, Agent: ~4,000 tokens; its default set is ~21,000). Run with -s to see what
Claude Code said.
"""

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from server.api.app import create_app
from server.api.config import ServerConfig
from tests.helpers.agent_cli import Recorded, npm_command
from tests.helpers.thinking_models import think_model

CLAUDE_CODE = "2.1.200"
MODEL = "smollm2"
KEY = "kvserve-test-key"  # kvserve runs with an API key: Claude Code sends it as x-api-key
TOOLS = "Read,Bash,Agent"  # Agent: its list of agents is the system message among the others
KV_CACHE = 256 << 20  # the whole 8,192-token context for one sequence

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="session")
def claude() -> Path:
    """The claude command, installed once into the user's cache folder."""
    command = npm_command("@anthropic-ai/claude-code", CLAUDE_CODE, "claude")
    with tempfile.TemporaryDirectory() as home:
        env = {"PATH": os.environ["PATH"], "HOME": home, "DISABLE_AUTOUPDATER": "1"}
        version = subprocess.run([command, "--version"], env=env, capture_output=True, text=True, timeout=60)
    assert version.stdout.split() == [CLAUDE_CODE, "(Claude", "Code)"], version
    return command


def claude_env(home: Path, base_url: str, **extra: str) -> dict[str, str]:
    """The README's settings, and nothing of this machine's environment but PATH."""
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "TERM": "dumb",
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": KEY,
        **{
            name: MODEL
            for name in (
                "ANTHROPIC_MODEL",
                "ANTHROPIC_SMALL_FAST_MODEL",
                "ANTHROPIC_DEFAULT_HAIKU_MODEL",
                "ANTHROPIC_DEFAULT_SONNET_MODEL",
                "ANTHROPIC_DEFAULT_OPUS_MODEL",
                "CLAUDE_CODE_SUBAGENT_MODEL",
            )
        },
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256",  # a small context: short turns
        **extra,
    }


def run_claude(claude: Path, env: dict, workdir: Path, prompt: str, max_turns: int) -> tuple[int, dict, str]:
    """(exit status, the JSON result, stderr) of one `claude -p`."""
    command = [claude, "-p", prompt, "--output-format", "json", "--no-session-persistence"]
    command += ["--tools", TOOLS, "--allowedTools", "Read", "--max-turns", str(max_turns)]
    try:
        done = subprocess.run(
            command,
            env=env,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        return -1, {}, "timed out"
    print(f"\n--- claude -p {prompt!r}: exit {done.returncode}\n{done.stdout[:2000]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, json.loads(lines[-1]) if lines else {}, done.stderr


def show(exchanges: list[dict]) -> None:
    """What was asked and answered, a line each, with the fields of each message request but its long ones."""
    for x in exchanges:
        print(" ", x["method"], x["path"], x["query"], x.get("status"))
        if x["path"] == "/v1/messages":
            body = json.loads(x["body"])
            kept = {k: v for k, v in body.items() if k not in ("messages", "system", "tools")}
            print("    ", [m["role"] for m in body["messages"]], json.dumps(kept)[:400])


def test_claude_code_against_kvserve(claude, new_engine, default_model_dir, serve_app, tmp_path):
    engine = new_engine(default_model_dir, kv_cache_memory=KV_CACHE)
    server = Recorded(create_app(engine, ServerConfig(served_model_name=MODEL, api_key=KEY)))
    home, workdir = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    workdir.mkdir()
    (workdir / "notes.txt").write_text("The kettle is in the second cupboard.\n")
    # CLAUDE_CODE_EXTRA_BODY goes into every request: greedy replies, each ending at its first sentence or blank
    # line, as the small model left alone may write until the output limit, which Claude Code fails as an error.
    # (A blank line alone was not enough: Claude Code's prompt holds this folder's path and today's date, and on
    # some of them the greedy reply ran 256 tokens of sentences.)
    short = json.dumps({"temperature": 0, "stop_sequences": ["\n\n", ". ", ".\n"]})
    with serve_app(server) as url:
        # The session: Claude Code's own requests, the model free to answer or to call a tool.
        status, result, stderr = run_claude(
            claude, claude_env(home, url, CLAUDE_CODE_EXTRA_BODY=short), workdir, "say hi", max_turns=3
        )
        said_hi = len(server.exchanges)
        show(server.exchanges)
        assert status == 0 and result["subtype"] == "success", (status, result, stderr[-2000:])
        assert result["result"].strip()
        # A tool's round trip: the call forced (in every request, so the next turn calls again and the session
        # ends at --max-turns, as Claude Code ends one there), Claude Code runs it and sends its result back.
        forced = json.dumps({"temperature": 0, "tool_choice": {"type": "tool", "name": "Read"}})
        env = claude_env(home, url, CLAUDE_CODE_EXTRA_BODY=forced)
        read = f"Read {workdir / 'notes.txt'}"  # a path to copy keeps the forced call short
        status, result, stderr = run_claude(claude, env, workdir, read, max_turns=2)
        show(server.exchanges[said_hi:])
        assert status == 1 and result["subtype"] == "error_max_turns", (status, result, stderr[-2000:])
    # every request answered without an error: the HEAD probe, the messages, anything else
    assert all(x["status"] < 400 for x in server.exchanges), [
        (x["method"], x["path"], x["status"]) for x in server.exchanges
    ]
    assert (server.exchanges[0]["method"], server.exchanges[0]["path"]) == ("HEAD", "/")
    posts = [x for x in server.exchanges if x["path"] == "/v1/messages"]
    assert all(x["query"] == "beta=true" and x["headers"]["x-api-key"] == KEY for x in posts)
    assert all("anthropic-version" in x["headers"] and "anthropic-beta" in x["headers"] for x in posts)
    first = server.bodies("/v1/messages")[0]
    assert first["stream"] is True and first["model"] == MODEL
    assert {"thinking", "context_management", "output_config", "metadata"} <= set(first)
    roles = [m["role"] for m in first["messages"]]
    assert roles[0] == "user" and "system" in roles[1:], roles
    # the forced call went out as a tool_use block and came back as the tool_result of the same id
    _, back = server.bodies("/v1/messages", said_hi)[:2]
    blocks = [b for m in back["messages"] if isinstance(m["content"], list) for b in m["content"]]
    (call,) = [b for b in blocks if b["type"] == "tool_use"]
    (answer,) = [b for b in blocks if b["type"] == "tool_result"]
    assert call["name"] == "Read" and answer["tool_use_id"] == call["id"]


def test_claude_code_shows_a_thinking_models_thinking_apart(claude, new_engine, serve_app, tmp_path):
    """A thinking model (tiny, its reply "<think>Sum: 4</think>OK" scripted by its weights): Claude Code asks
    for thinking (adaptive) and gets it as a thinking block, apart from the answer's text."""
    thinker = think_model(tmp_path / "thinker", max_len=20480)  # its prompt, a byte a token: ~15,000
    engine = new_engine(thinker, kv_cache_memory=KV_CACHE)
    server = Recorded(create_app(engine, ServerConfig(served_model_name=MODEL, api_key=KEY)))
    home, workdir = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    workdir.mkdir()
    with serve_app(server) as url:
        env = claude_env(home, url, CLAUDE_CODE_EXTRA_BODY=json.dumps({"temperature": 0}))
        command = [claude, "-p", "What is 2+2?", "--output-format", "stream-json", "--verbose"]
        command += ["--no-session-persistence", "--tools", TOOLS, "--max-turns", "1"]
        done = subprocess.run(
            command,
            env=env,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,
        )
    show(server.exchanges)
    print(done.stdout[-3000:])
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    blocks = [b for e in events if e["type"] == "assistant" for b in e["message"]["content"]]
    assert [(b["type"], b.get("thinking") or b.get("text")) for b in blocks] == [
        ("thinking", "Sum: 4"),
        ("text", "OK"),
    ]
    assert events[-1]["type"] == "result" and events[-1]["result"] == "OK"
    first = server.bodies("/v1/messages")[0]
    assert first["thinking"]["type"] in ("adaptive", "enabled")
