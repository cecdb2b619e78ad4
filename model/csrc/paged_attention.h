// What the paged attention's two kernels share: on vectors (paged_attention.cpp, every query of every tier) and
// on AMX's tiles (paged_attention_amx.cpp, the amx tier's prompt queries).
#pragma once

#include "vec.h"

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

constexpr int KT = VL;  // keys per tile of scores: a query's softmax runs over whole tiles of them

// RoPE in Hugging Face's half-split layout, as model/attention.py's apply_rope: out = x cos + roll(x, D/2) sin,
// with cos = (cos, cos) and sin = (-sin, sin) as the model builds them; in float32
template <typename T>
inline void rotate(const T* x, const T* cos, const T* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) out[d] = to_float(x[d]) * to_float(cos[d]) + to_float(x[(d + half) % D]) * to_float(sin[d]);
}

// One query's softmax over its keys [a, b). s: its scores indexed by key position, whole tiles of KT keys from
// a / KT * KT (where s is vector-aligned) to the tile holding b - 1; the rest of those tiles is masked. s
// becomes exp(score - max) there, 0 outside [a, b), summed in a fixed order of its own tiles (so a query's bits
// do not depend on the other queries beside it). Returns the denominator; a sink (GPT-OSS: a logit per head)
// joins it only.
inline float softmax(float* s, int64_t a, int64_t b, float softcap, const float* sink) {
  const int64_t a0 = a / KT * KT, b0 = (b + KT - 1) / KT * KT;
  vfloat* tiles = reinterpret_cast<vfloat*>(s + a0);
  const int64_t n_tiles = (b0 - a0) / KT;
  if (softcap > 0)  // Gemma 2: softcap * tanh(score / softcap), before the mask
    for (int64_t j = a0; j < b0; ++j) s[j] = softcap * std::tanh(s[j] / softcap);
  for (int64_t j = a0; j < a; ++j) s[j] = -INFINITY;
  for (int64_t j = b; j < b0; ++j) s[j] = -INFINITY;
  vfloat vmax = tiles[0];
  for (int64_t t = 1; t < n_tiles; ++t) vmax = vmax > tiles[t] ? vmax : tiles[t];
  float m = vmax[0];
  for (int l = 1; l < KT; ++l) m = std::max(m, vmax[l]);
  if (sink) m = std::max(m, *sink);  // a sink far above every score must not overflow exp(sink - m)
  for (int64_t t = 0; t < n_tiles; ++t) tiles[t] = vexp(tiles[t] - m);
  for (int64_t j = a0; j < a; ++j) s[j] = 0.0f;
  for (int64_t j = b; j < b0; ++j) s[j] = 0.0f;
  vfloat sum = {};
  for (int64_t t = 0; t < n_tiles; ++t) sum += tiles[t];
  return hsum(sum) + (sink ? std::exp(*sink - m) : 0.0f);
}

// The amx tier's prompt queries: one sequence, one KV head, queries [token0, token0 + n_pos) at positions pos0
// .. pos0 + n_pos - 1 with the G query heads that share the KV head, on AMX's bfloat16 tiles (the caches are
// bfloat16), on the instructions or on their software model (emulate: tests on CPUs without them). The
// arguments are paged_attention.cpp's attend's. tiles_fit: whether a head of D values runs there.
inline bool tiles_fit(int64_t D) { return D % 64 == 0 && D <= 512; }
template <typename T>
void attend_tiles(bool emulate, const T* q, int64_t q_row_stride, const c10::BFloat16* k_cache,
                  const c10::BFloat16* v_cache, int64_t head_stride, int64_t slot_stride, const int32_t* table,
                  int64_t block_size, int64_t head, int64_t G, int64_t D, int64_t token0, int64_t n_pos, int64_t pos0,
                  int64_t window, float scale, float softcap, T* out, int64_t H, const T* cos, const T* sin,
                  const float* sinks);
