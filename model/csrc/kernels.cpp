// The Python module of kvserve's CPU kernels, built by model/kernels.py (torch.utils.cpp_extension).
#include <torch/python.h>  // tensors across pybind11: lighter than torch/extension.h

#include "kernels.h"
#include "layer_stack.h"
#include "quant_gemm.h"  // amx_activation_limit

// The heavy kernels let go of the GIL while they run: the engine steps on its own thread, and the server's event
// loop must be able to stream tokens and take requests meanwhile (holding it, a kernel made the loop wait for
// Python's switch interval, 5 ms, each time).
using no_gil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over a block-table KV cache (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seqs"),
        py::arg("block_size"), py::arg("scale"), py::arg("window"), py::arg("softcap"),
        py::arg("chunk"), py::arg("k") = py::none(),
        py::arg("v") = py::none(), py::arg("slots") = py::none(), py::arg("cos") = py::none(),
        py::arg("sin") = py::none(), py::arg("sinks") = py::none(), py::arg("prompt_runs") = py::none(),
        py::arg("emulate_tiles") = false, no_gil());
  m.def("silu_mul", &silu_mul, "SwiGLU's silu(gate) * up of x = [gate, up] (CPU)");
  m.def("clamped_swiglu", &clamped_swiglu, "GPT-OSS's clamped SwiGLU of x = [gate, up] (CPU)", py::arg("x"),
        py::arg("alpha"), py::arg("limit"));
  m.def("rms_norm", &rms_norm, "RMSNorm of x, or of x + residual also returned; without a weight, unit (CPU)");
  m.def("quant_gemm", &quant_gemm, "x W^T on quantized weights (quant_gemm.cpp), x bfloat16 or float32 (CPU)",
        py::arg("x"), py::arg("gemm"), py::arg("float_out"), no_gil());
  m.def("quant_gemm_dequantized", &quant_gemm_dequantized,
        "x W^T, the quantized weights dequantized to bfloat16 on AMX's tiles (quant_gemm_amx.cpp)", py::arg("x"),
        py::arg("gemm"), no_gil());
  m.def("quant_gemm_rows", &quant_gemm_rows,
        "x W^T, the rows in prompt_runs ([R, 2] int64) dequantized to bfloat16 on AMX's tiles, the others exact",
        py::arg("x"), py::arg("gemm"), py::arg("prompt_runs"), no_gil());
#if defined(__AMX_BF16__)
  m.attr("gemm_dequantized") = true;
#else
  m.attr("gemm_dequantized") = false;
#endif
  // what the quantized GEMMs multiply the exact weights by, for each activation dtype (quant_gemm.cpp)
#if defined(__AVX512BF16__) && !defined(__AMX_INT8__)
  m.attr("gemm_bfloat16_as") = "bfloat16";
#elif defined(__AVX2__)
  m.attr("gemm_bfloat16_as") = "int16";
#else
  m.attr("gemm_bfloat16_as") = "float32";
#endif
#if defined(__AVX2__)
  m.attr("gemm_float32_as") = "int16";  // on AMX's int8 tiles too (quant_gemm_amx.cpp)
#else
  m.attr("gemm_float32_as") = "float32";
#endif
  // where int16 activations are rounded to fewer levels: the largest |xq| by the bits of weights with a minimum
  // (AMX's tiles multiply them as one byte product: quant_gemm_amx.cpp), else 32767
  py::dict narrow;
#if defined(__AMX_INT8__)
  for (int bits : {4, 5}) narrow[py::int_(bits)] = amx_activation_limit(bits, true);
#endif
  m.attr("gemm_int16_narrow") = narrow;
  // which activations a GEMM asked for int8 ones (QuantGemm.int8) has rounded: bfloat16 ones with VNNI, any with
  // AVX2 alone, none elsewhere
#if defined(INT8_ACTIVATIONS) && defined(__AVX512F__)
  m.attr("gemm_int8") = py::make_tuple("bfloat16");
#elif defined(INT8_ACTIVATIONS)
  m.attr("gemm_int8") = py::make_tuple("bfloat16", "float32");
#else
  m.attr("gemm_int8") = py::tuple();
