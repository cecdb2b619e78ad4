// A step's decoder layers in one call: RMSNorm, the qkv GEMM, attention (RoPE, K/V written, paged attention),
// the o GEMM, the residual add and RMSNorm, the [gate, up] GEMM, the gated activation and the down GEMM (or a
// sparse MoE FFN: moe.cpp), layer after layer, for llama-style models whose GEMMs all run on quantized weights;
// with q/k norms per head (Qwen3, Gemma 3), norms after each branch (Gemma's sandwich), GeGLU, each layer's own
// window, rotary tables and heads, and Gemma 4's blocks (keys as values, value norms, layers reading an earlier
// layer's K/V, a dense MLP beside the experts, per-layer inputs and layer scalars).
//
// It calls the very kernels and ops the Python layers call (quant_gemm.cpp, paged_attention.cpp, rms_norm.cpp,
// activation.cpp, ATen's gelu), with the same arguments in the same order, so its outputs have the same bits
// as model/transformer.py's loop. What it saves is the loop itself: a lone decode step makes ~270 kernel calls,
// and each one made from Python costs a few microseconds of argument conversion and module dispatch (~0.9 ms of
// a ~7 ms lone step for SmolLM2-135M, measured: docs/performance-history.md).

#include "layer_stack.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/roll.h>
#include <ATen/ops/sigmoid.h>

#include "kernels.h"

namespace {

// RMSNorm over each head of t [T, heads, D], as model/transformer.py's Norm does it on q and k
at::Tensor head_norm(const at::Tensor& t, const at::Tensor& weight, double eps) {
  return rms_norm(t.reshape({-1, t.size(2)}), std::nullopt, weight, eps)[0].view(t.sizes());
}

// x [T, heads, D] with its first rotary_dim dims rotated (cos, sin [T, 1, rotary_dim]), the rest as they are: the
// ops of model/attention.py's apply_rope and model/transformer.py's partial rotary, in the same order
at::Tensor partial_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim) {
  const auto head = x.narrow(-1, 0, rotary_dim);
  const auto rotated = head.mul(cos).add(head.roll(rotary_dim / 2, -1).mul(sin));
  if (rotary_dim == x.size(-1)) return rotated;
  return at::cat(std::vector<at::Tensor>{rotated, x.narrow(-1, rotary_dim, x.size(-1) - rotary_dim)}, -1);
}

// GeGLU's activation, with the ops and rounding of model/transformer.py's MLP.activation: gelu_tanh(gate) * up
at::Tensor gelu_mul(const at::Tensor& h) {
  const auto parts = h.chunk(2, -1);
  return at::gelu(parts[0], "tanh").mul(parts[1]);
}

// rms_norm's normed rows of x, without a residual
at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm(x, std::nullopt, weight, eps)[0];
}

// Layer's K or V pool as model/kv_cache.py's KVCache.layer gives it: a row of [rows, KVH, slots, D] where every
// layer's heads are alike, else its part of a row of [rows, slots, width] seen as [KVH, slots, D] (strided)
at::Tensor cache_view(const at::Tensor& pool, const Layer& layer) {
  if (pool.dim() == 4) return pool[layer.kv_index];
  const int64_t width = layer.num_kv_heads * layer.head_dim;
  return pool[layer.kv_index]
      .narrow(1, layer.kv_part * width, width)
      .unflatten(1, {layer.num_kv_heads, layer.head_dim})
      .transpose(0, 1);
}

}  // namespace

at::Tensor step_gemm(const QuantGemm& gemm, const at::Tensor& x, const std::optional<at::Tensor>& prompt_runs) {
  return prompt_runs ? quant_gemm_rows(x, gemm, *prompt_runs) : gemm(x);
}

at::Tensor GatedActivation::operator()(const at::Tensor& h) const {
  if (gelu) return gelu_mul(h);
  return limit > 0 ? clamped_swiglu(h, alpha, limit) : silu_mul(h);
}

