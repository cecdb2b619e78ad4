// Gated DeltaNet on the CPU: one layer's token mixing for a step's sequences, between its input projection and its
// output projection (model/deltanet.py has the math and the Python path this replaces; the same roundings to the
// model's dtype). Per sequence: the causal convolution over its kept inputs and SiLU, q and k L2-normed, the delta
// rule in chunks from its state slot, then the gated RMS norm. Each sequence's numbers depend only on its own
// tokens and state, and each op runs in one fixed order whatever the step holds: a prompt gives the same bits
// prefilled whole or in chunks, a sequence the same bits beside others.

#include "kernels.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace {

// A head that forgets fast takes its chunk's early tokens to exp(G - G_j) below float32's smallest normal number
// (G - G_j < -87: Qwen3.5's decays reach -16 a token), and every product with such a subnormal then costs a
// microcode assist on x86, ~100 cycles where a fused multiply-add takes half of one: a 512-token step of
// Qwen3.6's delta rule ran 5x slower (Xeon). Flushed to zero while a task runs (FTZ and DAZ), its numbers move by
// less than 2^-126 of a state's, in every step alike: the same bits prefilled whole or in chunks.
struct FlushSubnormals {
#if defined(__SSE__)
  const unsigned saved = _mm_getcsr();
  FlushSubnormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushSubnormals() { _mm_setcsr(saved); }
#endif
};

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline vfloat silu(vfloat x) { return x / (1.0f + vexp(-x)); }
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold

template <typename scalar_t>
inline float rounded(float x) {  // x as the model's dtype holds it
  return to_float(static_cast<scalar_t>(x));
}

inline vfloat broadcast(float x) { return x - vfloat{}; }  // x - 0 is x, every x: no addition left in the code

// The delta rule in chunks (model/deltanet.py). A value head's state S [dk, dv] is kept as it stands after the
// sequence's last multiple of `chunk` tokens, S0, with, for each token since, its key k, its correction u = beta
// (v - recall) and G, the sum of the log decays g from the chunk's first token to it. For token p of a chunk,
//   recall_p = exp(G_p) S0^T k_p + sum_{j<p} exp(G_p - G_j) (k_j . k_p) u_j,    u_p = beta_p (v_p - recall_p),
//   out_p    = exp(G_p) S0^T q_p + sum_{j<=p} exp(G_p - G_j) (k_j . q_p) u_j,
// and at the chunk's last token S0 <- exp(G) S0 + sum_j exp(G - G_j) k_j u_j^T (G the last token's): the
// recurrence S_p = exp(g_p) S_{p-1} + k_p u_p^T unrolled. S0 is read once for all the step's tokens in a chunk
// (their k and q as the rows of one product) and written once a chunk, where the recurrence read S twice and
// wrote it once a token. Every number is a function of the sequence's own tokens, each sum in one fixed order
// whatever the step holds (a product's rows in any grouping, the same chain of fused multiply-adds over i for
// each element): a prompt gives the same bits prefilled whole, in chunks of any size or decoded a token at a
// time, beside any other sequences, and a state restored from a snapshot or kept after a draft goes on with the
// same bits.

// y[r] = S^T x[r] for rows r < R: S [dk, dv], x[r] [dk], y[r] [dv]. Each element sums over i in ascending order.
template <int R, int B>
inline void project_columns(const float* __restrict S, int64_t dk, int64_t dv, int64_t j0, const float* const* x,
                            float* const* y) {
  vfloat acc[R][B] = {};
  for (int64_t i = 0; i < dk; ++i) {
    vfloat s[B];
    for (int b = 0; b < B; ++b) s[b] = load_floats(S + i * dv + j0 + b * VL);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vfloat xi = broadcast(x[r][i]);
      for (int b = 0; b < B; ++b) acc[r][b] += xi * s[b];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) store_floats(acc[r][b], y[r] + j0 + b * VL);
}

