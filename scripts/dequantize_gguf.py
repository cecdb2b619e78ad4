"""Write a GGUF's weights dequantized to float32, its metadata unchanged: the float32 reference that
llama.cpp's `llama-perplexity --kl-divergence-base` needs to measure a quantized file against its own weights,
as `kvserve bench-quality` does in process.

    python scripts/dequantize_gguf.py model.Q4_K_M.gguf model.dequantized.F32.gguf
"""

import sys

import gguf
import numpy as np
from gguf.quants import dequantize


def copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, rewritten: set[str]) -> None:
    """Every key-value of reader's file into writer's, but those in `rewritten` and the file's own layout
    (GGUF.*); the writer writes the architecture itself."""
    rewritten = rewritten | {gguf.Keys.General.ARCHITECTURE}
    for field in reader.fields.values():
        if field.name in rewritten or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub_kind = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_kind)


def dequantize_gguf(source: str, target: str) -> None:
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(target, arch)
    copy_metadata(reader, writer, {gguf.Keys.General.FILE_TYPE})  # the file type is float32's now
    writer.add_key_value(gguf.Keys.General.FILE_TYPE, 0, gguf.GGUFValueType.UINT32)  # LLAMA_FTYPE_ALL_F32
    for tensor in reader.tensors:
        # GGUF lists dims fastest first; numpy wants them slowest first
        shape = tuple(int(d) for d in reversed(tensor.shape))
        weights = dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        writer.add_tensor(tensor.name, weights, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    dequantize_gguf(sys.argv[1], sys.argv[2])
