// The decoder layers in one call (layer_stack.cpp): the weights of each layer, held once, at load.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

// One run of a weight's rows in one format, as model/quant.py packs it (quant_gemm.cpp, "Layout")
struct QuantSegment {
  at::Tensor packed, scales;  // scales: float16 per group, or int8 sub-scales with supers
  std::optional<at::Tensor> mins, supers, super_mins;
  int64_t bits, group, n;  // n: its output features
  std::optional<at::Tensor> levels;  // int8 [16]: what a 4-bit q without a minimum stands for (default IQ4's)
};

// One GEMM on quantized weights: its segments' outputs side by side (one segment unless a fused layer's parts
// come in several formats)
struct QuantGemm {
  std::vector<QuantSegment> segments;
  std::optional<at::Tensor> bias;
  int64_t n;  // output features
  bool int8 = false;  // bfloat16 activations rounded to int8 where the tier has that kernel (quant_gemm_i8.cpp)
  at::Tensor operator()(const at::Tensor& x) const;
};

// A GEMM of a step's rows: the prompt's on the dequantized weights where the step names them (prompt_runs [R, 2]
// int64: quant_gemm_rows), else every row on the exact ones
at::Tensor step_gemm(const QuantGemm& gemm, const at::Tensor& x, const std::optional<at::Tensor>& prompt_runs);

// A gated MLP's activation on its fused [gate, up] output: GeGLU (gelu_tanh), SwiGLU, or GPT-OSS's clamped SwiGLU
// where limit > 0
struct GatedActivation {
  bool gelu = false;
  double alpha = 1.0, limit = 0.0;
  at::Tensor operator()(const at::Tensor& h) const;
};

// A sparse MoE FFN on quantized experts (moe.cpp, model/moe.py): a float32 router (with a bias: GPT-OSS; reading
// its input RMS-normed and scaled: Gemma 4), each token's top k experts, the step's tokens grouped by expert, each
// expert a gated MLP (its GEMMs' biases in them); a shared expert behind a sigmoid gate (Qwen2-MoE)
struct MoeFfn {
  at::Tensor router;                  // [experts, hidden] float32
  std::vector<QuantGemm> up, down;    // per expert; up: [gate; up] fused
  int64_t top_k;
  bool renormalize;                   // the top k weights divided by their sum
  std::optional<QuantGemm> shared_up, shared_down;
  std::optional<at::Tensor> shared_gate;  // [1, hidden] float32
  std::optional<at::Tensor> router_bias;  // [experts] float32
  GatedActivation activation;
  // Gemma 4: the router reads rms_norm(its input) * router_scale / sqrt(hidden) (router_scale [hidden], the
  // input's dtype), and each chosen expert's weight is times expert_scale [experts] float32
  std::optional<at::Tensor> router_scale, expert_scale;
  double eps = 1e-6;
  // x [T, hidden] -> [T, hidden]; router_input: what the router reads where not x (Gemma 4's residual stream);
  // prompt_runs: x's rows that are prompt tokens, whose experts' GEMMs run on the dequantized weights
  // (quant_gemm_rows), where the step names them
  at::Tensor operator()(const at::Tensor& x, const std::optional<at::Tensor>& router_input = std::nullopt,
                        const std::optional<at::Tensor>& prompt_runs = std::nullopt) const;
};

// A Gated DeltaNet token mixer (deltanet.cpp, model/deltanet.py): its input projection [q k v | z | b | a], the
// recurrence between, its output projection. Its state is row `state` of the step's conv and recurrent pools.
struct DeltaNetMixer {
  QuantGemm in_proj, out;
  at::Tensor conv;  // [conv_dim, kernel]
  at::Tensor A_log, dt_bias, gated_norm;  // float32
  int64_t num_key_heads, key_head_dim, value_head_dim;
  bool tiled_value_heads;  // value head h reads key head h % num_key_heads (llama.cpp's order), else h / group
  int64_t state;
};

struct Layer {
  at::Tensor norm1;  // RMSNorm weights before the token mixer and before the MLP
  std::optional<QuantGemm> qkv, o;  // attention's (Qwen3.5: each head's query rows then its output gate's)
  int64_t num_kv_heads, head_dim;  // its attention's (Gemma 4's full layers have heads of their own)
  double scale;                    // its attention's score scale
  bool k_eq_v;    // no value rows: the keys (before their norm and RoPE) are the values (Gemma 4's full layers)
  bool v_norm;    // each value head RMS-normed in float32, with no weight (Gemma 4)
  bool reads_kv;  // no K/V rows: its queries read an earlier layer's (Gemma 4's last layers)
  std::optional<DeltaNetMixer> deltanet;  // or Gated DeltaNet's
  at::Tensor norm2;
  std::optional<QuantGemm> up, down;  // the dense MLP's; up: [gate; up] fused
  std::optional<MoeFfn> moe;          // or a sparse FFN's, or both side by side (Gemma 4 26B-A4B):
  // the dense MLP's output normed (dense_norm) plus the experts' on the stream normed (moe_in_norm), normed after
  std::optional<at::Tensor> dense_norm, moe_in_norm, moe_norm;
  // Qwen3 and Gemma: RMSNorm over each head of q and k, before RoPE; Gemma: RMSNorm of each branch's output,
  // before its residual add. None where the family has no such norm.
  std::optional<at::Tensor> q_norm, k_norm, post_attn_norm, post_mlp_norm;
  int64_t window;  // keys further back than this are not attended (0: none)
  int64_t rope;    // which of the step's rotary tables (cos, sin) this layer reads
  int64_t rotary_dim;  // the dims it rotates: head_dim, or the first ones only (partial rotary: Qwen3.5)
  bool output_gate;    // attention's output times sigmoid(its gate) (Qwen3.5)
  std::optional<at::Tensor> sinks;  // [heads] float32: a logit per head that joins each softmax (GPT-OSS)
  int64_t kv_group;  // whose block tables and slots its K/V go through (model/config.py's kv_groups)
  int64_t kv_index;  // its row in that group's pages
  int64_t kv_part;   // its part of that row, where layers narrower than the widest sit side by side
  // Gemma 4: the block's output and stream summed, plus the token's per-layer input gated in (per_layer_gate,
  // gelu_tanh, times the input, per_layer_projection, RMSNorm), times layer_scalar: the next block's stream
  std::optional<at::Tensor> layer_scalar;
  std::optional<QuantGemm> per_layer_gate, per_layer_projection;
  std::optional<at::Tensor> per_layer_norm;
};

struct LayerStack {
  std::vector<Layer> layers;
  int64_t num_heads;
  double eps, softcap;         // RMSNorm's epsilon, attention's soft-cap (0: none)
  GatedActivation activation;  // the MLPs'

  std::vector<at::Tensor> forward(at::Tensor x, at::Tensor k_cache, at::Tensor v_cache,
                                     std::vector<at::Tensor> slots, std::vector<at::Tensor> block_tables,
                                     at::Tensor seqs, int64_t block_size, int64_t chunk,
                                     std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                                     std::optional<at::Tensor> conv_state, std::optional<at::Tensor> recurrent_state,
                                     std::optional<at::Tensor> states, std::optional<at::Tensor> per_layer,
                                     std::optional<at::Tensor> prompt_runs) const;

 private:
  at::Tensor attention(const Layer& layer, const at::Tensor& h, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const std::vector<at::Tensor>& slots, const std::vector<at::Tensor>& block_tables,
                       const at::Tensor& seqs, int64_t block_size, int64_t chunk, const at::Tensor& cos,
                       const at::Tensor& sin, const std::optional<at::Tensor>& prompt_runs) const;
};
