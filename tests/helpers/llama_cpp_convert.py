"""Convert a Hugging Face folder to GGUF with llama.cpp's own conversion classes (convert_hf_to_gguf.py's), for
test_gguf_llama_cpp.py. Run as a script: it imports the llama.cpp tree's own gguf-py, not the installed gguf.

    python llama_cpp_convert.py LLAMA_CPP_TREE HF_FOLDER OUT.gguf VOCAB.json [OUTTYPE: f32 (default) | q8_0]

The one change: set_vocab writes VOCAB.json (a test vocabulary in GGUF terms) instead of reading the folder's
tokenizer, which llama.cpp identifies by hashing it and would refuse as unknown. Tensors and model metadata are
llama.cpp's own. A Qwen3.5 without multi-token-prediction layers (transformers' has none) converts as `--no-mtp`
does: the converter's Qwen MTP classes otherwise assert that they found some.
"""

import json
import sys
from pathlib import Path


def main() -> None:
    tree, hf_dir, out, vocab_file = (Path(arg) for arg in sys.argv[1:5])
    outtype = sys.argv[5] if len(sys.argv) > 5 else "f32"
    sys.path[:0] = [str(tree / "gguf-py"), str(tree)]
    import gguf
    import torch
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    vocab = json.loads(vocab_file.read_text())

    def set_vocab(self) -> None:
        writer = self.gguf_writer
        writer.add_tokenizer_model(vocab["model"])
        writer.add_tokenizer_pre(vocab["pre"])
        writer.add_token_list(vocab["tokens"])
        writer.add_token_types(vocab["types"])
        writer.add_token_merges(vocab["merges"])
        writer.add_bos_token_id(vocab["bos"])
        writer.add_eos_token_id(vocab["eos"])
        writer.add_add_bos_token(vocab["add_bos"])

    hparams = ModelBase.load_hparams(hf_dir, False)
    model_class = get_model_class(get_model_architecture(hparams, ModelType.TEXT))
    model_class.set_vocab = set_vocab
    qwen_mtp = getattr(sys.modules.get("conversion.qwen"), "_QwenMtpMixin", None)
    if qwen_mtp and issubclass(model_class, qwen_mtp) and not hparams.get("mtp_num_hidden_layers"):
        model_class.no_mtp = True
    with torch.inference_mode():
        ftype = {"f32": gguf.LlamaFileType.ALL_F32, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
        model = model_class(hf_dir, ftype, out, eager=True)
        model.write()
    print(gguf.__file__, model_class.__name__)


if __name__ == "__main__":
    main()
