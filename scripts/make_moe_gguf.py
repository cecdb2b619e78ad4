"""Write a random-weight GGUF of a model's whole shape from a cut of it (a GGUF of the same architecture with fewer
layers, e.g. `../shared/peer/make_model.sh qwen3moe-30b-a3b Q4_K_M`'s 12 of 48), tensor by tensor: at most one
tensor is in memory at a time (its quantized bytes plus a float32 chunk of at most 64 MiB), so a 30 B-parameter
file is made on a host that could never hold it in float.

    python scripts/make_moe_gguf.py CUT.gguf OUT.Q4_0.gguf --layers 48
    llama-quantize --allow-requantize OUT.Q4_0.gguf OUT.Q4_K_M.gguf Q4_K_M 2

All metadata (tokenizer, chat template, the architecture's keys) is the cut's, but for the block count (--layers)
and the file type. The tensors are the cut's global ones and its blk.0's, repeated --layers times, with the cut's
names and shapes. Norms are 1 and 1-D tensors otherwise 0; every other tensor is drawn from a normal of std 0.02, as
transformers initializes a model, so activations stay in range through 48 layers. Tensors that are F32 in the
cut (norms, the MoE router ffn_gate_inp) stay F32; the rest are written in --type (Q4_0 or Q8_0, quantized with
gguf's own gguf.quants.quantize: ~30 M parameters a second on one core here, drawing included, so ~17 min for
30 B: fast enough that there is no need to write random blocks directly). llama-quantize then makes the file
llama.cpp's own: its Q4_K_M types per tensor, its layout.

Q4_0 is the default because of the disk: for Qwen3-30B-A3B's shape it is ~17 GB against Q8_0's ~32 GB, and the
intermediate and the ~18 GB Q4_K_M must fit side by side. Each tensor's pages are written through and dropped from
the page cache as it is done (the file is read once more, by llama-quantize), so writing does not push a shared
host's other files out of memory.
"""

import argparse
import os
import re
import sys
import time

import gguf
import numpy as np
from dequantize_gguf import copy_metadata  # this folder's: scripts run from it
from gguf.quants import quantize

