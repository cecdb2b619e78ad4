"""Make the random-weight hybrid files of the README's Qwen3.5 and Qwen3.6 rows: a Hugging Face folder from
transformers' own classes (seed 0, bfloat16), converted by llama.cpp's converter and quantized by its
`llama-quantize`, so the GGUF is llama.cpp's own. `../shared/peer/make_model.sh` has no Qwen3.5 shape; this is
its counterpart for them.

    python scripts/make_hybrid_gguf.py q35        # Qwen3.5's shape near 1.5B: 24 layers, FFN 6144, tied
    python scripts/make_hybrid_gguf.py q36moe-L4  # Qwen3.6-35B-A3B's layers cut to four: 256 experts of 512

Both: hidden 2048, SmolLM2's 49,152-token vocabulary (so the tokenizer is a real one every tool reads), Gated
DeltaNet with 16 key heads of 128 and a convolution of 4, gated attention on every fourth layer with heads of 256
(8 query and 2 KV heads for q35, 16 and 2 for the cut); q35 has 16 value heads, the cut 32 (as Qwen3.6-35B-A3B),
8 experts a token and a shared expert of 512. Random weights: only speed and memory mean anything.

Needs transformers 5 with Qwen3.5 (this venv's, `scripts/install.sh --test`), build_peer.sh's llama.cpp tree,
its `llama-quantize` and converter venv (`--peer-dir`, default /tmp/peer), and SmolLM2's tokenizer folder
(`kvserve fetch`, then `kvserve convert-gguf` into weights/smollm2-135m-instruct). Writes PEER/models/NAME/ (the
folder) and PEER/models/NAME.Q4_K_M.gguf; the float16 GGUF in between is removed. ~3 minutes for q35, ~8 for the
cut on 2 cores; ~3 and ~7 GB of disk for the folders.
"""

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

# Each shape's transformers config: model type, then what differs from COMMON
COMMON = dict(
    vocab_size=49152, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6, max_position_embeddings=32768,
    hidden_size=2048, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
)  # fmt: skip
SHAPES = {
    "q35": ("qwen3_5_text", dict(num_hidden_layers=24, intermediate_size=6144, linear_num_value_heads=16,
                                 tie_word_embeddings=True)),
    "q36moe-L4": ("qwen3_5_moe_text", dict(num_hidden_layers=4, num_attention_heads=16, linear_num_value_heads=32,
                                           moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                           num_experts=256, num_experts_per_tok=8, tie_word_embeddings=False)),
}  # fmt: skip
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


def write_folder(shape: str, out: Path, tokenizer: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kind, dims = SHAPES[shape]
    config = AutoConfig.for_model(kind, **{**COMMON, **dims})
    # gated attention on every fourth layer, Gated DeltaNet on the rest (the real models' pattern)
    config.layer_types = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(config.num_hidden_layers)
    ]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="20GB")
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, out / name)
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    print(f"{shape}: {type(model).__name__}, {billions:.2f} B parameters, in {out}", file=sys.stderr)


def convert_and_quantize(
    folder: Path, peer_dir: Path, quant_type: str, write_folder, flags: tuple[str, ...] = ()
) -> Path:
    """folder's GGUF of quant_type, made by llama.cpp's converter and llama-quantize; write_folder() first writes
    the Hugging Face folder where it is missing; flags: the converter's. Returns the file (found, where it was made
    before)."""
    f16 = folder.with_name(f"{folder.name}.F16.gguf")
    gguf = folder.with_name(f"{folder.name}.{quant_type}.gguf")
    if gguf.exists():
        return gguf
    converter = peer_dir / "llama.cpp" / "convert_hf_to_gguf.py"
    quantize = peer_dir / "llama.cpp" / "build" / "bin" / "llama-quantize"
    python = peer_dir / "venv" / "bin" / "python"
    for need in (converter, quantize, python):
        if not need.exists():
            sys.exit(f"missing {need}: run ../shared/peer/build_peer.sh weights/smollm2-135m-instruct first")
    if not (folder / "config.json").exists():
        write_folder()
    subprocess.run([python, converter, folder, "--outtype", "f16", *flags, "--outfile", f16], check=True)
    subprocess.run([quantize, f16, gguf, quant_type, "2"], check=True)
    f16.unlink()
    return gguf


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--peer-dir", type=Path, default=Path("/tmp/peer"))
    parser.add_argument("--tokenizer", type=Path, default=Path("weights/smollm2-135m-instruct"))
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type")
    args = parser.parse_args()
    if not (args.tokenizer / "tokenizer.json").exists():
        sys.exit(
            f"missing {args.tokenizer / 'tokenizer.json'}: kvserve fetch, then kvserve convert-gguf into it"
        )
    folder = args.peer_dir / "models" / args.shape
    write = lambda: write_folder(args.shape, folder, args.tokenizer)  # noqa: E731
    # a random model carries no multi-token-prediction layers
    print(convert_and_quantize(folder, args.peer_dir, args.type, write, flags=("--no-mtp",)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