// One attention layer's mixing of h [T, hidden] -> [T, H, D]: the qkv GEMM, q/k (and value) norms, RoPE (in the
// kernel, or partial here), K/V written and attended, times the output gate where the layer has one. A layer
// reading an earlier layer's K/V projects queries only and rotates them here (the kernel rotates queries only
// beside keys it stores), as model/transformer.py's Attention.
at::Tensor LayerStack::attention(const Layer& layer, const at::Tensor& h, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const std::vector<at::Tensor>& slots,
                                 const std::vector<at::Tensor>& block_tables, const at::Tensor& seqs,
                                 int64_t block_size, int64_t chunk, const at::Tensor& cos,
                                 const at::Tensor& sin, const std::optional<at::Tensor>& prompt_runs) const {
  const int64_t T = h.size(0), H = num_heads, KVH = layer.num_kv_heads, D = layer.head_dim;
  const auto projected = step_gemm(*layer.qkv, h, prompt_runs);
  at::Tensor q, k, v, gate;
  if (layer.output_gate) {  // [q | gate] per head, then k, v
    const auto q_gate = projected.narrow(1, 0, 2 * H * D).view({T, H, 2 * D});
    const auto kv = projected.narrow(1, 2 * H * D, 2 * KVH * D).view({T, 2 * KVH, D});
    q = q_gate.narrow(2, 0, D);
    gate = q_gate.narrow(2, D, D);
    k = kv.narrow(1, 0, KVH);
    v = kv.narrow(1, KVH, KVH);
  } else if (layer.reads_kv) {
    q = projected.view({T, H, D});
  } else {
    const auto qkv = projected.view({T, H + (layer.k_eq_v ? 1 : 2) * KVH, D});
    q = qkv.narrow(1, 0, H);
    k = qkv.narrow(1, H, KVH);
    v = layer.k_eq_v ? k : qkv.narrow(1, H + KVH, KVH);
  }
  if (layer.v_norm && v.defined())
    v = rms_norm(v.reshape({-1, D}), std::nullopt, std::nullopt, eps)[0].view(v.sizes());  // as the Python layer
  if (layer.q_norm) {
    q = head_norm(q, *layer.q_norm, eps);
    if (k.defined()) k = head_norm(k, *layer.k_norm, eps);
  } else if (gate.defined()) {
    q = q.contiguous();  // the kernel reads a row's heads contiguous (the norms' outputs are)
  }
  std::optional<at::Tensor> rope_cos = cos, rope_sin = sin;
  if (layer.reads_kv || layer.rotary_dim < D) {  // rotated here, the kernel rotates none
    q = partial_rope(q, cos, sin, layer.rotary_dim);
    if (k.defined()) k = partial_rope(k, cos, sin, layer.rotary_dim);
    rope_cos = rope_sin = std::nullopt;
  }
  std::optional<at::Tensor> new_k, new_v, new_slots;
  if (k.defined()) new_k = k, new_v = v, new_slots = slots[layer.kv_group];
  auto attended = paged_attention(q, cache_view(k_cache, layer), cache_view(v_cache, layer),
                                  block_tables[layer.kv_group], seqs, block_size, layer.scale, layer.window, softcap,
                                  chunk, new_k, new_v, new_slots, rope_cos, rope_sin, layer.sinks, prompt_runs);
  if (gate.defined()) attended = attended.mul(at::sigmoid(gate));
  return attended;
}

