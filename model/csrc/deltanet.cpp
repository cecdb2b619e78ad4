// Gated DeltaNet on the CPU: one layer's recurrence for a step's sequences, between its input projection and its
// output projection (model/deltanet.py has the math and the Python path this replaces; the same roundings to the
// model's dtype). Per sequence: the causal convolution over its kept inputs and SiLU, q and k L2-normed, the delta
// rule from its state slot, token by token, then the gated RMS norm. Each sequence's numbers depend only on its
// own tokens and state, and each op runs in one fixed order whatever the step holds: a prompt gives the same bits
// prefilled whole or in chunks, a sequence the same bits beside others.

#include "kernels.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline vfloat silu(vfloat x) { return x / (1.0f + vexp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold

template <typename scalar_t>
inline float rounded(float x) {  // x as the model's dtype holds it
  return to_float(static_cast<scalar_t>(x));
}

inline vfloat broadcast(float x) { return x - vfloat{}; }  // x - 0 is x, every x: no addition left in the code

// The delta rule for one token on columns [j0, j0 + B VL) of one value head's state S [dk, dv], B vectors of
// accumulators in registers, in two passes: recall = (S decay)^T k, read only; then S <- S decay + k correction^T
// and out = S^T q. Every column sums over the rows in ascending order whatever B is (the blocks only say which
// columns share a pass), so a column's bits do not depend on how dv is cut. restrict: GCC otherwise kept the
// accumulators on the stack (S might have aliased them) and ran ~4x slower.
template <int B>
inline void recall_columns(const float* __restrict S, int64_t dk, int64_t dv, int64_t j0, float decay,
                           const float* __restrict k, float* __restrict recall) {
  vfloat acc[B] = {};
  const vfloat d = broadcast(decay);
  for (int64_t i = 0; i < dk; ++i) {
    const vfloat ki = broadcast(k[i]);
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) acc[b] += load_floats(S + i * dv + j0 + b * VL) * d * ki;
  }
  for (int b = 0; b < B; ++b) store_floats(acc[b], recall + j0 + b * VL);
}

template <int B>
inline void update_columns(float* __restrict S, int64_t dk, int64_t dv, int64_t j0, float decay,
                           const float* __restrict k, const float* __restrict correction,
                           const float* __restrict q, float* __restrict out) {
  vfloat acc[B] = {}, c[B];
  const vfloat d = broadcast(decay);
  for (int b = 0; b < B; ++b) c[b] = load_floats(correction + j0 + b * VL);
  for (int64_t i = 0; i < dk; ++i) {
    const vfloat ki = broadcast(k[i]), qi = broadcast(q[i]);
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      float* row = S + i * dv + j0 + b * VL;
      const vfloat updated = load_floats(row) * d + ki * c[b];
      store_floats(updated, row);
      acc[b] += updated * qi;
    }
  }
  for (int b = 0; b < B; ++b) store_floats(acc[b], out + j0 + b * VL);
}

// columns the vectors do not cover (dv not a multiple of VL), one at a time, the same operations
inline void recall_column(const float* S, int64_t dk, int64_t dv, int64_t j, float decay, const float* k,
                          float* recall) {
  float acc = 0.0f;
  for (int64_t i = 0; i < dk; ++i) acc += S[i * dv + j] * decay * k[i];
  recall[j] = acc;
}
inline void update_column(float* S, int64_t dk, int64_t dv, int64_t j, float decay, const float* k,
                          const float* correction, const float* q, float* out) {
  float acc = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    const float updated = S[i * dv + j] * decay + k[i] * correction[j];
    S[i * dv + j] = updated;
    acc += updated * q[i];
  }
  out[j] = acc;
}

// Columns per pass: 4 vectors (32 floats with AVX2), whose accumulators, corrections and broadcasts fit in 16
// registers; 2 on the baseline's 4-float vectors (SSE2 has 16 registers too, NEON 32)
constexpr int BLOCK = VL >= 8 ? 4 : 2;

