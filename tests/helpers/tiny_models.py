"""Tiny random Hugging Face models of every family in model/families.py, built on the fly, and running a
sequence through a kvserve model on either CPU path."""

from pathlib import Path

import torch

from model.families import FAMILIES

# Each architecture of model/families.py by the short name tests give it (tiny_model_factory("qwen3")).
# transformers' class of the same name, with its config_class, builds the tiny model. A family added to the table
# without a name here fails tests/model/test_families.py::test_every_family_has_a_tiny_model.
TINY_NAMES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MinistralForCausalLM": "ministral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Olmo2ForCausalLM": "olmo2",
    "Phi3ForCausalLM": "phi3",
    "GPT2LMHeadModel": "gpt2",
}
# short name -> architecture, for the families the table has (a name whose family left the table is dropped)
ARCHITECTURES = {short: arch for arch, short in TINY_NAMES.items() if arch in FAMILIES}
# families whose checkpoints keep norms at their init unless perturbed: these get them moved, so offsets show
NORMS_PERTURBED = set(ARCHITECTURES) - {"llama", "qwen2", "mistral", "gpt2"}

TINY_TOKENIZER_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_model(out: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a small random model of the given family (a short name) in HF layout (safetensors), with a
    byte-level tokenizer."""
    import transformers

    torch.manual_seed(seed)
    model_cls = getattr(transformers, ARCHITECTURES[arch])
    model = model_cls(tiny_config(arch, **overrides)).eval()
    with torch.no_grad():  # random init is near zero; spread the logits so greedy choices are well separated
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
            elif arch in NORMS_PERTURBED:  # norms away from their init (1, or Gemma's 0), so offsets show
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    save_tiny_tokenizer(out)
    return out


def tiny_config(arch: str, **overrides):
    """The transformers config of a tiny model of the given family (a short name)."""
    import transformers

    config_class = getattr(transformers, ARCHITECTURES[arch]).config_class
    if arch == "gpt2":
        cfg = config_class(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=300)
    else:
        kw = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=arch != "qwen2",
            vocab_size=300,
            max_position_embeddings=256,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        cfg = config_class(**{**kw, **overrides})
    cfg.bos_token_id, cfg.eos_token_id = 1, 2
    return cfg


def save_tiny_tokenizer(out: Path) -> None:
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
