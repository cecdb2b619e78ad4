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
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold

template <typename scalar_t>
inline float rounded(float x) {  // x as the model's dtype holds it
  return to_float(static_cast<scalar_t>(x));
}

// The delta rule's two passes over one value head's state S [dk, dv] for value columns [j0, j0 + J), J
// accumulators kept in registers: recall = (S decay)^T k, read only; then S <- S decay + k correction^T and
// out = S^T q. Each column sums over the rows in ascending order, as a plain loop would: the same bits.
template <int64_t J>
inline void recall_columns(const float* S, int64_t dk, int64_t dv, int64_t j0, float decay, const float* k,
                           float* recall) {
  float acc[J] = {};
  for (int64_t i = 0; i < dk; ++i) {
    const float* row = S + i * dv + j0;
    for (int64_t j = 0; j < J; ++j) acc[j] += row[j] * decay * k[i];
  }
  for (int64_t j = 0; j < J; ++j) recall[j0 + j] = acc[j];
}

template <int64_t J>
inline void update_columns(float* S, int64_t dk, int64_t dv, int64_t j0, float decay, const float* k,
                           const float* correction, const float* q, float* out) {
  float acc[J] = {};
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * dv + j0;
    for (int64_t j = 0; j < J; ++j) {
      const float decayed = row[j] * decay;
      row[j] = decayed + k[i] * correction[j0 + j];
      acc[j] += row[j] * q[i];
    }
  }
  for (int64_t j = 0; j < J; ++j) out[j0 + j] = acc[j];
}

// both passes over every column, in blocks of J (32 where dv allows, else 16, else 1)
template <int64_t J>
void delta_rule_step(float* S, int64_t dk, int64_t dv, float decay, const float* k, const float* v, float beta,
                     const float* q, float* correction, float* out) {
  for (int64_t j0 = 0; j0 < dv; j0 += J) recall_columns<J>(S, dk, dv, j0, decay, k, correction);
  for (int64_t j = 0; j < dv; ++j) correction[j] = (v[j] - correction[j]) * beta;
  for (int64_t j0 = 0; j0 < dv; j0 += J) update_columns<J>(S, dk, dv, j0, decay, k, correction, q, out);
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
                           int64_t num_key_heads, int64_t key_head_dim, int64_t value_head_dim, double eps) {
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
  auto out = at::empty({T, value_dim}, proj.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, proj.scalar_type(), "gated_delta_net", [&] {
    const scalar_t* P = proj.data_ptr<scalar_t>();
    // the convolution and its SiLU, per sequence and channel; its last kernel - 1 inputs kept. One parallel
    // region over the channels for every sequence (a step of many decodes would pay a region each otherwise)
    int64_t longest = 0;
    for (int64_t s = 0; s < N; ++s) longest = std::max(longest, sq[5 * s + 1]);
    at::parallel_for(0, C, 16, [&](int64_t c0, int64_t c1) {
      std::vector<float> window(K - 1 + longest);
      for (int64_t s = 0; s < N; ++s) {
        const int64_t start = sq[5 * s], n = sq[5 * s + 1], slot = sq[5 * s + 2];
        const bool fresh = sq[5 * s + 3] != 0;
        const int64_t keep_each = sq[5 * s + 4];
        float* cs = cs_all + slot * (K - 1) * C;
        for (int64_t c = c0; c < c1; ++c) {
          for (int64_t j = 0; j < K - 1; ++j) window[j] = fresh ? 0.0f : cs[j * C + c];
          for (int64_t t = 0; t < n; ++t) window[K - 1 + t] = to_float(P[(start + t) * W + c]);
          for (int64_t t = 0; t < n; ++t) {
            float y = window[t] * w[c * K];
            for (int64_t j = 1; j < K; ++j) y += window[t + j] * w[c * K + j];
            mixed[(start + t) * C + c] = silu(y);
          }
          for (int64_t j = 0; j < K - 1; ++j) cs[j * C + c] = window[n + j];
          if (keep_each >= 0)  // the last kernel - 1 inputs after each token but the last
            for (int64_t t = 0; t + 1 < n; ++t)
              for (int64_t j = 0; j < K - 1; ++j) cs_all[((keep_each + t) * (K - 1) + j) * C + c] = window[t + 1 + j];
        }
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
            const float inv = 1.0f / std::sqrt(ss + 1e-6f);
            for (int64_t i = 0; i < dk; ++i) x[i] = part == 0 ? x[i] * inv * q_scale : x[i] * inv;
          }
    });
    // the delta rule, per sequence and value head, token by token
    at::parallel_for(0, N * Hv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> remembered(dv);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t s = task / Hv, h = task % Hv, kh = h / group;
        const int64_t start = sq[5 * s], n = sq[5 * s + 1], slot = sq[5 * s + 2], keep_each = sq[5 * s + 4];
        float* S = rs_all + (slot * Hv + h) * dk * dv;  // [dk, dv]
        if (sq[5 * s + 3] != 0) std::fill(S, S + dk * dv, 0.0f);
        const float rate = -std::exp(A_log.data_ptr<float>()[h]), bias = dt_bias.data_ptr<float>()[h];
        for (int64_t t = 0; t < n; ++t) {
          const int64_t row = start + t;
          const float* q = mixed.data() + row * C + kh * dk;
          const float* k = q + key_dim;
          const float* v = mixed.data() + row * C + 2 * key_dim + h * dv;
          const float beta = rounded<scalar_t>(1.0f / (1.0f + std::exp(-to_float(P[row * W + C + value_dim + h]))));
          const float decay = std::exp(rate * softplus(to_float(P[row * W + C + value_dim + Hv + h]) + bias));
          float* o_t = o.data() + row * value_dim + h * dv;
          if (dv % 32 == 0)
            delta_rule_step<32>(S, dk, dv, decay, k, v, beta, q, remembered.data(), o_t);
          else if (dv % 16 == 0)
            delta_rule_step<16>(S, dk, dv, decay, k, v, beta, q, remembered.data(), o_t);
          else
            delta_rule_step<1>(S, dk, dv, decay, k, v, beta, q, remembered.data(), o_t);
          if (keep_each >= 0 && t + 1 < n) std::copy(S, S + dk * dv, rs_all + ((keep_each + t) * Hv + h) * dk * dv);
        }
      }
    });
    // the gated RMS norm per token and head: norm in float32, rounded; times the weight; times silu(z)
    scalar_t* Y = out.data_ptr<scalar_t>();
    const float* nw = norm_w.data_ptr<float>();
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      std::vector<float> x(dv);
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t h = 0; h < Hv; ++h) {
          float ss = 0.0f;
          for (int64_t j = 0; j < dv; ++j) {
            x[j] = rounded<scalar_t>(o[t * value_dim + h * dv + j]);
            ss += x[j] * x[j];
          }
          const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dv) + static_cast<float>(eps));
          for (int64_t j = 0; j < dv; ++j) {
            const float normed = rounded<scalar_t>(rounded<scalar_t>(nw[j]) * rounded<scalar_t>(x[j] * inv));
            const float z = to_float(P[t * W + C + h * dv + j]);
            Y[t * value_dim + h * dv + j] = static_cast<scalar_t>(normed * silu(z));
          }
        }
    });
  });
  return out;
}
