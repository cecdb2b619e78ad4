"""Make random-weight Gemma 4 files of real shapes for speed comparisons against llama.cpp: a Hugging Face folder
from transformers' own Gemma4ForCausalLM (seed 0, bfloat16) with a tokenizer of Gemma 4's kind and size, converted
by llama.cpp's converter and quantized by its `llama-quantize` (scripts/make_hybrid_gguf.py's steps), so the GGUF is
llama.cpp's own. `../shared/peer/make_model.sh` has no Gemma 4 shape; this is its counterpart for them.

    python scripts/make_gemma4_gguf.py e2b           # Gemma 4 E2B's whole text model (35 layers, 4.6 B parameters)
    python scripts/make_gemma4_gguf.py 26b-a4b-L6    # 26B-A4B's layers cut to six (five sliding, one full): 5.6 B

The vocabulary is Gemma's 262,144 tokens (the LM head and the per-layer embeddings are a large share of E2B's step
and file), spelled as Gemma's are (a BPE over '▁' text with byte fallback, the chat markers as their own tokens) but
learned from nothing: text tokenizes to one or two characters a token. Random weights: only speed and memory mean
anything. Needs build_peer.sh's llama.cpp tree, its `llama-quantize` and converter venv (`--peer-dir`, default
/tmp/peer), and this venv's transformers (`scripts/install.sh --test`). Each: ~10 GB for the folder (made in
bfloat16: ~12 GB of memory at its peak), ~10 minutes on 2 cores.
"""

import argparse
import json
import sys
from pathlib import Path

VOCAB = 262144
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"]
VISIBLE = [
    "<|channel>",
    "<channel|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    '<|"|>',
]
COMMON = dict(
    vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, head_dim=256, global_head_dim=512, sliding_window=512,
    final_logit_softcapping=30.0, rms_norm_eps=1e-6, max_position_embeddings=131072, tie_word_embeddings=True,
    pad_token_id=0, eos_token_id=1, bos_token_id=2,
)  # fmt: skip
SHAPES = {  # what each shape sets beyond COMMON, and its repeating pattern of layer kinds
    "e2b": (dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
                 num_key_value_heads=1, hidden_size_per_layer_input=256, num_kv_shared_layers=20,
                 use_double_wide_mlp=True, attention_k_eq_v=False), 4),
    "26b-a4b-L6": (dict(hidden_size=2816, intermediate_size=2112, num_hidden_layers=6, num_attention_heads=16,
                        num_key_value_heads=8, num_global_key_value_heads=2, attention_k_eq_v=True,
                        hidden_size_per_layer_input=0, sliding_window=1024, enable_moe_block=True, num_experts=128,
                        top_k_experts=8, moe_intermediate_size=704), 5),
}  # fmt: skip


def write_tokenizer(out: Path) -> None:
    """Gemma's kind of tokenizer at Gemma's size: the specials, 256 byte tokens, printable characters, merges into
    '▁'-led letters and pairs of lowercase letters (text takes a token per one or two characters, a sentence about
    as many tokens as llama.cpp's tokenizer makes of it), then '▁'-led filler pieces up to VOCAB."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    merges = [("▁", c) for c in letters] + [(a, b) for a in letters for b in letters]
    pieces = [
        *SPECIALS,
        *VISIBLE,
        *(f"<0x{byte:02X}>" for byte in range(256)),
        "▁",
        *map(chr, range(33, 127)),
    ]
    pieces += [a + b for a, b in merges]
    pieces += [f"▁w{i}" for i in range(VOCAB - len(pieces))]
    save_tokenizer(out, {piece: i for i, piece in enumerate(pieces)}, merges, SPECIALS, VISIBLE)


def save_tokenizer(out: Path, vocab: dict, merges: list, specials: list, visible: list) -> None:
    """tokenizer.json and tokenizer_config.json as Gemma's: a BPE over "▁"-spelled text with byte fallback, the
    specials and the markers llama.cpp's converter keeps visible as added tokens (tests/weights/test_gguf_gemma4.py
    writes its tiny ones with this too)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    tokenizer = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials + visible])
    tokenizer.save(str(out / "tokenizer.json"))
    named = ("<pad>", "<eos>", "<bos>", "<unk>")
    config = {
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "additional_special_tokens": [t for t in specials if t not in named] + visible,
        "tokenizer_class": "GemmaTokenizerFast",
        "chat_template": "{{ bos_token }}{% for m in messages %}<|turn>{{ m['role'] }}\n{{ m['content'] }}<turn|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}",
    }  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def write_folder(shape: str, out: Path) -> None:
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    dims, sliding_run = SHAPES[shape]
    pattern = ["sliding_attention"] * sliding_run + ["full_attention"]
    layers = dims["num_hidden_layers"]
    config = Gemma4TextConfig(**(COMMON | dims), layer_types=(pattern * layers)[:layers])
    config.layer_types[-1] = "full_attention"  # every Gemma 4 ends on a full layer
    config.architectures = ["Gemma4ForCausalLM"]
    torch.manual_seed(0)
    model = Gemma4ForCausalLM._from_config(config, dtype=torch.bfloat16)  # made in bfloat16: no float32 copy
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size="20GB")
    write_tokenizer(out)
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    print(f"{shape}: {type(model).__name__}, {billions:.2f} B parameters, in {out}", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--peer-dir", type=Path, default=Path("/tmp/peer"))
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type")
    args = parser.parse_args()
    from make_hybrid_gguf import convert_and_quantize  # beside this script

    folder = args.peer_dir / "models" / f"gemma4-{args.shape}"
    print(convert_and_quantize(folder, args.peer_dir, args.type, lambda: write_folder(args.shape, folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
