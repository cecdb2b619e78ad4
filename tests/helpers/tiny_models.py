"""Tiny random Hugging Face models of every family in model/families.py, built on the fly, and running a
sequence through a kvserve model on either CPU path."""

import dataclasses
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
    "Gemma4ForCausalLM": "gemma4",
    "Olmo2ForCausalLM": "olmo2",
    "Phi3ForCausalLM": "phi3",
    "GPT2LMHeadModel": "gpt2",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "OlmoeForCausalLM": "olmoe",
    "GraniteMoeForCausalLM": "granitemoe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
}
# short name -> architecture, for the families the table has (a name whose family left the table is dropped)
ARCHITECTURES = {short: arch for arch, short in TINY_NAMES.items() if arch in FAMILIES}
# families whose checkpoints keep norms at their init unless perturbed: these get them moved, so offsets show
NORMS_PERTURBED = set(ARCHITECTURES) - {"llama", "qwen2", "mistral", "gpt2"}

# short name -> the config overrides of its family's tiny model, whose dims hit the family's edge cases (explicit
# head_dim, a window shorter than the prompt, per-layer windows and RoPE bases, NoPE layers, tied and untied
# heads, Granite's scalars, Gemma 2's soft-caps, experts); none: build_tiny_model's defaults
FAMILY_OVERRIDES = {
    "mistral": dict(sliding_window=8),
    "qwen3": dict(head_dim=32, tie_word_embeddings=False),
    "gemma3": dict(
        num_hidden_layers=6, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),
    # Gemma 4: full layers of their own heads (64 wide, one KV head, keys as values, a quarter of the pairs turning),
    # sliding layers of 16-wide heads, per-layer inputs, a final soft-cap; the last two layers read the K/V of the
    # last earlier one of their kind, with double-wide MLPs (E2B's shape)
    "gemma4": dict(
        num_hidden_layers=5, head_dim=16, sliding_window=8, global_head_dim=64, num_global_key_value_heads=1,
        attention_k_eq_v=True, hidden_size_per_layer_input=32, vocab_size_per_layer_input=300,
        final_logit_softcapping=30.0, num_kv_shared_layers=2, use_double_wide_mlp=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    ),
    "gemma2": dict(
        num_hidden_layers=4, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
        attn_logit_softcapping=2.0, final_logit_softcapping=1.5,
    ),
    "olmo2": dict(),
    "granite": dict(embedding_multiplier=6.0, attention_multiplier=0.3, residual_multiplier=0.5, logits_scaling=4.0),
    "smollm3": dict(num_hidden_layers=4),  # layer 3 has no RoPE
    "ministral": dict(
        num_hidden_layers=4, head_dim=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
    ),
    # Phi-4-mini's shape in small: partial rotary, LongRoPE past 16 positions, fused qkv and gate_up
    "phi3": dict(
        partial_rotary_factor=0.75, original_max_position_embeddings=16, tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 1e4,
            "short_factor": [1.0 + 0.1 * i for i in range(6)], "long_factor": [2.0 + 0.5 * i for i in range(6)],
        },
    ),
    # MoE: 8 experts, each token takes 2 or 3; Qwen's dense layer among sparse ones, a shared expert, a router
    # renormalized or not, Granite's scalars around experts
    "qwen3moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
                     norm_topk_prob=True, head_dim=32),
    "qwen2moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                     shared_expert_intermediate_size=64),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "granitemoe": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, embedding_multiplier=6.0,
                       attention_multiplier=0.3, residual_multiplier=0.5, logits_scaling=4.0),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=8),
    # GPT-OSS: sinks, windows on every other layer, YaRN from 16 positions to 256, biases everywhere, a SwiGLU clamped
    # where this model's values reach (limit 1), the router's softmax over its top 4 biased logits
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=4, intermediate_size=32, num_hidden_layers=4,
                    head_dim=16, sliding_window=8, swiglu_limit=1.0,
                    rope_parameters={"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 16,
                                     "rope_theta": 1e4}),
    # Qwen3.5: three Gated DeltaNet layers (2 key heads shared by 4 value heads, a 4-tap convolution), then gated
    # attention with partial rotary (a quarter of 32 dims) and zero-centred norms
    "qwen3_5": dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4),
    # Qwen3.5-MoE: Qwen3.5's mixers, 8 experts (2 a token, renormalized) and a shared one on every layer; two
    # layers, one of each mixer
    "qwen3_5_moe": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=64),
    # Qwen3-Next: a DeltaNet layer then gated attention (full_attention_interval 2), DeltaNet's projections grouped
    # by key head (2 key heads of 2 value heads each, so regrouping them moves rows); 4 experts (2 a token,
    # renormalized) and a shared one on layer 0, a dense MLP on layer 1 (mlp_only_layers). Two layers, as
    # Qwen3.5-MoE's: with four, 8-bit weights flip enough tokens' experts to leave the quantized logits 9.7% off
    # the dense ones (measured; Qwen3.5-MoE's with four layers 11.9%), past test_families' 5%
    "qwen3_next": dict(num_hidden_layers=2, full_attention_interval=2, head_dim=32, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                       mlp_only_layers=[1]),
}  # fmt: skip
# Every family of the table, by its short name: a family added to model/families.py joins every test built on it.
ARCHES = [TINY_NAMES.get(architecture, architecture) for architecture in FAMILIES]


