"""Shared fixtures: tiny random Hugging Face models built on the fly, the real default model, and kvserve's C++
kernels as built for every CPU tier this host can execute."""

import os
from pathlib import Path

import pytest
import torch

from model import cpu_tier


def pytest_terminal_summary(terminalreporter):
    """Which CPU tier this run computed as (CI's log says it), and which others the tier tests covered."""
    tier, why = cpu_tier.select()
    runnable = ", ".join(t.name for t in cpu_tier.runnable())
    terminalreporter.write_line(f"kvserve CPU tier: {tier.name} ({why}); kernel tests ran on: {runnable}")


@pytest.fixture(params=[t.name for t in cpu_tier.runnable()])
def tier_kernels(request):
    """kvserve's C++ kernels as built for each tier this CPU can execute (an AVX-512 host: its own, avx2 and
    generic), for the kernels' own tests: every tier computes its own bits, each must be right and invariant."""
    from model.kernels import load

    return load(request.param)


TINY_TOKENIZER_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# tiny-model arch name -> transformers' (config class, model class)
FAMILY_CLASSES = {
    arch: (f"{prefix}Config", f"{prefix}ForCausalLM")
    for arch, prefix in [
        ("llama", "Llama"), ("qwen2", "Qwen2"), ("mistral", "Mistral"), ("qwen3", "Qwen3"), ("ministral", "Ministral"),
        ("smollm3", "SmolLM3"), ("granite", "Granite"), ("olmo2", "Olmo2"), ("gemma2", "Gemma2"), ("phi3", "Phi3"),
    ]
} | {"gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}  # fmt: skip
NORMS_PERTURBED = set(FAMILY_CLASSES) - {"llama", "qwen2", "mistral"}


def build_tiny_model(out: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a small random model of the given architecture in HF layout (safetensors), with a byte-level tokenizer."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=300, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
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
        config_name, model_name = FAMILY_CLASSES[arch]
        cfg = getattr(transformers, config_name)(**{**kw, **overrides})
        model_cls = getattr(transformers, model_name)
    cfg.bos_token_id, cfg.eos_token_id = 1, 2
    model = model_cls(cfg).eval()
    with torch.no_grad():  # random init is near zero; spread the logits so greedy choices are well separated
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
            elif arch in NORMS_PERTURBED:  # norms away from their init (1, or Gemma's 0), so offsets show
                p.add_(torch.randn_like(p) * 0.1)
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
    cpu_kernel: attention by the C++ kernel rather than PyTorch ops (RMSNorm is the model's own choice)."""
    from model.attention import TorchAttention
    from model.attention_cpu import CpuKernelAttention
    from model.kernels import cpu_kernels

    config = model.config
    if cpu_kernel:
        attention = CpuKernelAttention(cpu_kernels(), cache.block_size)
    else:
        attention = TorchAttention(
            cache.block_size, config.num_kv_heads, cache.num_blocks, "cpu", config.windows, min_query_len
        )
    new = token_ids[num_cached:]
    positions, meta = attention.build([len(new)], [len(token_ids)], [block_table])
    original = config.longrope_original_len  # LongRoPE: the long factors once the sequence outgrows it
    long_rope = torch.full((len(new),), len(token_ids) > original) if original else None
    with torch.inference_mode():
        hidden = model(torch.tensor(new), positions, meta, cache, long_rope)
        return model.compute_logits(hidden)


class CpuPath:
    """Load and run models with the C++ CPU kernels (attention, RMSNorm, SwiGLU) or with PyTorch ops."""

    def __init__(self, kernels: bool):
        self.kernels = kernels

    def load(self, path, dtype=torch.float32, linear=None):
        from model.kernels import cpu_kernels
        from model.linear import PlainLinear
        from model.loader import load_model
        from model.transformer import Ops

        ops = Ops.with_kernels(linear or PlainLinear(), cpu_kernels() if self.kernels else None)
        return load_model(path, dtype, "cpu", ops)

    def run(self, model, cache, token_ids, num_cached, block_table, min_query_len=1):
        return forward_sequence(model, cache, token_ids, num_cached, block_table, min_query_len, self.kernels)


@pytest.fixture(params=["cpp", "torch"])
def cpu_path(request) -> CpuPath:
    """Each model test runs once with each CPU path (the C++ kernels, PyTorch ops)."""
    return CpuPath(request.param == "cpp")


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Google's Gemma 3 270M (base, Q4_K_M) GGUF, fetched once into the weights folder: a real gemma3 file with a
    262,144-piece SentencePiece vocabulary. Tests using it are marked slow."""
    from weights.fetch import gemma3_270m_gguf
    from weights.store import weights_dir

    return gemma3_270m_gguf(weights_dir(os.environ.get("KVSERVE_WEIGHTS_DIR")), progress=False)