// One sequence's tokens through one value head: S [dk, dv] its state; q, k, v of token t at q + t stride (and k,
// v likewise), out + t out_stride its output; beta, decay [n]; keep: null, or n - 1 states after each token but
// the last, keep_stride apart. A column of S depends only on itself (its recall, its correction, its update and its output read no
// other column), so the columns go in blocks, each block through every token while it stays in L1 (a head's
// whole S is 64 KiB: two passes over it a token went to L2, measured 2.4x slower on Zen 3)
void delta_rule(float* S, int64_t dk, int64_t dv, int64_t n, const float* q, const float* k, const float* v,
                int64_t stride, const float* beta, const float* decay, float* out, int64_t out_stride, float* keep,
                int64_t keep_stride) {
  std::vector<float> correction(dv);
  auto columns = [&](int64_t j0, int64_t width, auto recall, auto update) {
    for (int64_t t = 0; t < n; ++t) {
      const float *q_t = q + t * stride, *k_t = k + t * stride, *v_t = v + t * stride;
      recall(j0, decay[t], k_t);
      for (int64_t j = j0; j < j0 + width; ++j) correction[j] = (v_t[j] - correction[j]) * beta[t];
      update(j0, decay[t], k_t, q_t, out + t * out_stride);
      if (keep && t + 1 < n)
        for (int64_t i = 0; i < dk; ++i)
          std::copy(S + i * dv + j0, S + i * dv + j0 + width, keep + t * keep_stride + i * dv + j0);
    }
  };
  const int64_t blocked = dv / (BLOCK * VL) * BLOCK * VL, vectors = dv / VL * VL;
  for (int64_t j0 = 0; j0 < blocked; j0 += BLOCK * VL)
    columns(
        j0, BLOCK * VL,
        [&](int64_t j, float d, const float* k_t) { recall_columns<BLOCK>(S, dk, dv, j, d, k_t, correction.data()); },
        [&](int64_t j, float d, const float* k_t, const float* q_t, float* o) {
          update_columns<BLOCK>(S, dk, dv, j, d, k_t, correction.data(), q_t, o);
        });
  for (int64_t j0 = blocked; j0 < vectors; j0 += VL)
    columns(
        j0, VL, [&](int64_t j, float d, const float* k_t) { recall_columns<1>(S, dk, dv, j, d, k_t, correction.data()); },
        [&](int64_t j, float d, const float* k_t, const float* q_t, float* o) {
          update_columns<1>(S, dk, dv, j, d, k_t, correction.data(), q_t, o);
        });
  for (int64_t j0 = vectors; j0 < dv; ++j0)
    columns(
        j0, 1, [&](int64_t j, float d, const float* k_t) { recall_column(S, dk, dv, j, d, k_t, correction.data()); },
        [&](int64_t j, float d, const float* k_t, const float* q_t, float* o) {
          update_column(S, dk, dv, j, d, k_t, correction.data(), q_t, o);
        });
}

}  // namespace

