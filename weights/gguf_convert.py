"""Convert a GGUF file into the Hugging Face folder layout kvserve loads, and transformers loads to the same model:
what `kvserve convert-gguf` does. (kvserve serves a GGUF file in place, without this: weights/gguf_source.py.)

Every architecture in weights/gguf_arch.py's FAMILIES (Llama 2/3.x and Mistral, Qwen 2/3, Gemma 2/3, Phi-3, OLMo 2,
Granite, SmolLM3; the MoE Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral, one tensor per expert, and Granite MoE, every
expert's in one tensor), but GPT-OSS and Qwen3.5/3.6 (served in place only: Family.in_place_only says why). The folder gets config.json (transformers' format), generation_config.json, tokenizer.json,
tokenizer_config.json (weights/gguf_tokenizer.py), and the weights under Hugging Face tensor names and row order,
with llama.cpp's conversion undone as GGUFSource undoes it (q/k rows, Gemma's +1 on norms, fused or split q/k/v,
RoPE tensors into config):
- quantized/model.safetensors: the GGUF's quantized weights as they are (their raw block rows, see
  QUANTIZED_FORMAT), every other tensor in float32. kvserve serves it on CPU.
- model.safetensors (unless dense=False): every tensor dequantized, for the dequantized path and transformers.
Anything the converter cannot reproduce faithfully raises UnsupportedGGUFError naming it, rather than writing a
subtly wrong model.
"""

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from weights.gguf_source import GGMLBlocks, GGUFSource
from weights.gguf_tokenizer import UnsupportedGGUFError

__all__ = ["QUANTIZED_FILE", "QUANTIZED_FORMAT", "UnsupportedGGUFError", "convert_gguf", "faithful_dtype"]

# in a sub-folder, so that tools reading every top-level *.safetensors of the folder (llama.cpp's converter,
# vLLM) never meet it
QUANTIZED_FILE = "quantized/model.safetensors"
# How quantized/model.safetensors stores a quantized weight W [N, K], read by model/loader.py: "W" uint8
# [N, bytes per row], the GGUF's block rows in Hugging Face's row order; the metadata's "ggml" (JSON) maps W to
# [GGML type name, N, K]. A weight stacking every expert's (Granite MoE's) is uint8 [experts, N, bytes per row]
# and [GGML type name, experts, N, K]. Dense tensors are float32 under their plain name.
QUANTIZED_FORMAT = "kvserve-quantized-2"


def convert_gguf(src: Path, dst: Path, progress: bool = True, dense: bool = True) -> None:
    source = GGUFSource(src)
    if not source.family.convertible:
        raise UnsupportedGGUFError(
            f"{src.name}: {source.family.in_place_only}; serve the file in place (kvserve serve --model FILE.gguf)"
        )
    config = dict(source.config)
    tensors, quantized, ggml = {}, {}, {}
    for name in tqdm(source.shapes, desc="Converting GGUF tensors", unit="tensor", disable=not progress):
        value = source.get(name)
        if isinstance(value, GGMLBlocks):
            quantized[name] = value.blocks.contiguous()
            ggml[name] = [value.type_name, *value.shape]
        else:
            quantized[name] = value
        if dense:
            tensors[name] = value if not isinstance(value, GGMLBlocks) else source.dense(name)
    # the dtype that holds every dequantized value bit for bit (the quantized file's dense tensors are float32)
    dtype = faithful_dtype(list(tensors.values())) if dense else torch.float32
    config["torch_dtype"] = str(dtype).removeprefix("torch.")

    dst.mkdir(parents=True, exist_ok=True)
    files = {QUANTIZED_FILE: (quantized, {"format": QUANTIZED_FORMAT, "ggml": json.dumps(ggml)})}
    if dense:
        files["model.safetensors"] = ({name: t.to(dtype) for name, t in tensors.items()}, {"format": "pt"})
    for file, (contents, metadata) in files.items():
        (dst / file).parent.mkdir(exist_ok=True)
        save_file(contents, dst / file, metadata)
        # safetensors creates the file owner-only (0600); a server running as another user must still read it.
        (dst / file).chmod(0o644)
    source.tokenizer.save(str(dst / "tokenizer.json"))
    write_json(dst / "tokenizer_config.json", source.tokenizer_config)
    write_json(dst / "config.json", config)
    write_json(dst / "generation_config.json", source.generation_config)


def faithful_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    """The narrowest dtype that holds every dequantized value bit for bit; float32 always does."""
    for dtype in (torch.float16, torch.bfloat16):
        if all(torch.equal(t.to(dtype).float(), t) for t in tensors):
            return dtype
    return torch.float32


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
