// RMSNorm on the CPU, optionally fused with the residual add before it, one call for all rows.
//
// Computes what transformers' LlamaRMSNorm computes, rounding included: x in float32, normalised, rounded to
// x's dtype, then multiplied by the weight and rounded again (torch's F.rms_norm rounds once). A row's sum of
// squares runs in a fixed order, so a token gets the same bits in any batch.

#include "vec.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

// y = weight * norm(x [+ r]), or norm(x [+ r]) without a weight (rounded once: what F.rms_norm of x in float32,
// rounded to T, gives); sum (when r is given) = x + r in T's precision, as torch's add rounds it
template <typename T>
void norm_row(const T* x, const T* r, const T* weight, T* y, T* sum, int64_t H, float eps, vfloat* buf) {
  float* xf = reinterpret_cast<float*>(buf);
  const int64_t n = (H + VL - 1) / VL;
  for (int64_t d = 0; d < H; ++d) xf[d] = r ? to_float(static_cast<T>(to_float(x[d]) + to_float(r[d]))) : to_float(x[d]);
  for (int64_t d = H; d < n * VL; ++d) xf[d] = 0.0f;
  vfloat squares = {};
  for (int64_t c = 0; c < n; ++c) squares += buf[c] * buf[c];
  const float inv = 1.0f / std::sqrt(hsum(squares) / H + eps);
  for (int64_t d = 0; d < H; ++d) {
    if (sum) sum[d] = static_cast<T>(xf[d]);
    y[d] = weight ? static_cast<T>(to_float(weight[d]) * to_float(static_cast<T>(xf[d] * inv)))
                  : static_cast<T>(xf[d] * inv);
  }
}

}  // namespace

// x [T, H], residual [T, H] or none, weight [H] or none (Gemma 4's values: a unit norm). Returns
// [weight * norm(x)], or with a residual [weight * norm(x + residual), x + residual].
std::vector<at::Tensor> rms_norm(at::Tensor x, std::optional<at::Tensor> residual,
                                 std::optional<at::Tensor> weight_, double eps) {
  TORCH_CHECK(x.dim() == 2, "x must be [T, H]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "float32, bfloat16 or float16 only");
  x = x.contiguous();
  at::Tensor weight;
  if (weight_) {
    weight = weight_->contiguous();
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "weight must be [H]");
    TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x dtypes differ");
  }
  at::Tensor r;
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(), "residual mismatch");
    r = residual->contiguous();
  }
  const int64_t T = x.size(0), H = x.size(1);
  auto y = at::empty_like(x);
  auto sum = r.defined() ? at::empty_like(x) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = r.defined() ? r.data_ptr<scalar_t>() : nullptr;
    const scalar_t* wp = weight.defined() ? weight.data_ptr<scalar_t>() : nullptr;
    scalar_t* yp = y.data_ptr<scalar_t>();
    scalar_t* sp = sum.defined() ? sum.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      std::vector<vfloat> buf((H + VL - 1) / VL);
      for (int64_t t = begin; t < end; ++t)
        norm_row<scalar_t>(xp + t * H, rp ? rp + t * H : nullptr, wp, yp + t * H, sp ? sp + t * H : nullptr, H,
                           static_cast<float>(eps), buf.data());
    });
  });
  if (sum.defined()) return {y, sum};
  return {y};
}
