"""Tiny thinking models whose replies are known: a llama whose weights are written by hand so that, greedily, each
token is followed by the one a script names, with one bit of memory (whether a `key` token came before). Their
tokenizers hold a thinking format's markers as single tokens: `<think>`/`</think>` (Qwen3's and the R1 distills'
format) or harmony's (GPT-OSS's), and their chat templates are shaped like those models'. Nothing is downloaded.

How the weights script the reply (all else zero):
- embeddings: token t is e_t + b, where the e_t and b (and u below) are orthonormal;
- layer 0's attention, one head: its query is b's (the same at every position), its key is large only at `key`
  tokens, along the slowest RoPE dimension (a rotation of < 0.01 rad over the context), so the head attends to
  the key tokens once one came, else evenly to every token; its value is +u at a key token and -u elsewhere: the
  residual gains +u once a key came, -u before;
- the LM head's row for token s is the sum of e_a over the tokens a it follows, plus +-u/2 when it follows them
  only after (+) or before (-) the key. The greedy next token after t is then the one scripted for t in the
  current phase, else the one scripted for t in both (every other token scores at most half as much).
"""

import json
from pathlib import Path

import torch

HIDDEN = 320  # room for an orthonormal embedding per token (vocabulary < 300) plus b and u
HEAD_DIM = 80
SLOW = HEAD_DIM - 1  # RoPE's slowest-turning dimension (in either pairing convention)

THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
# R1 distills' and Qwen3-Thinking-2507's way: the generation prompt opens the reasoning
OPEN_THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>{% endif %}"
)
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>You are a helpful assistant.\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}\n"
    "# Valid channels: analysis, commentary, final.<|end|>"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% if m['thinking'] %}<|start|>assistant<|channel|>analysis<|message|>{{ m['thinking'] }}<|end|>{% endif %}"
    "<|start|>assistant<|channel|>final<|message|>"
    "{{ m['content'] }}<|end|>{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
# Gemma 4's shape: turns between <|turn> and <turn|>, the model's reasoning in a "thought" channel, which the
# template closes empty when thinking is off
GEMMA4_TEMPLATE = (
    "{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}"
    "<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<|channel>thought\n<channel|>{% endif %}"
    "{% endif %}"
)
THINK_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
GEMMA4_SPECIALS = [
    "<pad>",
    "<|turn>",
    "<turn|>",
    "<|channel>",
    "<channel|>",
    "<|tool_call>",
    "<tool_call|>",
    '<|"|>',
]
GEMMA4_WORDS = ["thought\n", "call:get_weather{city:", "Paris"]
HARMONY_SPECIALS = [
    "<|endoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
    "<|constrain|>",
]  # fmt: skip
# harmony's words as single tokens, as o200k_harmony has them
HARMONY_WORDS = [
    "assistant", "analysis", "final", "commentary", " to=functions.get_weather", "json", '{"city": "Paris"}',
]  # fmt: skip


