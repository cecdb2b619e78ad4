"""Shared fixtures: tiny random Hugging Face models built on the fly, and the real default model."""

import functools
import os
from pathlib import Path

import pytest
import torch

TINY_TOKENIZER_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_model(out: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a small random model of the given architecture in HF layout (safetensors), with a byte-level tokenizer."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=300, max_position_embeddings=256)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=300)
        model_cls = transformers.GPT2LMHeadModel
    else:
        kw = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=arch != "qwen2",
            **common,
        )
        cfg_cls, model_cls = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        }[arch]
        cfg = cfg_cls(**{**kw, **overrides})
    cfg.bos_token_id, cfg.eos_token_id = 1, 2
    model = model_cls(cfg).eval()
    with torch.no_grad():  # random init is near zero; spread the logits so greedy choices are well separated
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    _save_tiny_tokenizer(out)
    return out


def _save_tiny_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer (256 bytes + a few merges + ChatML specials), vocabulary < 300."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": TINY_TOKENIZER_CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    cache: dict = {}

    def make(arch: str = "llama", **overrides) -> Path:
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            cache[key] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct), fetched and converted once into the weights folder."""
    from weights.fetch import ensure_default_model
    from weights.store import weights_dir

    return ensure_default_model(weights_dir(os.environ.get("KVSERVE_WEIGHTS_DIR")), progress=False)


def forward_sequence(
    model,
    cache,
    token_ids: list[int],
    num_cached: int,
    block_table: list[int],
    min_query_len: int = 1,
    cpu_kernel: bool = False,
):
    """Run one sequence's tokens [num_cached:] through the model with its K/V in `cache`; returns [n, vocab] logits.
    cpu_kernel: attention and RMSNorm by the C++ kernels rather than PyTorch ops."""
    from model.attention import build_metadata
    from model.kernels import cpu_kernels

    new = token_ids[num_cached:]
    positions, meta = build_metadata(
        [len(new)],
        [len(token_ids)],
        [block_table],
        cache.block_size,
        sliding_window=model.config.sliding_window,
        min_query_len=min_query_len,
        cpu_kernel=cpu_kernel,
    )
    model.use_cpu_kernels(cpu_kernels() if cpu_kernel else None)
    with torch.inference_mode():
        hidden = model(torch.tensor(new), positions, meta, cache)
        return model.compute_logits(hidden)


@pytest.fixture(params=["cpp", "torch"])
def run_sequence(request):
    """forward_sequence, once with each CPU path (the C++ kernels, PyTorch ops)."""
    return functools.partial(forward_sequence, cpu_kernel=request.param == "cpp")