// proj [T, conv_dim + value_dim + 2 Hv]: the input projection's [q k v | z | b | a] rows; conv_w [conv_dim, kernel];
// A_log, dt_bias [Hv]; norm_w [dv] (float32); conv_state [slots, kernel - 1, conv_dim] and recurrent_state [slots,
// Hv, dk, dv] (float32, this layer's, updated in place); seqs [N, 5] int64: each sequence's first flat token, its
// tokens this step, its slot, 1 where its state starts from zero, and -1 or the first of n - 1 slots that get its
// state after each of its tokens but the last (a decode verifying drafts: the engine goes back to the state after
// the last one it keeps). Returns [T, value_dim] in proj's dtype.
at::Tensor gated_delta_net(at::Tensor proj, at::Tensor conv_w, at::Tensor A_log, at::Tensor dt_bias,
                           at::Tensor norm_w, at::Tensor conv_state, at::Tensor recurrent_state, at::Tensor seqs,
                           int64_t num_key_heads, int64_t key_head_dim, int64_t value_head_dim, double eps,
                           bool tiled_value_heads) {
  const int64_t Hv = A_log.size(0), Hk = num_key_heads, dk = key_head_dim, dv = value_head_dim;
  const int64_t C = conv_w.size(0), K = conv_w.size(1), key_dim = Hk * dk, value_dim = Hv * dv;
  TORCH_CHECK(proj.dim() == 2 && proj.is_contiguous() && proj.size(1) == C + value_dim + 2 * Hv, "proj shape");
  TORCH_CHECK(C == 2 * key_dim + value_dim && Hv % Hk == 0, "DeltaNet dims");
  for (const auto& t : {conv_w, A_log, dt_bias, norm_w, conv_state, recurrent_state})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "float32, contiguous weights and states");
  TORCH_CHECK(conv_state.size(1) == K - 1 && conv_state.size(2) == C, "conv_state shape");
  TORCH_CHECK(recurrent_state.size(1) == Hv && recurrent_state.size(2) == dk && recurrent_state.size(3) == dv,
              "recurrent_state shape");
  TORCH_CHECK(seqs.scalar_type() == at::kLong && seqs.dim() == 2 && seqs.size(1) == 5, "seqs [N, 5] int64");
  seqs = seqs.contiguous();
  const int64_t T = proj.size(0), W = proj.size(1), N = seqs.size(0), group = Hv / Hk;
  const int64_t* sq = seqs.data_ptr<int64_t>();
  const float* w = conv_w.data_ptr<float>();
  float* cs_all = conv_state.data_ptr<float>();
  float* rs_all = recurrent_state.data_ptr<float>();
  std::vector<float> mixed(T * C), o(T * value_dim);
  std::vector<float> taps(K * C);  // the convolution's weights tap-major: taps[j C + c], a vector of channels a load
  for (int64_t c = 0; c < C; ++c)
    for (int64_t j = 0; j < K; ++j) taps[j * C + c] = w[c * K + j];
  auto out = at::empty({T, value_dim}, proj.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, proj.scalar_type(), "gated_delta_net", [&] {
    const scalar_t* P = proj.data_ptr<scalar_t>();
    // The convolution and its SiLU, per sequence, token by token, VL channels at a time: input u of a sequence is
    // its kept input K - 1 + u for u < 0 (zeros when fresh), else row u of its tokens. Channels in blocks, in
    // parallel; a channel is in the vectors or the scalar tail by its index alone, so its bits are the same in any
    // step. Its last K - 1 inputs are kept (and those after each token but the last, where asked).
    constexpr int64_t CHANNELS = 8 * VL;  // a block's channels
    at::parallel_for(0, (C + CHANNELS - 1) / CHANNELS, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t s = 0; s < N; ++s) {
        const int64_t start = sq[5 * s], n = sq[5 * s + 1], slot = sq[5 * s + 2];
        const bool fresh = sq[5 * s + 3] != 0;
        const int64_t keep_each = sq[5 * s + 4];
        float* cs = cs_all + slot * (K - 1) * C;
        const int64_t c0 = b0 * CHANNELS, c1 = std::min(C, b1 * CHANNELS), vectors = c0 + (c1 - c0) / VL * VL;
        // input u (-(K - 1) <= u < n) of channels c .. c + VL - 1, and of channel c alone
        auto input = [&](int64_t u, int64_t c) {
          if (u >= 0) return load_floats(P + (start + u) * W + c);
          return fresh ? vfloat{} : load_floats(cs + (K - 1 + u) * C + c);
        };
        auto input1 = [&](int64_t u, int64_t c) {
          if (u >= 0) return to_float(P[(start + u) * W + c]);
          return fresh ? 0.0f : cs[(K - 1 + u) * C + c];
        };
        for (int64_t t = 0; t < n; ++t) {
          float* y = mixed.data() + (start + t) * C;
          for (int64_t c = c0; c < vectors; c += VL) {
            vfloat acc = input(t - (K - 1), c) * load_floats(taps.data() + c);
            for (int64_t j = 1; j < K; ++j) acc += input(t - (K - 1) + j, c) * load_floats(taps.data() + j * C + c);
            store_floats(silu(acc), y + c);
          }
          for (int64_t c = vectors; c < c1; ++c) {
            float acc = input1(t - (K - 1), c) * taps[c];
            for (int64_t j = 1; j < K; ++j) acc += input1(t - (K - 1) + j, c) * taps[j * C + c];
            y[c] = silu(acc);
          }
        }
        // the kept inputs: after token t (t = n - 1 for the slot, t < n - 1 for keep_each), inputs t - K + 2 .. t.
        // The slot's last: its old kept inputs may still be read, so each row is read before it is written
        // (row j's source, u = n - K + 1 + j, is a kept row only at or after j)
        auto keep = [&](float* dst, int64_t t) {
          for (int64_t j = 0; j < K - 1; ++j)
            for (int64_t c = c0; c < c1; ++c) dst[j * C + c] = input1(t - (K - 2) + j, c);
        };
        if (keep_each >= 0)
          for (int64_t t = 0; t + 1 < n; ++t) keep(cs_all + (keep_each + t) * (K - 1) * C, t);
        keep(cs, n - 1);
      }
    });
    // q and k L2-normed per key head, q scaled
    const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t part = 0; part < 2; ++part)
          for (int64_t h = 0; h < Hk; ++h) {
            float* x = mixed.data() + t * C + part * key_dim + h * dk;
            float ss = 0.0f;
            for (int64_t i = 0; i < dk; ++i) ss += x[i] * x[i];
            const float scale = (part == 0 ? q_scale : 1.0f) / std::sqrt(ss + 1e-6f);
            for (int64_t i = 0; i < dk; ++i) x[i] *= scale;
          }
    });
    // the delta rule, per sequence and value head, token by token
    at::parallel_for(0, N * Hv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> beta, decay;
      for (int64_t task = begin; task < end; ++task) {
        // value head h's key head: Hugging Face groups the value heads by key head; llama.cpp's files tile them
        const int64_t s = task / Hv, h = task % Hv, kh = tiled_value_heads ? h % Hk : h / group;
        const int64_t start = sq[5 * s], n = sq[5 * s + 1], slot = sq[5 * s + 2], keep_each = sq[5 * s + 4];
        float* S = rs_all + (slot * Hv + h) * dk * dv;  // [dk, dv]
        if (sq[5 * s + 3] != 0) std::fill(S, S + dk * dv, 0.0f);
        beta.resize(n);
        decay.resize(n);
        const float rate = -std::exp(A_log.data_ptr<float>()[h]), bias = dt_bias.data_ptr<float>()[h];
        for (int64_t t = 0; t < n; ++t) {
          const scalar_t* gates = P + (start + t) * W + C + value_dim;  // b, then a, per value head
          beta[t] = rounded<scalar_t>(1.0f / (1.0f + std::exp(-to_float(gates[h]))));
          decay[t] = std::exp(rate * softplus(to_float(gates[Hv + h]) + bias));
        }
        const float* q = mixed.data() + start * C + kh * dk;
        delta_rule(S, dk, dv, n, q, q + key_dim, mixed.data() + start * C + 2 * key_dim + h * dv, C, beta.data(),
                   decay.data(), o.data() + start * value_dim + h * dv, value_dim,
                   keep_each >= 0 ? rs_all + (keep_each * Hv + h) * dk * dv : nullptr, Hv * dk * dv);
      }
    });
    // the gated RMS norm per token and head: norm in float32, rounded; times the weight; times silu(z). A head's
    // sum of squares in VL lanes (then a fixed tree) where dv is a multiple of VL, else one at a time
    scalar_t* Y = out.data_ptr<scalar_t>();
    const float* nw = norm_w.data_ptr<float>();
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t h = 0; h < Hv; ++h) {
          const float* x = o.data() + t * value_dim + h * dv;
          const scalar_t* z = P + t * W + C + h * dv;
          scalar_t* y = Y + t * value_dim + h * dv;
          if (dv % VL == 0) {
            vfloat ss{};
            for (int64_t j = 0; j < dv; j += VL) {
              const vfloat r = round_to<scalar_t>(load_floats(x + j));
              ss += r * r;
            }
            const vfloat inv = broadcast(1.0f / std::sqrt(hsum(ss) / static_cast<float>(dv) + static_cast<float>(eps)));
            for (int64_t j = 0; j < dv; j += VL) {
              const vfloat r = round_to<scalar_t>(load_floats(x + j));
              const vfloat normed = round_to<scalar_t>(round_to<scalar_t>(load_floats(nw + j)) * round_to<scalar_t>(r * inv));
              store_floats(normed * silu(load_floats(z + j)), y + j);
            }
            continue;
          }
          float ss = 0.0f;
          for (int64_t j = 0; j < dv; ++j) ss += rounded<scalar_t>(x[j]) * rounded<scalar_t>(x[j]);
          const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dv) + static_cast<float>(eps));
          for (int64_t j = 0; j < dv; ++j) {
            const float normed = rounded<scalar_t>(rounded<scalar_t>(nw[j]) * rounded<scalar_t>(rounded<scalar_t>(x[j]) * inv));
            y[j] = static_cast<scalar_t>(normed * silu(to_float(z[j])));
          }
        }
    });
  });
  return out;
}
