"""Tiny Qwen3-Embedding- and Qwen3-Reranker-shaped models: a tiny random Qwen3 with an embedder's
sentence-transformers files, or in a folder named a reranker with "yes" and "no" as tokens of their own."""

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"


def make_embedder(qwen3: Path, out: Path, pooling: str = "lasttoken", normalize: bool = True) -> Path:
    """A copy of the tiny Qwen3 at `qwen3` laid out as sentence-transformers saves Qwen3-Embedding: modules.json
    (Transformer, Pooling, Normalize), 1_Pooling/config.json and config_sentence_transformers.json's prompts."""
    shutil.copytree(qwen3, out)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    modes = (
        "cls_token",
        "mean_tokens",
        "max_tokens",
        "mean_sqrt_len_tokens",
        "weightedmean_tokens",
        "lasttoken",
    )
    config = {"word_embedding_dimension": 64, **{f"pooling_mode_{m}": m == pooling for m in modes}}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(config))
    prompts = {"prompts": {"query": QUERY_PROMPT, "document": ""}, "default_prompt_name": None}
    (out / "config_sentence_transformers.json").write_text(json.dumps(prompts))
    return out


def strip_to_backbone(folder: Path) -> Path:
    """Store the checkpoint as Qwen3-Embedding's is: the backbone's tensors alone, without their `model.`
    prefix and without the LM head (tied in 0.6B's config; untied in 8B's, whose head is simply not there)."""
    tensors = load_file(folder / "model.safetensors")
    flat = {k.removeprefix("model."): v for k, v in tensors.items() if k != "lm_head.weight"}
    save_file(flat, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def make_reranker(qwen3: Path, out: Path) -> Path:
    """A copy of the tiny Qwen3 at `qwen3` in a folder named a reranker, its tokenizer given "yes" and "no"
    (single tokens in Qwen's vocabulary, as Qwen3-Reranker reads them)."""
    shutil.copytree(qwen3, out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokenizer.add_tokens(["yes", "no"])
    tokenizer.save(str(out / "tokenizer.json"))
    return out