template <int R>
void project_rows(const float* S, int64_t dk, int64_t dv, const float* const* x, float* const* y) {
  constexpr int B = R >= 4 ? 2 : 4;  // 8 accumulators: enough chains over i to hide their latency
  const int64_t blocked = dv / (B * VL) * B * VL, vectors = dv / VL * VL;
  for (int64_t j0 = 0; j0 < blocked; j0 += B * VL) project_columns<R, B>(S, dk, dv, j0, x, y);
  for (int64_t j0 = blocked; j0 < vectors; j0 += VL) project_columns<R, 1>(S, dk, dv, j0, x, y);
  for (int64_t j = vectors; j < dv; ++j)
    for (int r = 0; r < R; ++r) {
      float acc = 0.0f;
      for (int64_t i = 0; i < dk; ++i) acc += x[r][i] * S[i * dv + j];
      y[r][j] = acc;
    }
}

// rows x[0 .. n) through S^T, four at a time (accumulators: 4 rows x 2 vectors, 8 of 16 registers), then two (a
// decode's k and q: one pass over S), then one
void project(const float* S, int64_t dk, int64_t dv, const float* const* x, float* const* y, int64_t n) {
  int64_t r = 0;
  for (; r + 4 <= n; r += 4) project_rows<4>(S, dk, dv, x + r, y + r);
  for (; r + 2 <= n; r += 2) project_rows<2>(S, dk, dv, x + r, y + r);
  for (; r < n; ++r) project_rows<1>(S, dk, dv, x + r, y + r);
}

// k and q . each of a chunk's keys (Kt [dk, chunk], the keys as columns), into kdots and qdots [chunk]: up to 8 keys
// a vector (a chunk is a multiple of 8; on AVX-512, 256-bit vectors, native there too), every column whether it
// holds a key yet or not; each dot in four chains of fused multiply-adds (i mod 4, so that their latencies
// overlap), summed as (0 + 1) + (2 + 3): one fixed order for every step
constexpr int KEY_LANES = VL < 8 ? VL : 8;
typedef float vkeys __attribute__((vector_size(KEY_LANES * sizeof(float))));

