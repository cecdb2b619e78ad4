"""ModelConfig: read once from a Hugging Face `config.json`, architecture differences absorbed here."""

import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# HF architecture name -> our family. Everything else is refused by name.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "GPT2LMHeadModel": "gpt2",
}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # family: llama | mistral | qwen2 | gpt2
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    mlp: str = "swiglu"  # swiglu (gate/up/down, SiLU) | gelu (fc/proj, tanh-approximate GELU)
    positions: str = "rope"  # rope | learned
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, float], ...] = ()  # llama3 scaling parameters, sorted (key, value) pairs
    qkv_bias: bool = False
    out_bias: bool = False  # bias on the attention output and MLP projections (gpt2)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # mistral: keys further back than this are not attended
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # union of config.json and generation_config.json
    torch_dtype: str = "float32"  # the checkpoint's dtype

    @property
    def rope_scaling_dict(self) -> dict[str, float]:
        return dict(self.rope_scaling)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        return cls.from_dict(cfg, gen)

    @classmethod
    def from_dict(cls, cfg: dict, generation_config: dict | None = None) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            name = archs[0] if archs else cfg.get("model_type", "<none>")
            raise UnsupportedModelError(
                f"unsupported architecture {name!r}; kvserve supports {', '.join(sorted(ARCHITECTURES))}"
            )
        eos = _as_ids(cfg.get("eos_token_id")) + _as_ids((generation_config or {}).get("eos_token_id"))
        common = dict(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(sorted(set(eos))),
            tie_word_embeddings=cfg.get("tie_word_embeddings", arch == "gpt2"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )
        if arch == "gpt2":
            hidden, heads = cfg["n_embd"], cfg["n_head"]
            return cls(
                **common,
                hidden_size=hidden,
                num_layers=cfg["n_layer"],
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=hidden // heads,
                intermediate_size=cfg.get("n_inner") or 4 * hidden,
                max_position_embeddings=cfg["n_positions"],
                norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
                norm="layernorm",
                mlp="gelu",
                positions="learned",
                qkv_bias=True,
                out_bias=True,
            )
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        # transformers 5 moved rope_theta / rope_scaling into one `rope_parameters` dict.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise UnsupportedModelError(f"unsupported rope scaling type {rope_type!r}")
        scaling = ()
        if rope_type == "llama3":
            keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            scaling = tuple(sorted((k, float(rope[k])) for k in keys))
        window = cfg.get("sliding_window") if arch == "mistral" else None
        if arch == "qwen2" and cfg.get("use_sliding_window"):
            window = cfg.get("sliding_window")
        return cls(
            **common,
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            out_bias=False,
            sliding_window=window,
        )


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