#endif
  m.def("quant_rows", &quant_rows, "rows of a quantized weight, dequantized to float32", py::arg("gemm"),
        py::arg("ids"), py::arg("K"));
  m.def("pack_quant", &pack_quant, "q [N, K] in the kernel's packed layout (quant_pack.cpp)", py::arg("q"),
        py::arg("bits"), py::arg("group"), no_gil());
  m.def("uniform_noise", &uniform_noise, "the sampler's noise, bit for bit (noise.cpp; model/sampling.py)",
        py::arg("seeds"), py::arg("positions"), py::arg("vocab_size"), no_gil());
  m.def("gated_delta_net", &gated_delta_net, "a Gated DeltaNet layer's recurrence for a step (deltanet.cpp)",
        py::arg("proj"), py::arg("conv_w"), py::arg("A_log"), py::arg("dt_bias"), py::arg("norm_w"),
        py::arg("conv_state"), py::arg("recurrent_state"), py::arg("seqs"), py::arg("num_key_heads"),
        py::arg("key_head_dim"), py::arg("value_head_dim"), py::arg("eps"), py::arg("tiled_value_heads"), no_gil());
  m.def("argmax_rows", &argmax_rows, "torch.argmax of each row of [B, V] float32 (argmax.cpp; model/sampling.py)",
        py::arg("x"), no_gil());
  py::class_<QuantSegment>(m, "QuantSegment", py::module_local(), "one format's run of a weight's rows, packed")
      .def(py::init([](at::Tensor packed, at::Tensor scales, std::optional<at::Tensor> mins,
                       std::optional<at::Tensor> supers, std::optional<at::Tensor> super_mins, int64_t bits,
                       int64_t group, int64_t n, std::optional<at::Tensor> levels) {
             return QuantSegment{packed, scales, mins, supers, super_mins, bits, group, n, levels};
           }),
           py::arg("packed"), py::arg("scales"), py::arg("mins"), py::arg("supers"), py::arg("super_mins"),
           py::arg("bits"), py::arg("group"), py::arg("n"), py::arg("levels") = py::none());
  py::class_<QuantGemm>(m, "QuantGemm", py::module_local(), "a GEMM on quantized weights: its segments, bias, width")
      .def(py::init([](std::vector<QuantSegment> segments, std::optional<at::Tensor> bias, int64_t n, bool int8) {
             return QuantGemm{std::move(segments), bias, n, int8};
           }),
           py::arg("segments"), py::arg("bias"), py::arg("n"), py::arg("int8") = false);
  py::class_<MoeFfn>(m, "MoeFfn", py::module_local(), "a sparse MoE FFN on quantized experts (moe.cpp)")
      .def(py::init([](at::Tensor router, std::vector<QuantGemm> up, std::vector<QuantGemm> down, int64_t top_k,
                       bool renormalize, std::optional<QuantGemm> shared_up, std::optional<QuantGemm> shared_down,
                       std::optional<at::Tensor> shared_gate, std::optional<at::Tensor> router_bias,
                       double swiglu_alpha, double swiglu_limit, bool gelu, std::optional<at::Tensor> router_scale,
                       std::optional<at::Tensor> expert_scale, double eps) {
             return MoeFfn{router,       std::move(up), std::move(down), top_k,
                           renormalize,  shared_up,     shared_down,     shared_gate,
                           router_bias,  GatedActivation{gelu, swiglu_alpha, swiglu_limit},
                           router_scale, expert_scale,  eps};
           }),
           py::arg("router"), py::arg("up"), py::arg("down"), py::arg("top_k"), py::arg("renormalize"),
           py::arg("shared_up") = py::none(), py::arg("shared_down") = py::none(),
           py::arg("shared_gate") = py::none(), py::arg("router_bias") = py::none(), py::arg("swiglu_alpha") = 1.0,
           py::arg("swiglu_limit") = 0.0, py::arg("gelu") = false, py::arg("router_scale") = py::none(),
           py::arg("expert_scale") = py::none(), py::arg("eps") = 1e-6)
      .def("__call__", &MoeFfn::operator(), py::arg("x"), py::arg("router_input") = py::none(),
           py::arg("prompt_runs") = py::none(), no_gil());
  py::class_<DeltaNetMixer>(m, "DeltaNetMixer", py::module_local(), "a Gated DeltaNet token mixer's weights")
      .def(py::init([](QuantGemm in_proj, QuantGemm out, at::Tensor conv, at::Tensor A_log, at::Tensor dt_bias,
                       at::Tensor gated_norm, int64_t num_key_heads, int64_t key_head_dim, int64_t value_head_dim,
                       bool tiled_value_heads, int64_t state) {
             return DeltaNetMixer{std::move(in_proj), std::move(out), conv, A_log, dt_bias, gated_norm,
                                  num_key_heads, key_head_dim, value_head_dim, tiled_value_heads, state};
           }),
           py::arg("in_proj"), py::arg("out"), py::arg("conv"), py::arg("A_log"), py::arg("dt_bias"),
           py::arg("gated_norm"), py::arg("num_key_heads"), py::arg("key_head_dim"), py::arg("value_head_dim"),
           py::arg("tiled_value_heads"), py::arg("state"));
  // Layer and LayerStack take keywords: built once at load, their many fields named where they are made
  py::class_<Layer>(m, "Layer", py::module_local(), "one decoder layer's weights, window and rotary table")
      .def(py::init([](at::Tensor norm1, std::optional<QuantGemm> qkv, std::optional<QuantGemm> o,
                       std::optional<DeltaNetMixer> deltanet, at::Tensor norm2, std::optional<QuantGemm> up,
                       std::optional<QuantGemm> down, std::optional<MoeFfn> moe, std::optional<at::Tensor> q_norm,
                       std::optional<at::Tensor> k_norm, std::optional<at::Tensor> post_attn_norm,
                       std::optional<at::Tensor> post_mlp_norm, int64_t window, int64_t rope, int64_t rotary_dim,
                       bool output_gate, std::optional<at::Tensor> sinks, int64_t kv_group, int64_t kv_index,
                       int64_t kv_part, int64_t num_kv_heads, int64_t head_dim, double scale, bool k_eq_v,
                       bool v_norm, bool reads_kv, std::optional<at::Tensor> dense_norm,
                       std::optional<at::Tensor> moe_in_norm, std::optional<at::Tensor> moe_norm,
                       std::optional<at::Tensor> layer_scalar, std::optional<QuantGemm> per_layer_gate,
                       std::optional<QuantGemm> per_layer_projection, std::optional<at::Tensor> per_layer_norm) {
             const bool dense = up.has_value() && down.has_value();
             const bool side_by_side = dense_norm && moe_in_norm && moe_norm;
             TORCH_CHECK(side_by_side ? dense && moe : moe.has_value() != dense,
                         "an MLP, a MoE FFN, or both with their norms");
             TORCH_CHECK(deltanet.has_value() != (qkv.has_value() && o.has_value()), "attention or DeltaNet");
             TORCH_CHECK(!per_layer_gate || (per_layer_projection && per_layer_norm && layer_scalar),
                         "a per-layer input's gate, projection and norm, in a block with a layer scalar");
             return Layer{norm1, qkv, o, num_kv_heads, head_dim, scale, k_eq_v, v_norm, reads_kv, deltanet, norm2,
                          up, down, moe, dense_norm, moe_in_norm, moe_norm, q_norm, k_norm, post_attn_norm,
                          post_mlp_norm, window, rope, rotary_dim, output_gate, sinks, kv_group, kv_index, kv_part,
                          layer_scalar, per_layer_gate, per_layer_projection, per_layer_norm};
           }),
           py::kw_only(), py::arg("norm1"), py::arg("qkv"), py::arg("o"), py::arg("deltanet"), py::arg("norm2"),
           py::arg("up") = py::none(), py::arg("down") = py::none(), py::arg("moe") = py::none(),
           py::arg("q_norm") = py::none(),
           py::arg("k_norm") = py::none(), py::arg("post_attn_norm") = py::none(),
           py::arg("post_mlp_norm") = py::none(), py::arg("window") = 0, py::arg("rope") = -1,
           py::arg("rotary_dim") = 0, py::arg("output_gate") = false, py::arg("sinks") = py::none(),
           py::arg("kv_group") = -1, py::arg("kv_index") = -1, py::arg("kv_part") = 0, py::arg("num_kv_heads") = 0,
           py::arg("head_dim") = 0, py::arg("scale") = 1.0, py::arg("k_eq_v") = false, py::arg("v_norm") = false,
           py::arg("reads_kv") = false, py::arg("dense_norm") = py::none(), py::arg("moe_in_norm") = py::none(),
           py::arg("moe_norm") = py::none(), py::arg("layer_scalar") = py::none(),
           py::arg("per_layer_gate") = py::none(), py::arg("per_layer_projection") = py::none(),
           py::arg("per_layer_norm") = py::none());
  py::class_<LayerStack>(m, "LayerStack", py::module_local(), "a step's decoder layers in one call (layer_stack.cpp)")
      .def(py::init([](std::vector<Layer> layers, int64_t num_heads, double eps, double softcap, bool gelu,
                       double swiglu_alpha, double swiglu_limit) {
             return LayerStack{std::move(layers), num_heads, eps, softcap,
                               GatedActivation{gelu, swiglu_alpha, swiglu_limit}};
           }),
           py::kw_only(), py::arg("layers"), py::arg("num_heads"), py::arg("eps"), py::arg("softcap"),
           py::arg("gelu"), py::arg("swiglu_alpha") = 1.0, py::arg("swiglu_limit") = 0.0)
      .def("forward", &LayerStack::forward, no_gil());
}
