"""What the model is served for, decided once at start: generation, embeddings (with which pooling, normalised
or not, and the model's named prompts) or relevance scores (a reranker). --task and --pooling say it; otherwise
the model's own files do: a sentence-transformers folder (modules.json, 1_Pooling/config.json,
config_sentence_transformers.json) or a GGUF file with a `pooling_type` is an embedder; a Qwen3 named a
reranker (Qwen3-Reranker), or a GGUF of pooling type rank, scores: the yes/no scoring of server/api/scoring.py
is Qwen3-Reranker's, and another model named a reranker (a cross-encoder, another LLM's prompt) would be scored
wrong, so only --task score serves one.

A served task adds routes; it takes none away: an embedder whose checkpoint has an LM head still generates.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from server.engine.request import Pooling

TASKS = ("auto", "generate", "embed", "score", "rerank")  # rerank: score, as llama.cpp's --reranking says it
# sentence-transformers' Pooling modes kvserve computes (1_Pooling/config.json's pooling_mode_* keys)
POOLING_MODES = {"lasttoken": Pooling.LAST, "mean_tokens": Pooling.MEAN, "cls_token": Pooling.CLS}
NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
POOLING_MODULE = "sentence_transformers.models.Pooling"
GGUF_POOLING = {"mean": Pooling.MEAN, "cls": Pooling.CLS, "last": Pooling.LAST}  # a GGUF's pooling_type
RERANKER_ARCHITECTURE = "Qwen3ForCausalLM"  # Qwen3-Reranker's, the scoring kvserve implements


@dataclass(frozen=True)
class ServedTask:
    task: str  # generate | embed | score
    pooling: Pooling = Pooling.LAST  # for embeddings (a reranker reads its last position's logits)
    normalize: bool = True  # embeddings come out as unit vectors (sentence-transformers' Normalize module)
    # sentence-transformers' named prompts, put before an input that names one (Qwen3-Embedding's "query":
    # "Instruct: ...\nQuery:"); documents take none
    prompts: dict[str, str] = field(default_factory=dict)
    why: str = ""  # where the choice came from, for the log


def select_task(model, task: str = "auto", pooling: str | None = None) -> ServedTask:
    """The task of `model` (a Hugging Face folder's path, or a source: its `name` is its file's path), from
    --task and --pooling (None: the model's), else from its files. Raises ValueError naming what it cannot
    serve."""
    if task not in TASKS:
        raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    task = "score" if task == "rerank" else task
    folder = Path(model) if isinstance(model, str | Path) else None
    name = Path(model if folder is not None else model.name).name.lower()
    st = sentence_transformers_config(folder) if folder is not None else gguf_config(model)
    config = json.loads((folder / "config.json").read_text()) if folder is not None else model.config
    qwen3 = (config.get("architectures") or [""])[0] == RERANKER_ARCHITECTURE
    if task == "auto":
        if qwen3 and ("reranker" in name or (folder is None and model.pooling_type == "rank")):
            task, why = "score", f"a Qwen3 named a reranker, or of GGUF pooling_type rank ({name})"
        elif st is not None:
            task, why = "embed", "an embedder's files"
        elif pooling is not None:
            task, why = "embed", "--pooling was given"
        else:
            return ServedTask("generate", why="a causal LM")
    else:
        why = f"--task {task}"
    if task != "embed":
        return ServedTask(task, why=why)
    chosen = st or ServedTask("embed", why="last-token pooling, normalised: a decoder's default")
    if pooling is not None:
        chosen = ServedTask("embed", Pooling(pooling), chosen.normalize, chosen.prompts, "--pooling")
    return ServedTask("embed", chosen.pooling, chosen.normalize, chosen.prompts, f"{why}; {chosen.why}")


def gguf_config(source) -> ServedTask | None:
    """An embedder's pooling as a GGUF file records it (llama.cpp normalises what it pools); None for a causal LM
    (no pooling_type, or none) or a reranker (rank)."""
    pooling = GGUF_POOLING.get(source.pooling_type)
    if pooling is None:
        return None
    return ServedTask("embed", pooling, True, {}, f"the GGUF's pooling_type: {source.pooling_type}")


def sentence_transformers_config(folder: Path) -> ServedTask | None:
    """An embedder's pooling, normalisation and prompts as its sentence-transformers files give them; None when
    the folder has none."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    normalize = any(m.get("type") == NORMALIZE_MODULE for m in modules)
    pooling_dir = next((m.get("path", "") for m in modules if m.get("type") == POOLING_MODULE), None)
    pooling, why = Pooling.LAST, "no Pooling module: the last token's"
    if pooling_dir is not None:
        config = json.loads((folder / pooling_dir / "config.json").read_text())
        modes = [mode.removeprefix("pooling_mode_") for mode in config if mode.startswith("pooling_mode_")]
        modes = [mode for mode in modes if config[f"pooling_mode_{mode}"]]
        if len(modes) != 1 or modes[0] not in POOLING_MODES:
            raise ValueError(
                f"{folder / pooling_dir / 'config.json'} asks for {', '.join(modes) or 'no pooling'}; kvserve "
                f"pools one of: {', '.join(POOLING_MODES)} (or say --pooling last|mean|cls)"
            )
        pooling, why = POOLING_MODES[modes[0]], f"{pooling_dir}/config.json: pooling_mode_{modes[0]}"
    st_file = folder / "config_sentence_transformers.json"
    prompts = json.loads(st_file.read_text()).get("prompts") or {} if st_file.is_file() else {}
    why += ", normalised (a Normalize module)" if normalize else ", not normalised (no Normalize module)"
    return ServedTask("embed", pooling, normalize, dict(prompts), why)
