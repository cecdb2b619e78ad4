"""ServerConfig: the knobs of the HTTP layer, built by the CLI."""

from dataclasses import dataclass, field

# --reasoning-parser's choices (server/api/reasoning.py): its own names, then vLLM's for the same formats
REASONING_PARSERS = ("auto", "think", "gemma4", "harmony", "none")
REASONING_ALIASES = {
    "deepseek_r1": "think",
    "qwen3": "think",
    "gpt_oss": "harmony",
    "openai_gptoss": "harmony",
}


@dataclass
class ServerConfig:
    served_model_name: str = "kvserve"  # the name in /v1/models and in replies, and a `model` value accepted
    # more names a request's `model` may give (vLLM's --served-model-name with several); /v1/models lists them too
    model_aliases: list[str] = field(default_factory=list)
    log_requests: bool = True  # a line per finished request (vLLM's --disable-log-requests turns it off)
    api_key: str | None = None  # when set, every API route needs "Bearer <key>" (not /health, /metrics, /)
    allowed_origins: list[str] = field(default_factory=list)  # CORS origins; empty = no CORS headers at all
    max_queue: int = 256  # waiting requests at which new ones get 429
    max_request_bytes: int = 4 << 20  # larger bodies get 413
    # the Responses API's stored responses (previous_response_id, GET /v1/responses/{id}), in this process's
    # memory; 0: none kept
    responses_store_memory: int = 256 << 20
    # seconds a request's line and headers may take to arrive, then its body (each in full); slower ones get 408
    read_timeout: float = 30.0
    shutdown_timeout: float = 30.0  # seconds running requests get to finish when draining
    system_prompt: str | None = None  # put first in chat requests that have no system message
    ui: bool = True  # serve the chat page at / (public, like /health; it holds no secret)
    # how replies are split into reasoning and answer: auto (from the chat template), think, harmony or none
    # (vLLM's names deepseek_r1, qwen3, gpt_oss too); server/api/reasoning.py
    reasoning_parser: str = "auto"
