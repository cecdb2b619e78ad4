// SwiGLU's activation on the CPU: silu(gate) * up in one pass over the MLP's fused [gate, up] output; GPT-OSS's
// clamped form likewise.

#include "vec.h"

#include <ATen/Parallel.h>

#include <cmath>

// x [T, 2F] = [gate, up] -> silu(gate) * up [T, F], rounded as transformers' LlamaMLP rounds it: silu in float32,
// rounded to x's dtype, times up in float32, rounded again.
at::Tensor silu_mul(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2F]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "float32, bfloat16 or float16 only");
  x = x.contiguous();
  const int64_t T = x.size(0), F = x.size(1) / 2;
  auto y = at::empty({T, F}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* gate = xp + t * 2 * F;
        const scalar_t* up = gate + F;
        scalar_t* y_t = yp + t * F;
        int64_t f = 0;
        for (; f + VL <= F; f += VL) {  // a vector at a time, with the vectorised exp
          const vfloat g = load_floats(gate + f);
          const vfloat silu = g / (1.0f + vexp(-g));
          store_floats(round_to<scalar_t>(silu) * load_floats(up + f), y_t + f);
        }
        for (; f < F; ++f) {
          const float g = to_float(gate[f]);
          const float silu = to_float(static_cast<scalar_t>(g / (1.0f + std::exp(-g))));
          y_t[f] = static_cast<scalar_t>(silu * to_float(up[f]));
        }
      }
    });
  });
  return y;
}

// GPT-OSS's clamped SwiGLU, x [T, 2F] = [gate, up] -> (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g) [T, F],
// g = min(gate, limit): in float32, rounded once to x's dtype. The same bits for a row in any batch (each element
// on its own); transformers' GptOssExperts rounds at each op in a bfloat16 model, so a bfloat16 model's values
// differ from its by a rounding or two (a float32 one's by the exp's last bit).
at::Tensor clamped_swiglu(at::Tensor x, double alpha, double limit) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2F]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "float32, bfloat16 or float16 only");
  x = x.contiguous();
  const int64_t T = x.size(0), F = x.size(1) / 2;
  auto y = at::empty({T, F}, x.options());
  const float a = static_cast<float>(alpha), l = static_cast<float>(limit);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "clamped_swiglu", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* gate = xp + t * 2 * F;
        const scalar_t* up = gate + F;
        scalar_t* y_t = yp + t * F;
        int64_t f = 0;
        const vfloat lo = vfloat{} - l, hi = vfloat{} + l;
        for (; f + VL <= F; f += VL) {
          vfloat g = load_floats(gate + f), u = load_floats(up + f);
          g = g > hi ? hi : g;
          u = u > hi ? hi : u;
          u = u < lo ? lo : u;
          store_floats((u + 1.0f) * (g / (1.0f + vexp(-a * g))), y_t + f);
        }
        for (; f < F; ++f) {
          const float g = std::min(to_float(gate[f]), l);
          const float u = std::max(std::min(to_float(up[f]), l), -l);
          y_t[f] = static_cast<scalar_t>((u + 1.0f) * (g / (1.0f + std::exp(-a * g))));
        }
      }
    });
  });
  return y;
}
