// A step's decoder layers in one call: RMSNorm, the qkv GEMM, attention (RoPE, K/V written, paged attention),
// the o GEMM, the residual add and RMSNorm, the [gate, up] GEMM, SwiGLU and the down GEMM, layer after layer,
// for llama-style models whose GEMMs all run on quantized weights.
//
// It calls the very kernels the Python layers call (quant_gemm.cpp, paged_attention.cpp, rms_norm.cpp,
// activation.cpp), with the same arguments in the same order, so its outputs have the same bits as
// model/transformer.py's loop. What it saves is the loop itself: a lone decode step makes ~270 kernel calls, and
// each one made from Python costs a few microseconds of argument conversion and module dispatch (~0.9 ms of a
// ~7 ms lone step for SmolLM2-135M, measured: README, Benchmarks).

#include "layer_stack.h"

#include "kernels.h"

// x [T, hidden]: the embeddings. k_cache, v_cache [layers, KVH, slots, D]; slots, block_tables, seqs, block_size,
// window, chunk: the step's attention metadata (model/attention_cpu.py); cos, sin [T, D] or none. Returns the last
// block's output and the residual stream it adds to (the final norm adds them), as the Python loop does.
std::vector<at::Tensor> LayerStack::forward(at::Tensor x, at::Tensor k_cache, at::Tensor v_cache,
                                               at::Tensor slots, at::Tensor block_tables, at::Tensor seqs,
                                               int64_t block_size, int64_t window, int64_t chunk,
                                               std::optional<at::Tensor> cos, std::optional<at::Tensor> sin) const {
  TORCH_CHECK(x.dim() == 2 && k_cache.size(0) == static_cast<int64_t>(layers.size()), "one cache per layer");
  const int64_t T = x.size(0), H = num_heads, KVH = num_kv_heads, D = head_dim;
  at::Tensor residual;
  for (size_t i = 0; i < layers.size(); ++i) {
    const Layer& layer = layers[i];
    at::Tensor h;
    if (residual.defined()) {
      auto normed = rms_norm(x, residual, layer.norm1, eps);
      h = normed[0];
      residual = normed[1];
    } else {  // the first block: the embeddings are the stream
      h = rms_norm(x, std::nullopt, layer.norm1, eps)[0];
      residual = x;
    }
    const auto qkv = layer.qkv(h).view({T, H + 2 * KVH, D});
    const auto attended = paged_attention(qkv.narrow(1, 0, H), k_cache[i], v_cache[i], block_tables, seqs, block_size,
                                          scale, window, 0.0, chunk, qkv.narrow(1, H, KVH), qkv.narrow(1, H + KVH, KVH),
                                          slots, cos, sin);
    auto normed = rms_norm(layer.o(attended.view({T, H * D})), residual, layer.norm2, eps);
    residual = normed[1];
    x = layer.down(silu_mul(layer.up(normed[0])));
  }
  return {x, residual};
}