def tiny_family(factory, arch: str) -> Path:
    """The tiny model of a family (a short name), with its FAMILY_OVERRIDES, from the session's factory."""
    return factory(arch, **FAMILY_OVERRIDES.get(arch, {}))


TINY_TOKENIZER_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def reference_model(path, dtype: torch.dtype = torch.float32):
    """transformers' own model of a checkpoint, as the numerical reference: eager attention (older releases run
    Gemma 2 through SDPA by default, which drops its soft-cap: transformers 5.17, the H200's) and GPT-OSS's SwiGLU
    clamp as the config says (5.17 fixes it at 7.0 whatever swiglu_limit is; the tiny model's is 1.0, to reach
    it)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager"
    ).eval()
    limit = getattr(model.config, "swiglu_limit", None)
    for module in model.modules():
        if limit is not None and type(module).__name__ == "GptOssExperts":
            module.limit = limit
    return model


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
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's, 1 at init
                b.uniform_(0.5, 1.5)
        if (
            arch == "gemma4"
        ):  # its q norm scales the scores (no 1/sqrt(d)): as a trained one does, not at init's 1
            for name, p in model.named_parameters():
                if name.endswith("q_norm.weight"):
                    p.mul_(p.shape[0] ** -0.5)
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
    gpu_attention: str | None = None,
    device: str = "cpu",
):
    """Run one sequence's tokens [num_cached:] through the model with its K/V in `cache`; returns [n, vocab] logits.
    block_table: the first KV group's; each further group g reads and writes the same blocks shifted by g times
    the highest one plus one (a cache for G groups needs G times the table's blocks: cache_blocks). cpu_kernel:
    attention by the C++ kernel rather than PyTorch ops (RMSNorm is the model's own choice); gpu_attention: a GPU's
    instead, run on the CPU: "sdpa" (PyTorch ops through torch's fused SDPA) or "triton" (model/attention_triton.py,
    under Triton's interpreter where the caller set TRITON_INTERPRET=1); device: where the model and cache are
    (a GPU's attention on a GPU: the `cuda` tests)."""
    from model.attention import TorchAttention
    from model.attention_cpu import CpuKernelAttention
    from model.deltanet import StepStates
    from model.kernels import cpu_kernels

    config = model.config
    if cpu_kernel:
        attention = CpuKernelAttention(cpu_kernels(), cache.block_size)
    elif gpu_attention == "triton":
        from model.attention_triton import TritonAttention

        attention = TritonAttention.for_model(config, cache.block_size, torch.device(device))
    else:
        attention = TorchAttention(
            cache.block_size,
            config.num_kv_heads if config.uniform_kv else None,
            cache.num_blocks,
            torch.device(device),
            config.kv_group_windows,
            min_query_len,
            sdpa=gpu_attention == "sdpa",
        )
    new = token_ids[num_cached:]
    shift = max(block_table) + 1
    tables = [[b + g * shift for b in block_table] for g in range(len(config.kv_groups))]
    assert len(tables) * shift <= cache.num_blocks, "the cache is too small for every KV group's blocks"
    positions, meta = attention.build([len(new)], [len(token_ids)], [tables])
    states = StepStates([0], [len(new)], [0], [num_cached])  # a DeltaNet layer's: the cache's slot 0
    original = config.longrope_original_len  # LongRoPE: the long factors once the sequence outgrows it
    long_rope = torch.full((len(new),), len(token_ids) > original, device=device) if original else None
    with torch.inference_mode():
        hidden = model(torch.tensor(new, device=device), positions, meta, cache, long_rope, states)
        return model.compute_logits(hidden).cpu()


def cache_blocks(config, per_group: int) -> int:
    """The blocks of a cache holding per_group blocks in each of the model's KV groups (forward_sequence's
    tables)."""
    return per_group * max(1, len(config.kv_groups))


class CpuPath:
    """Load and run models with the C++ CPU kernels (attention, RMSNorm, SwiGLU) or with PyTorch ops (gpu_attention:
    a GPU's attention run on the CPU, as forward_sequence says, its Triton norms, SwiGLU and DeltaNet recurrence,
    its grouped experts (model/moe_triton.py) and its DeltaNet decodes and prompts all at once); device: where they
    run (a GPU's ops on a GPU: the `cuda` tests)."""

    def __init__(self, kernels: bool, gpu_attention: str | None = None, device: str = "cpu"):
        assert not (kernels and gpu_attention), "the C++ kernels have their own attention"
        self.kernels, self.gpu_attention, self.device = kernels, gpu_attention, device

    def load(self, path, dtype=torch.float32, linear=None):
        from model.kernels import cpu_kernels
        from model.linear import PlainLinear
        from model.loader import load_model
        from model.transformer import Ops

        ops = Ops.with_kernels(linear or PlainLinear(), cpu_kernels() if self.kernels else None)
        # a GPU's ops: its norms, SwiGLU and DeltaNet decodes' recurrence as Triton kernels, sparse layers' experts
        # as grouped Triton GEMMs, a DeltaNet layer's decodes and prompts all at once
        if self.gpu_attention is not None:
            from model.deltanet_triton import deltanet_decodes
            from model.fused_triton import rms_norm, silu_mul
            from model.moe_triton import grouped_experts

            ops = dataclasses.replace(ops, rms_norm=rms_norm, silu_mul=silu_mul, grouped_experts=grouped_experts,
                                      parallel_deltanet=True, deltanet_decodes=deltanet_decodes)  # fmt: skip
        return load_model(path, dtype, self.device, ops)

    def run(self, model, cache, token_ids, num_cached, block_table, min_query_len=1):
        return forward_sequence(model, cache, token_ids, num_cached, block_table, min_query_len, self.kernels,
                                self.gpu_attention, self.device)  # fmt: skip


def tokens_together_and_alone(path, kernels: str) -> tuple[dict, dict]:
    """Greedy tokens of six prompts through the engine (chunked prefills beside decodes, past any window), all
    together and each alone: (together, alone), by request id."""
    from server.engine.config import EngineConfig
    from server.engine.engine import Engine
    from server.engine.request import SamplingParams

    config = EngineConfig(kv_cache_memory=4 << 20, block_size=4, max_num_batched_tokens=24, dtype="float32",
                          batch_invariant=True, cpu_kernels=kernels)  # fmt: skip
    engine = Engine(str(path), config)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    prompts = {f"p{i}": torch.randint(3, 300, (int(n),), generator=g).tolist()
               for i, n in enumerate(torch.randint(4, 40, (6,), generator=g))}  # fmt: skip

    def run(batch):
        tokens = {rid: [] for rid in batch}
        for rid, ids in batch.items():
            engine.add_request(rid, ids, params)
        while engine.has_work():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        return tokens

    return run(prompts), {rid: run({rid: ids})[rid] for rid, ids in prompts.items()}