inline vkeys load_keys(const float* p) {
  vkeys v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void dot_keys(const float* __restrict Kt, int64_t dk, int64_t chunk, const float* __restrict k,
                     const float* __restrict q, float* __restrict kdots, float* __restrict qdots) {
  for (int64_t j0 = 0; j0 < chunk; j0 += KEY_LANES) {
    vkeys ka[4] = {}, qa[4] = {};
    int64_t i = 0;
    for (; i + 4 <= dk; i += 4)
      for (int c = 0; c < 4; ++c) {
        const vkeys key = load_keys(Kt + (i + c) * chunk + j0);
        ka[c] += (k[i + c] - vkeys{}) * key;
        qa[c] += (q[i + c] - vkeys{}) * key;
      }
    for (; i < dk; ++i) {
      const vkeys key = load_keys(Kt + i * chunk + j0);
      ka[0] += (k[i] - vkeys{}) * key;
      qa[0] += (q[i] - vkeys{}) * key;
    }
    const vkeys kd = (ka[0] + ka[1]) + (ka[2] + ka[3]), qd = (qa[0] + qa[1]) + (qa[2] + qa[3]);
    __builtin_memcpy(kdots + j0, &kd, sizeof(kd));
    __builtin_memcpy(qdots + j0, &qd, sizeof(qd));
  }
}

// y = first + sum_{j < rows} c[j] U[j] over dv columns, each column's sum in ascending j, COLUMNS vectors a pass
inline void combine(const float* __restrict first, const float* __restrict c, const float* __restrict U,
                    int64_t rows, int64_t dv, float* __restrict y) {
  constexpr int COLUMNS = 4;
  int64_t l0 = 0;
  for (; l0 + COLUMNS * VL <= dv; l0 += COLUMNS * VL) {
    vfloat acc[COLUMNS];
    for (int b = 0; b < COLUMNS; ++b) acc[b] = load_floats(first + l0 + b * VL);
    for (int64_t j = 0; j < rows; ++j) {
      const vfloat cj = broadcast(c[j]);
      for (int b = 0; b < COLUMNS; ++b) acc[b] += cj * load_floats(U + j * dv + l0 + b * VL);
    }
    for (int b = 0; b < COLUMNS; ++b) store_floats(acc[b], y + l0 + b * VL);
  }
  for (; l0 + VL <= dv; l0 += VL) {
    vfloat acc = load_floats(first + l0);
    for (int64_t j = 0; j < rows; ++j) acc += broadcast(c[j]) * load_floats(U + j * dv + l0);
    store_floats(acc, y + l0);
  }
  for (; l0 < dv; ++l0) {
    float acc = first[l0];
    for (int64_t j = 0; j < rows; ++j) acc += c[j] * U[j * dv + l0];
    y[l0] = acc;
  }
}

// S0 <- exp(G) S0 + sum_j a_j u_j^T over a finished chunk's rows, a_j = exp(G - G_j) k_j (in a [rows, dk]), tile
// by tile: each element scaled, then a fused multiply-add a row j at a time in ascending order
template <int R, int B>
inline void fold_tile(float* __restrict S, int64_t dv, int64_t i0, int64_t j0, float scale, const float* a,
                      int64_t dk, const float* u, int64_t width, int64_t rows) {
  vfloat acc[R][B];
  const vfloat sv = broadcast(scale);
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = load_floats(S + (i0 + r) * dv + j0 + b * VL) * sv;
  for (int64_t j = 0; j < rows; ++j) {
    vfloat uj[B];
    for (int b = 0; b < B; ++b) uj[b] = load_floats(u + j * width + j0 + b * VL);
    for (int r = 0; r < R; ++r) {
      const vfloat aj = broadcast(a[j * dk + i0 + r]);
      for (int b = 0; b < B; ++b) acc[r][b] += aj * uj[b];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) store_floats(acc[r][b], S + (i0 + r) * dv + j0 + b * VL);
}

void fold(float* S, int64_t dk, int64_t dv, float scale, const float* a, const float* u, int64_t width,
          int64_t rows) {
  constexpr int R = 4, B = 2;
  const int64_t blocked = dv / (B * VL) * B * VL, vectors = dv / VL * VL, rows_blocked = dk / R * R;
  for (int64_t i0 = 0; i0 < dk; i0 += (i0 < rows_blocked ? R : 1)) {
    const bool four = i0 < rows_blocked;
    for (int64_t j0 = 0; j0 < blocked; j0 += B * VL)
      four ? fold_tile<R, B>(S, dv, i0, j0, scale, a, dk, u, width, rows)
           : fold_tile<1, B>(S, dv, i0, j0, scale, a, dk, u, width, rows);
    for (int64_t j0 = blocked; j0 < vectors; j0 += VL)
      four ? fold_tile<R, 1>(S, dv, i0, j0, scale, a, dk, u, width, rows)
           : fold_tile<1, 1>(S, dv, i0, j0, scale, a, dk, u, width, rows);
  }
  for (int64_t j = vectors; j < dv; ++j)
    for (int64_t i = 0; i < dk; ++i) {
      float acc = S[i * dv + j] * scale;
      for (int64_t r = 0; r < rows; ++r) acc += a[r * dk + i] * u[r * width + j];
      S[i * dv + j] = acc;
    }
}

struct Scratch {  // a task's working rows, reused
  std::vector<float> projected, first, kdots, qdots, weights, a;
  std::vector<const float*> x;
  std::vector<float*> y;
};

// One sequence's n tokens through one value head: state its S0 [dk, dv], then its chunk's keys as columns Kt
// [dk, chunk], corrections U [chunk, dv] and log decays G [chunk]; position the sequence's tokens before this
// step; q, k, v of token t at q + t stride (and k, v likewise), out + t out_stride its output; beta, g (the log
// decay) [n]; keep: null, or n - 1 states after each token but the last, keep_stride apart. Token by token within
// a chunk (u_p needs u_j for j < p), S0's products for a chunk's tokens at once.
void delta_rule(float* state, int64_t dk, int64_t dv, int64_t chunk, int64_t position, int64_t n, const float* q,
                const float* k, const float* v, int64_t stride, const float* beta, const float* g, float* out,
                int64_t out_stride, float* keep, int64_t keep_stride, Scratch& scratch) {
  float *S = state, *Kt = S + dk * dv, *U = Kt + dk * chunk, *Gs = U + chunk * dv;
  const int64_t state_size = dk * dv + chunk * (dk + dv + 1);
  scratch.projected.resize(2 * chunk * dv);
  scratch.first.resize(dv);
  scratch.kdots.resize(chunk);
  scratch.qdots.resize(chunk);
  scratch.weights.resize(chunk);
  scratch.a.resize(chunk * dk);
  scratch.x.resize(2 * chunk);
  scratch.y.resize(2 * chunk);
  float *first = scratch.first.data(), *kdots = scratch.kdots.data(), *qdots = scratch.qdots.data();
  float* weights = scratch.weights.data();
  for (int64_t t0 = 0; t0 < n;) {
    const int64_t m0 = (position + t0) % chunk, t1 = std::min(n, t0 + chunk - m0);  // the step's tokens of a chunk
    for (int64_t t = t0; t < t1; ++t) {
      scratch.x[2 * (t - t0)] = k + t * stride;
      scratch.x[2 * (t - t0) + 1] = q + t * stride;
    }
    for (int64_t r = 0; r < 2 * (t1 - t0); ++r) scratch.y[r] = scratch.projected.data() + r * dv;
    project(S, dk, dv, scratch.x.data(), scratch.y.data(), 2 * (t1 - t0));  // S0^T k, S0^T q
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m = m0 + t - t0;
      const float *k_t = k + t * stride, *q_t = q + t * stride, *v_t = v + t * stride;
      const float *Sk = scratch.y[2 * (t - t0)], *Sq = scratch.y[2 * (t - t0) + 1];
      const float G = (m > 0 ? Gs[m - 1] : 0.0f) + g[t], decay = std::exp(G);
      Gs[m] = G;
      for (int64_t i = 0; i < dk; ++i) Kt[i * chunk + m] = k_t[i];
      for (int64_t j = 0; j <= m; ++j) weights[j] = std::exp(G - Gs[j]);  // exp(G_p - G_j)
      dot_keys(Kt, dk, chunk, k_t, q_t, kdots, qdots);
      for (int64_t j = 0; j <= m; ++j) {
        kdots[j] *= weights[j];
        qdots[j] *= weights[j];
      }
      // recall and u: the rows before this one
      for (int64_t l = 0; l < dv; ++l) first[l] = decay * Sk[l];
      float* u = U + m * dv;
      combine(first, kdots, U, m, dv, u);  // the recall, then u in its place
      for (int64_t l = 0; l < dv; ++l) u[l] = (v_t[l] - u[l]) * beta[t];
      // the output: every row so far, this one's too
      for (int64_t l = 0; l < dv; ++l) first[l] = decay * Sq[l];
      combine(first, qdots, U, m + 1, dv, out + t * out_stride);
      if (m == chunk - 1) {  // the chunk's last token: its rows folded into S0
        for (int64_t j = 0; j < chunk; ++j)
          for (int64_t i = 0; i < dk; ++i) scratch.a[j * dk + i] = weights[j] * Kt[i * chunk + j];
        fold(S, dk, dv, decay, scratch.a.data(), U, dv, chunk);
      }
      if (keep && t + 1 < n) std::copy(state, state + state_size, keep + t * keep_stride);
    }
    t0 = t1;
  }
}

}  // namespace