// x [T, hidden]: the embeddings. k_cache, v_cache: the KV pools, [layers of a page, KVH, slots, D] (or [layers of a
// page, slots, width] where layers' heads differ: cache_view); slots and block_tables (one of each per KV group),
// seqs, block_size, chunk: the step's attention metadata (model/attention_cpu.py); cos, sin: the step's rotary
// tables, [T, 1, D] each, read by index (Layer::rope); conv_state, recurrent_state: the DeltaNet layers' state pools
// (model/kv_cache.py), states: the step's sequences as they see them (model/deltanet.py's StepStates.table), where
// there are any; per_layer: Gemma 4's per-layer inputs [T, layers, size], where the model has them. Returns the
// last block's output and the residual stream it adds to (the final norm adds them; undefined where the block
// returned the stream whole: Gemma 4's), as the Python loop does. prompt_runs: [R, 2] int64 runs of rows that are
// prompt tokens, whose GEMMs run on the dequantized weights (quant_gemm_rows) and attention on bfloat16 tiles
// (paged_attention_amx.cpp), where the engine asks for that.
std::vector<at::Tensor> LayerStack::forward(at::Tensor x, at::Tensor k_cache, at::Tensor v_cache,
                                               std::vector<at::Tensor> slots, std::vector<at::Tensor> block_tables,
                                               at::Tensor seqs, int64_t block_size, int64_t chunk,
                                               std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                                               std::optional<at::Tensor> conv_state,
                                               std::optional<at::Tensor> recurrent_state,
                                               std::optional<at::Tensor> states,
                                               std::optional<at::Tensor> per_layer,
                                               std::optional<at::Tensor> prompt_runs) const {
  TORCH_CHECK(x.dim() == 2, "x must be [T, hidden]");
  const auto gemm = [&](const QuantGemm& g, const at::Tensor& in) { return step_gemm(g, in, prompt_runs); };
  TORCH_CHECK(cos.size() == sin.size(), "one sin table per cos table");
  TORCH_CHECK(slots.size() == block_tables.size(), "one slot mapping per KV group's block tables");
  const int64_t T = x.size(0), H = num_heads;
  for (const Layer& layer : layers) {
    TORCH_CHECK(!layer.per_layer_gate ||
                    (per_layer && per_layer->dim() == 3 && per_layer->size(0) == T &&
                     per_layer->size(1) == static_cast<int64_t>(layers.size())),
                "a layer's per-layer input is not in the step's");
    if (layer.deltanet) {
      TORCH_CHECK(conv_state && recurrent_state && states && layer.deltanet->state >= 0 &&
                      layer.deltanet->state < conv_state->size(0) &&
                      layer.deltanet->state < recurrent_state->size(0),
                  "a DeltaNet layer's state is not in the step's pools");
      continue;
    }
    TORCH_CHECK(layer.rope >= 0 && layer.rope < static_cast<int64_t>(cos.size()), "no rotary table for a layer");
    TORCH_CHECK(layer.kv_group >= 0 && layer.kv_group < static_cast<int64_t>(block_tables.size()) &&
                    layer.kv_index >= 0 && layer.kv_index < k_cache.size(0) && layer.kv_part >= 0 &&
                    (layer.kv_part + 1) * layer.num_kv_heads * layer.head_dim <=
                        (k_cache.dim() == 4 ? k_cache.size(1) * k_cache.size(3) : k_cache.size(2)),
                "a layer's KV group, row or part is not in the cache");
  }
  at::Tensor residual;
  for (size_t i = 0; i < layers.size(); ++i) {
    const Layer& layer = layers[i];
    at::Tensor h;
    if (residual.defined()) {
      auto normed = rms_norm(x, residual, layer.norm1, eps);
      h = normed[0];
      residual = normed[1];
    } else {  // the first block, or one after a block that returned the stream whole
      h = norm(x, layer.norm1, eps);
      residual = x;
    }
    at::Tensor out;
    if (layer.deltanet) {
      const DeltaNetMixer& mixer = *layer.deltanet;
      const auto mixed = gated_delta_net(gemm(mixer.in_proj, h), mixer.conv, mixer.A_log, mixer.dt_bias, mixer.gated_norm,
                                         (*conv_state)[mixer.state], (*recurrent_state)[mixer.state], *states,
                                         mixer.num_key_heads, mixer.key_head_dim, mixer.value_head_dim, eps,
                                         mixer.tiled_value_heads);
      out = gemm(mixer.out, mixed);
    } else {
      out = gemm(*layer.o, attention(layer, h, k_cache, v_cache, slots, block_tables, seqs, block_size, chunk,
                                     cos[layer.rope], sin[layer.rope], prompt_runs)
                               .view({T, H * layer.head_dim}));
    }
    if (layer.post_attn_norm) out = norm(out, *layer.post_attn_norm, eps);
    auto normed = rms_norm(out, residual, layer.norm2, eps);
    residual = normed[1];
    if (layer.moe && layer.up) {  // Gemma 4 26B-A4B: the dense MLP and the experts side by side
      const auto dense = norm(gemm(*layer.down, activation(gemm(*layer.up, normed[0]))), *layer.dense_norm, eps);
      const auto experts = (*layer.moe)(norm(residual, *layer.moe_in_norm, eps), residual, prompt_runs);
      x = dense.add(norm(experts, *layer.moe_norm, eps));
    } else if (layer.moe) {
      x = (*layer.moe)(normed[0], std::nullopt, prompt_runs);
    } else {
      x = gemm(*layer.down, activation(gemm(*layer.up, normed[0])));
    }
    if (layer.post_mlp_norm) x = norm(x, *layer.post_mlp_norm, eps);
    if (layer.layer_scalar) {  // Gemma 4: the stream whole, its per-layer input gated in, scaled
      x = x.add(residual);
      if (layer.per_layer_gate) {
        const auto gated = at::gelu(gemm(*layer.per_layer_gate, x), "tanh").mul(per_layer->select(1, i));
        x = x.add(norm(gemm(*layer.per_layer_projection, gated), *layer.per_layer_norm, eps));
      }
      x = x.mul(*layer.layer_scalar);
      residual = at::Tensor();
    }
  }
  return {x, residual};
}