CHUNK_ELEMENTS = 1 << 24  # float32 values drawn and quantized at once: 64 MiB
TYPES = {"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}


def plan(reader: gguf.GGUFReader, layers: int, qtype: gguf.GGMLQuantizationType) -> list[tuple]:
    """(name, numpy shape, GGML type) of every tensor to write, in order: the cut's global tensors, then blk.0's
    repeated for each layer. Refuses a cut whose layers differ in their tensors (this repeats blk.0)."""
    per_layer: dict[int, list[tuple]] = {}
    globals_ = []
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest first; numpy slowest first
        match = re.match(r"blk\.(\d+)\.(.+)", t.name)
        if match:
            per_layer.setdefault(int(match[1]), []).append((match[2], shape, t.tensor_type))
        else:
            globals_.append((t.name, shape, t.tensor_type))

    # names, shapes and which are F32: the quantized types vary by layer (Q4_K_M's Q6_K in some)
    def layout(tensors: list[tuple]) -> list[tuple]:
        return sorted((name, shape, kind == gguf.GGMLQuantizationType.F32) for name, shape, kind in tensors)

    for i, tensors in per_layer.items():
        if layout(tensors) != layout(per_layer[0]):
            raise SystemExit(
                f"layer {i} of the cut has other tensors than layer 0's; this script repeats layer 0"
            )

    def written_type(shape: tuple, cut_type: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
        if cut_type == gguf.GGMLQuantizationType.F32:
            return cut_type  # norms and routers, as llama.cpp's converter keeps them
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        # a row that fills no whole block falls back to F16, as llama.cpp's converter does
        return qtype if shape[-1] % block == 0 else gguf.GGMLQuantizationType.F16

    names = [(name, shape, written_type(shape, kind)) for name, shape, kind in globals_]
    names += [
        (f"blk.{i}.{suffix}", shape, written_type(shape, kind))
        for i in range(layers)
        for suffix, shape, kind in per_layer[0]
    ]
    return names


def random_tensor(name: str, shape: tuple, kind: gguf.GGMLQuantizationType, rng, std: float) -> np.ndarray:
    """The tensor as GGUF stores it (uint8 block rows, or F32/F16 values), drawn CHUNK_ELEMENTS at a time."""
    if len(shape) == 1 or name.endswith("_norm.weight"):
        value = np.ones(shape, np.float32) if name.endswith("_norm.weight") else np.zeros(shape, np.float32)
        return value if kind == gguf.GGMLQuantizationType.F32 else quantize(value, kind)
    rows, width = int(np.prod(shape[:-1])), shape[-1]
    if kind == gguf.GGMLQuantizationType.F32:
        out = np.empty((rows, width), np.float32)
    elif kind == gguf.GGMLQuantizationType.F16:
        out = np.empty((rows, width), np.float16)
    else:
        block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
        out = np.empty((rows, width // block_size * type_size), np.uint8)  # each row's blocks
    step = max(1, CHUNK_ELEMENTS // width)
    for start in range(0, rows, step):
        chunk = rng.standard_normal((min(step, rows - start), width), dtype=np.float32)
        chunk *= std
        out[start : start + len(chunk)] = (
            chunk if kind == gguf.GGMLQuantizationType.F32 else quantize(chunk, kind)
        )
    return out.reshape(*shape[:-1], out.shape[-1])


def make(cut: str, target: str, layers: int, type_name: str, seed: int, std: float) -> None:
    reader = gguf.GGUFReader(cut)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    qtype = gguf.GGMLQuantizationType[type_name]
    tensors = plan(reader, layers, qtype)

    writer = gguf.GGUFWriter(target, arch)
    block_count = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    rewritten = {
        gguf.Keys.General.FILE_TYPE,
        gguf.Keys.General.NAME,
        gguf.Keys.General.FINETUNE,  # llama.cpp's converter names the cut's layer count here, e.g. "30b-L12"
        gguf.Keys.General.ALIGNMENT,  # the writer's default alignment is used
        block_count,
    }
    copy_metadata(reader, writer, rewritten)
    name = reader.fields.get(gguf.Keys.General.NAME)
    name = re.sub(r"\s+L\d+$", "", name.contents()) if name else arch
    writer.add_name(f"{name} (random weights, {layers} layers)")
    writer.add_block_count(layers)
    writer.add_file_type(TYPES[type_name])

    total_bytes = total_params = 0
    for tname, shape, kind in tensors:
        block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
        nbytes = int(np.prod(shape[:-1])) * shape[-1] // block_size * type_size
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            dtype = np.float32 if kind == gguf.GGMLQuantizationType.F32 else np.float16
            writer.add_tensor_info(tname, shape, np.dtype(dtype), nbytes)
        else:
            byte_shape = (*shape[:-1], shape[-1] // block_size * type_size)
            writer.add_tensor_info(tname, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=kind)
        total_bytes += nbytes
        total_params += int(np.prod(shape))
    print(
        f"{len(tensors)} tensors, {total_params / 1e9:.2f} B parameters, {total_bytes / 2**30:.2f} GiB of data "
        f"({type_name}; F32 kept where the cut has it) -> {target}",
        file=sys.stderr,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()

    started, done = time.monotonic(), 0
    (out,) = writer.fout  # one file: no split was asked for
    for index, (tname, shape, kind) in enumerate(tensors):
        rng = np.random.default_rng([seed, index])  # each tensor its own stream: the same bits in any order
        data = random_tensor(tname, shape, kind, rng, std)
        writer.write_tensor_data(data)
        done += data.nbytes
        del data
        out.flush()
        os.fdatasync(out.fileno())
        os.posix_fadvise(out.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        layer = tname.split(".")[1] if tname.startswith("blk.") else None
        following = tensors[index + 1][0] if index + 1 < len(tensors) else ""
        if layer is not None and not following.startswith(f"blk.{layer}."):  # a layer done
            print(
                f"  layer {layer}: {done / 2**30:.2f} / {total_bytes / 2**30:.2f} GiB in "
                f"{time.monotonic() - started:.0f} s",
                file=sys.stderr,
            )
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("cut", help="a GGUF of the architecture with the tensors of one layer to repeat")
    parser.add_argument("out", help="the GGUF to write")
    parser.add_argument("--layers", type=int, default=48, help="block count of the file written (default 48)")
    parser.add_argument(
        "--type", choices=tuple(TYPES), default="Q4_0", help="type of the matrices (default Q4_0)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--std", type=float, default=0.02, help="the normal's std (transformers' init: 0.02)")
    args = parser.parse_args()
    if os.path.exists(args.out):
        raise SystemExit(f"{args.out} exists; not overwriting it")
    make(args.cut, args.out, args.layers, args.type, args.seed, args.std)


if __name__ == "__main__":
    main()