def save_tokenizer(out: Path, specials: list[str], words: list[str], template: str, eos: str) -> None:
    """A byte-level BPE tokenizer (256 bytes, no merges) with `specials` as special tokens and `words` as plain
    added tokens, and a tokenizer_config.json with the template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {s: i for i, s in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.add_tokens(words)
    tok.save(str(out / "tokenizer.json"))
    config = {"eos_token": eos, "pad_token": "<|endoftext|>", "chat_template": template}
    (out / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"})
    )


def build_scripted_model(
    out: Path,
    specials: list[str],
    words: list[str],
    template: str,
    script: list[tuple[list[str], str | None]],
    key: str,
    eos: list[str],
    max_len: int = 512,
) -> Path:
    """A model folder whose greedy replies follow `script`: each entry (tokens, phase) says that each of its
    tokens is followed by the next, in phase "before" or "after" the first `key` token, or in both (None). Each
    string is one token of the tokenizer. `eos` are the stop tokens (config.json's eos_token_id)."""
    import transformers
    from tokenizers import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(out, specials, words, template, eos[0])
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab_size = tok.get_vocab_size()
    assert vocab_size + 2 <= HIDDEN, vocab_size

    def one(text: str) -> int:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert len(ids) == 1, (text, ids)
        return ids[0]

    config = transformers.LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        vocab_size=vocab_size,
        max_position_embeddings=max_len,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=False,
        bos_token_id=one(specials[0]),
        eos_token_id=[one(e) for e in eos],
        pad_token_id=one(specials[0]),
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    basis = torch.linalg.qr(torch.randn(HIDDEN, HIDDEN))[0]  # orthonormal columns
    e, b, u = basis[:, :vocab_size].T, basis[:, vocab_size], basis[:, vocab_size + 1]
    scale = (2 / HIDDEN) ** -0.5  # what the input RMSNorm multiplies e_t + b by
    state = {name: torch.zeros_like(p) for name, p in model.state_dict().items()}
    state["model.embed_tokens.weight"] = e + b
    for name in state:
        if name.endswith("norm.weight"):
            state[name] = torch.ones_like(state[name])
    attn = "model.layers.0.self_attn."
    # query 30 at the slow dimension at every position, key 30 at key tokens and 0 elsewhere: a key token scores
    # 900 / sqrt(80) ~ 100, the others 0
    state[attn + "q_proj.weight"][SLOW] = 30 * b / scale
    state[attn + "k_proj.weight"][SLOW] = 30 * e[one(key)] / scale
    state[attn + "v_proj.weight"][0] = (2 * e[one(key)] - b) / scale  # +1 at a key token, -1 elsewhere
    state[attn + "o_proj.weight"][:, 0] = u  # head 0's first value dimension -> +-u in the residual
    head = torch.zeros(vocab_size, HIDDEN)
    for tokens, phase in script:
        side = {"before": -0.5, "after": 0.5, None: 0.0}[phase]
        for a, s in zip(tokens, tokens[1:], strict=False):
            head[one(s)] += e[one(a)]
            head[one(s)] += side * u
    state["lm_head.weight"] = 5 * head
    model.load_state_dict(state)
    model.save_pretrained(out, safe_serialization=True)
    return out


# Think: "Sum: 4" as reasoning, then "OK". Phases by `</think>`: before it, the generation prompt's last "\n"
# opens the reasoning; after it (enable_thinking false puts `</think>\n\n` in the prompt) "\n" starts the answer.
THINK_REASONING, THINK_ANSWER = "Sum: 4", "OK"
THINK_SCRIPT = [
    (["\n", "<think>"], "before"),
    (["<think>", *THINK_REASONING, "</think>", *THINK_ANSWER, "<|im_end|>"], None),
    (["\n", *THINK_ANSWER], "after"),
]
# Thinks until stopped: "abc" over and over; once `</think>` comes (a budget forces it), the answer.
LOOP_SCRIPT = [
    (["\n", "<think>"], "before"),
    (["<think>", "a", "b", "c", "a"], None),
    (["</think>", *THINK_ANSWER, "<|im_end|>"], None),
    (["\n", *THINK_ANSWER], "after"),
]
# Harmony: analysis "Sum: 4" (its "4" is the key), then the final answer "OK". `<|channel|>` and `<|message|>`
# come twice: before the key they lead to the analysis, after it to the answer.
HARMONY_REASONING, HARMONY_ANSWER = "Sum: 4", "OK"
HARMONY_SCRIPT = [
    (["<|channel|>", "analysis"], "before"),
    (["analysis", "<|message|>"], None),
    (["<|message|>", "S"], "before"),
    ([*"Sum:"], None),
    ([":", " "], "before"),
    ([" ", "4"], "before"),
    (["4", "<|end|>", "<|start|>", "assistant", "<|channel|>"], None),
    (["<|channel|>", "final"], "after"),
    (["final", "<|message|>"], None),
    (["<|message|>", *HARMONY_ANSWER], "after"),
    ([*HARMONY_ANSWER, "<|return|>"], None),
]
# Harmony with a tool call: analysis "Sum: 4", then a call of get_weather on the commentary channel.
HARMONY_CALL_SCRIPT = [
    *HARMONY_SCRIPT[:7],
    (["<|channel|>", "commentary"], "after"),
    (["commentary", " to=functions.get_weather", " "], None),
    ([" ", "<|constrain|>"], "after"),
    (["<|constrain|>", "json"], None),
    (["json", "<|message|>"], None),
    (["<|message|>", '{"city": "Paris"}'], "after"),
    (['{"city": "Paris"}', "<|call|>"], None),
]


# Gemma 4: the channel's label, then "Sum: 4" as reasoning, then "OK". Phases by `<channel|>`: before it, the
# generation prompt's last "\n" opens the channel; after it (thinking off closes an empty one in the prompt), the
# answer.
GEMMA4_SCRIPT = [
    (["\n", "<|channel>"], "before"),
    (["<|channel>", "thought\n", *THINK_REASONING, "<channel|>", *THINK_ANSWER, "<turn|>"], None),
]


# Gemma 4 calling get_weather in its own syntax, get_weather{city:<|"|>Paris<|"|>}: phases by "Paris", the
# quote's two successors
GEMMA4_CALL_SCRIPT = [
    (["\n", "<|tool_call>", "call:get_weather{city:", '<|"|>', "Paris"], "before"),
    (['<|"|>', "}", "<tool_call|>", "<turn|>"], "after"),
    (["Paris", '<|"|>'], "after"),
]


def gemma4_model(out: Path, script=None, max_len: int = 1024) -> Path:
    key = "<channel|>" if script is None else "Paris"
    return build_scripted_model(
        out,
        GEMMA4_SPECIALS,
        GEMMA4_WORDS,
        GEMMA4_TEMPLATE,
        script or GEMMA4_SCRIPT,
        key,
        ["<turn|>"],
        max_len,
    )


def think_model(out: Path, template: str = THINK_TEMPLATE, script=None, max_len: int = 512) -> Path:
    return build_scripted_model(
        out, THINK_SPECIALS, [], template, script or THINK_SCRIPT, "</think>", ["<|im_end|>"], max_len
    )


def harmony_model(out: Path, script=None, max_len: int = 2048) -> Path:
    return build_scripted_model(
        out,
        HARMONY_SPECIALS,
        HARMONY_WORDS,
        HARMONY_TEMPLATE,
        script or HARMONY_SCRIPT,
        "4",
        ["<|return|>", "<|call|>"],
        max_len,
    )
