"""When a request's output ends: the one place that decides, by its tokens.

Two questions, asked of the output as it stands after `num_output_tokens` tokens:
- which tokens may not be drawn next (stop tokens are banned until min_tokens outputs exist), asked by the
  model runner before it samples;
- whether the token just drawn ends the output, and why, asked by the output stage after the draw (and after
  the token advanced the request's grammar).
Stop strings end an output by its text, so the output stage checks them where it detokenizes; they win over
both answers here (precedence: stop string, grammar complete, stop token, length). A reply that a grammar
makes tool calls of takes none: stop strings are for prose, a call's markup spans lines (stop "\n" would end
each call at its opening), and a call cut inside its arguments is no call.
"""

from server.engine.request import FinishReason, Grammar
from server.engine.request_state import Request


def makes_tool_calls(grammar: Grammar | None) -> bool:
    """Whether the grammar makes the reply tool calls (then no stop string applies)."""
    return grammar is not None and grammar.spec.kind == "tool_calls"


def banned_token_ids(request: Request, num_output_tokens: int) -> list[int]:
    """The tokens that may not be drawn as output token number num_output_tokens + 1. Under a grammar the
    grammar says where the output may end, so nothing is banned here."""
    params = request.params
    if num_output_tokens >= params.min_tokens or request.grammar is not None:
        return []
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids |= request.eos_token_ids
    return sorted(ids)


def finish_reason(
    request: Request, token_id: int, num_output_tokens: int, max_model_len: int
) -> FinishReason | None:
    """Why the output ends with `token_id`, its num_output_tokens-th token (None if it goes on). A complete
    grammar and a stop token win over the length limit reached by the same token: the output is whole. (A token
    the grammar refused never gets here: the output stage ends that output with an error.)"""
    params = request.params
    if request.grammar is not None and request.grammar.is_complete:
        return FinishReason.STOP
    if num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return FinishReason.STOP
    if (
        num_output_tokens >= params.max_tokens
        or request.num_prompt_tokens + num_output_tokens >= max_model_len
    ):
        return FinishReason.LENGTH
    return None