// proj [T, conv_dim + value_dim + 2 Hv]: the input projection's [q k v | z | b | a] rows; conv_w [conv_dim, kernel];
// A_log, dt_bias [Hv]; norm_w [dv] (float32); conv_state [slots, kernel - 1, conv_dim] and recurrent_state [slots,
// Hv, dk dv + chunk (dk + dv + 1)] (float32, this layer's, updated in place: each head's S0 and chunk rows, the
// chunk read off its size); seqs [N, 5] int64: each sequence's first flat token, its tokens this step, its slot,
// its tokens before this step (0: its state starts from zero), and -1 or the first of n - 1 slots that get its
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
  // a value head's state: S0 [dk, dv], then `chunk` rows of [k | u | G] (dk + dv + 1 floats)
  const int64_t width = dk + dv + 1, chunk = recurrent_state.dim() == 3 ? (recurrent_state.size(2) - dk * dv) / width : 0;
  TORCH_CHECK(recurrent_state.dim() == 3 && recurrent_state.size(1) == Hv && chunk > 0 && chunk % KEY_LANES == 0 &&
                  recurrent_state.size(2) == dk * dv + chunk * width,
              "recurrent_state shape");
  const int64_t state_size = recurrent_state.size(2);
  TORCH_CHECK(seqs.scalar_type() == at::kLong && seqs.dim() == 2 && seqs.size(1) == 5, "seqs [N, 5] int64");
  seqs = seqs.contiguous();
  const int64_t T = proj.size(0), W = proj.size(1), N = seqs.size(0), group = Hv / Hk;
  const int64_t* sq = seqs.data_ptr<int64_t>();
  int64_t covered = 0;  // the sequences' tokens are the step's, each once
  for (int64_t s = 0; s < N; ++s) {
    TORCH_CHECK(sq[5 * s] == covered && sq[5 * s + 1] > 0 && sq[5 * s + 3] >= 0, "seqs: contiguous tokens");
    covered += sq[5 * s + 1];
  }
  TORCH_CHECK(covered == T, "seqs must cover the step's tokens");
  const float* w = conv_w.data_ptr<float>();
  float* cs_all = conv_state.data_ptr<float>();
  float* rs_all = recurrent_state.data_ptr<float>();
  // the convolved q, k, v and the delta rule's output, float32: every row written before it is read (no zeros to
  // fill, 12 MiB of them in a 512-token prompt of Qwen3.5-2B)
  const std::unique_ptr<float[]> mixed_rows(new float[T * C]), o_rows(new float[T * value_dim]);
  float *mixed = mixed_rows.get(), *o = o_rows.get();
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
        const bool fresh = sq[5 * s + 3] == 0;  // its first tokens: no kept inputs
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
          float* y = mixed + (start + t) * C;
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
            float* x = mixed + t * C + part * key_dim + h * dk;
            vfloat lanes{};  // VL lanes, then the tail: one fixed order (one chain of dk adds was latency-bound)
            int64_t i = 0;
            for (; i + VL <= dk; i += VL) lanes += load_floats(x + i) * load_floats(x + i);
            float ss = hsum(lanes);
            for (; i < dk; ++i) ss += x[i] * x[i];
            const float scale = (part == 0 ? q_scale : 1.0f) / std::sqrt(ss + 1e-6f);
            for (int64_t i = 0; i < dk; ++i) x[i] *= scale;
          }
    });
    // the delta rule, per sequence and value head
    at::parallel_for(0, N * Hv, 1, [&](int64_t begin, int64_t end) {
      const FlushSubnormals flushed;
      std::vector<float> beta, g;
      Scratch scratch;
      for (int64_t task = begin; task < end; ++task) {
        // value head h's key head: Hugging Face groups the value heads by key head; llama.cpp's files tile them
        const int64_t s = task / Hv, h = task % Hv, kh = tiled_value_heads ? h % Hk : h / group;
        const int64_t start = sq[5 * s], n = sq[5 * s + 1], slot = sq[5 * s + 2], position = sq[5 * s + 3];
        const int64_t keep_each = sq[5 * s + 4];
        float* state = rs_all + (slot * Hv + h) * state_size;
        if (position == 0) std::fill(state, state + dk * dv, 0.0f);
        beta.resize(n);
        g.resize(n);
        const float rate = -std::exp(A_log.data_ptr<float>()[h]), bias = dt_bias.data_ptr<float>()[h];
        for (int64_t t = 0; t < n; ++t) {
          const scalar_t* gates = P + (start + t) * W + C + value_dim;  // b, then a, per value head
          beta[t] = rounded<scalar_t>(1.0f / (1.0f + std::exp(-to_float(gates[h]))));
          g[t] = rate * softplus(to_float(gates[Hv + h]) + bias);
        }
        const float* q = mixed + start * C + kh * dk;
        delta_rule(state, dk, dv, chunk, position, n, q, q + key_dim, mixed + start * C + 2 * key_dim + h * dv,
                   C, beta.data(), g.data(), o + start * value_dim + h * dv, value_dim,
                   keep_each >= 0 ? rs_all + keep_each * Hv * state_size + h * state_size : nullptr,
                   Hv * state_size, scratch);
      }
    });
    // the gated RMS norm per token and head: norm in float32, rounded; times the weight; times silu(z). A head's
    // sum of squares in VL lanes (then a fixed tree) where dv is a multiple of VL, else one at a time
    scalar_t* Y = out.data_ptr<scalar_t>();
    const float* nw = norm_w.data_ptr<float>();
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t h = 0; h < Hv; ++h) {
          const float* x = o + t * value_dim + h * dv;
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
