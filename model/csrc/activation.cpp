// SwiGLU's activation on the CPU: silu(gate) * up in one pass over the MLP's fused [gate, up] output; GPT-OSS's
// clamped form likewise.

#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

namespace {

// x [T, 2F] = [gate, up] -> [T, F] row by row: a vector of each at a time, vector_op(g, u) with the vectorised exp,
// then scalar_op(g, u) on the last few, both in float32 (each given a value of x's dtype, which its roundings take)
template <typename VectorOp, typename ScalarOp>
at::Tensor gated_rows(at::Tensor x, VectorOp vector_op, ScalarOp scalar_op) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2F]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "float32, bfloat16 or float16 only");
  x = x.contiguous();
  const int64_t T = x.size(0), F = x.size(1) / 2;
  auto y = at::empty({T, F}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gated_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* gate = xp + t * 2 * F;
        const scalar_t* up = gate + F;
        scalar_t* y_t = yp + t * F;
        int64_t f = 0;
        for (; f + VL <= F; f += VL)
          store_floats(vector_op(scalar_t{}, load_floats(gate + f), load_floats(up + f)), y_t + f);
        for (; f < F; ++f) y_t[f] = static_cast<scalar_t>(scalar_op(scalar_t{}, to_float(gate[f]), to_float(up[f])));
      }
    });
  });
  return y;
}

}  // namespace

// x [T, 2F] = [gate, up] -> silu(gate) * up [T, F], rounded as transformers' LlamaMLP rounds it: silu in float32,
// rounded to x's dtype, times up in float32, rounded again.
at::Tensor silu_mul(at::Tensor x) {
  return gated_rows(
      x,
      [](auto dtype, vfloat g, vfloat u) { return round_to<decltype(dtype)>(g / (1.0f + vexp(-g))) * u; },
      [](auto dtype, float g, float u) {
        return to_float(static_cast<decltype(dtype)>(g / (1.0f + std::exp(-g)))) * u;
      });
}

// GPT-OSS's clamped SwiGLU, x [T, 2F] = [gate, up] -> (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g) [T, F],
// g = min(gate, limit): in float32, rounded once to x's dtype. The same bits for a row in any batch (each element
// on its own); transformers' GptOssExperts rounds at each op in a bfloat16 model, so a bfloat16 model's values
// differ from its by a rounding or two (a float32 one's by the exp's last bit).
at::Tensor clamped_swiglu(at::Tensor x, double alpha, double limit) {
  const float a = static_cast<float>(alpha), l = static_cast<float>(limit);
  return gated_rows(
      x,
      [a, l](auto, vfloat g, vfloat u) {
        const vfloat lo = vfloat{} - l, hi = vfloat{} + l;
        g = g > hi ? hi : g;
        u = u > hi ? hi : u;
        u = u < lo ? lo : u;
        return (u + 1.0f) * (g / (1.0f + vexp(-a * g)));
      },
      [a, l](auto, float g, float u) {
        g = std::min(g, l);
        u = std::max(std::min(u, l), -l);
        return (u + 1.0f) * (g / (1.0f + std::exp(-a * g)));
      });
}
