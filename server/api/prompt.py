"""The prompt renderer: a conversation in OpenAI's chat shape (chat's messages, and what Responses' input items
and Anthropic's messages become) and the tools offered, through the model's chat template, to prompt ids. Chat,
Responses, Messages and /tokenize all render with it, so one conversation is one prompt whichever API sent it."""

import os
from dataclasses import dataclass

from pydantic import BaseModel

from server.api.errors import ApiError
from server.api.serving import Serving
from server.api.tools import Tools, render_history


def chat_prompt_ids(
    serving: Serving,
    messages: list[BaseModel] | list[dict],
    add_generation_prompt: bool = True,
    tools: Tools | None = None,
    template_kwargs: dict | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """The prompt the chat template makes of the messages (OpenAI's chat shape) and the tools offered, after the
    server's system prompt if they have none."""
    return chat_prompt(
        serving, messages, add_generation_prompt, tools, template_kwargs, continue_final_message
    ).ids


@dataclass(slots=True)
class Prompt:
    ids: list[int]
    # where the reply starts against the model's reasoning (ReasoningFormat.start): in, out or open; out when the
    # model's replies are not parsed for reasoning
    reasoning_start: str = "out"


def chat_prompt(
    serving: Serving,
    messages: list[BaseModel] | list[dict],
    add_generation_prompt: bool = True,
    tools: Tools | None = None,
    template_kwargs: dict | None = None,
    continue_final_message: bool = False,
) -> Prompt:
    """chat_prompt_ids(), and where the reply starts against the reasoning: read from what the template adds for
    the reply (its generation prompt), which may open the reasoning, or open and close it.

    continue_final_message: the last message is the start of the assistant's reply (a prefill: Anthropic's final
    assistant message, vLLM's continue_final_message), rendered without its end of turn (and no generation
    prompt, whatever add_generation_prompt says), so that the model writes on from its last character; the reply
    holds only what the model adds, outside the reasoning."""
    dicts = [m.model_dump(exclude_none=True) if isinstance(m, BaseModel) else dict(m) for m in messages]
    for m in dicts:
        if m["role"] == "developer":
            m["role"] = "system"
        if "reasoning_content" in m and serving.reasoning is not None:
            m[serving.reasoning.history_key] = m.pop("reasoning_content")
    if serving.system_prompt and not any(m["role"] == "system" for m in dicts):
        dicts.insert(0, {"role": "system", "content": serving.system_prompt})
    tokenizer = serving.engine.tokenizer
    native = tokenizer.template_renders_tools
    dicts = render_history(dicts, tools, native)
    if not tokenizer.template_renders_inline_system:
        dicts = fold_inline_system(dicts)
    try:
        # The template writes the special tokens (BOS, role markers) itself.
        template_tools = tools.template_tools() if tools is not None and native else None
        if continue_final_message:
            final = final_assistant_text(dicts)
            text = tokenizer.apply_chat_template(dicts, False, template_tools, template_kwargs)
            return Prompt(tokenizer.encode(cut_after(text, final)))
        text = tokenizer.apply_chat_template(dicts, add_generation_prompt, template_tools, template_kwargs)
        prompt = Prompt(tokenizer.encode(text))
        if serving.reasoning is not None and add_generation_prompt:
            without = tokenizer.apply_chat_template(dicts, False, template_tools, template_kwargs)
            common = len(os.path.commonprefix([text, without]))
            prompt.reasoning_start = serving.reasoning.start(tokenizer.encode(text[common:]))
        return prompt
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None


def final_assistant_text(messages: list[dict]) -> str:
    """The text of the reply to continue: the last message's, which must be the assistant's, text only."""
    final = messages[-1] if messages else {"role": None}
    content = final.get("content")
    if isinstance(content, list):
        content = "\n".join(part.get("text", "") for part in content)
    if final["role"] != "assistant" or final.get("tool_calls") or not (content or "").strip():
        raise ApiError(
            400,
            "continuing the final message needs it to be an assistant message with text",
            param="messages",
        )
    return content


def cut_after(rendered: str, final: str) -> str:
    """The rendered conversation up to the end of the final message's text, without what the template closes
    its turn with. Templates may strip a message's text: its leading and trailing whitespace is kept only where
    the template kept it (as transformers' continue_final_message does)."""
    at = rendered.rfind(final.strip())
    if at < 0:
        raise ApiError(400, "the chat template does not render the final message's text as sent, so it cannot be "
                       "continued", param="messages")  # fmt: skip
    kept = final.lstrip()
    end = at + (len(kept) if rendered.startswith(kept, at) else len(final.strip()))
    return rendered[:end]


# What the renderer sets itself: a request's template variables may not replace them
RESERVED_TEMPLATE_VARIABLES = {"messages", "add_generation_prompt", "tools", "documents"}


def template_kwargs(
    kwargs: dict | None, effort: str | None = None, param: str = "chat_template_kwargs"
) -> dict:
    """The template variables a request sets: its reasoning effort (as GPT-OSS's template reads it), then its
    own (`param`), which win. A 400 for a variable the renderer sets itself."""
    kwargs = kwargs or {}
    taken = sorted(
        RESERVED_TEMPLATE_VARIABLES.intersection(kwargs) | {k for k in kwargs if k.endswith("_token")}
    )
    if taken:
        raise ApiError(400, f"{param}: {', '.join(taken)} cannot be set (the server sets them)", param=param)
    return {**({"reasoning_effort": effort} if effort is not None else {}), **kwargs}


def fold_inline_system(messages: list[dict]) -> list[dict]:
    """The conversation for a template that cannot render a system message after the first turns (it refuses one
    or leaves it out): the system messages that lead are joined into one, and each later one joins a user turn,
    the one it follows when nothing came between, else the next (a user turn of its own when none follows).

    Not into the system prompt: Claude Code adds its reminders as it goes, and each would change the prompt's
    first tokens, so no request could reuse the last one's cached prefix; joined to a user turn, only the end of
    the prompt changes (vLLM folds them the same way, and Claude Code writes its own reminders into user turns)."""
    out: list[dict] = []
    pending: list = []  # the contents of system messages waiting for the next user turn
    for m in messages:
        if m["role"] != "system":
            if pending and m["role"] == "user":
                m, pending = {**m, "content": _joined(*pending, m.get("content"))}, []
            out.append(m)
        elif all(o["role"] == "system" for o in out):
            out[:] = [{**m, "content": _joined(*(o.get("content") for o in out), m.get("content"))}]
        elif out[-1]["role"] == "user" and not pending:
            out[-1] = {**out[-1], "content": _joined(out[-1].get("content"), m.get("content"))}
        else:
            pending.append(m.get("content"))
    if pending:
        out.append({"role": "user", "content": _joined(*pending)})
    return out


def _joined(*contents: str | list | None) -> list[dict]:
    # As text parts, which the template renderer joins with newlines; a part it cannot render stays to be refused.
    return [p for c in contents for p in (c if isinstance(c, list) else [{"type": "text", "text": c or ""}])]
