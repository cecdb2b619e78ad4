// The amx tier's prompt queries on AMX's bfloat16 tiles: S = Q K^T and O = P V as tile products (TDPBF16PS),
// the softmax between them on vectors, as paged_attention.cpp's. A prompt's rows already run their GEMMs on
// bfloat16 tiles (quant_gemm_amx.cpp); generated tokens keep the vector kernel, exact and invariant, so a
// decode, a draft's verification and a preempted request's recomputed outputs have the same bits as ever.
//
// Per unit (one sequence, one KV head, a chunk of its queries with the G heads that share the KV head):
//  - Q: each query row rotated and scaled in float32, then rounded to bfloat16, [rows][D]: A's tiles as they lie.
//  - K: each tile of 16 keys and 32 of the head's values as B wants it (row p holds the 16 keys' pair p: a
//    16 x 16 transpose of pairs), for the unit's keys; the block table is read as in paged_attention.cpp.
//  - S [rows][keys] float32, tiles of 16 keys aligned to absolute positions; each query's softmax over its own
//    keys (paged_attention.h), then P rounded to bfloat16: A's tiles as they lie.
//  - V: each 32 keys and 16 values as B wants them (row p interleaves keys 2p and 2p + 1); O += P V over the
//    keys in ascending chunks of 32, aligned to absolute positions; O / the softmax's sum.
// Each output element is one row of A times one column of B, so a query's numbers depend only on its own row:
// a key masked for it has P = 0 and adds exact zeros, so its bits are the same in any chunk, batch or unit
// (only a denormal sum could differ: the tiles flush those to 0, a query's attention sums never are).
//
// Measured nothing yet: written on a Zen 4 (no AMX) against EmulatedTiles (amx.h); to be measured on an AMX host.

#include "paged_attention.h"

#if defined(__AMX_BF16__)

#include "amx.h"

#include <utility>
#include <vector>

namespace amx_attention {  // named: the unity build puts quant_gemm_amx.cpp's tiles beside these

static_assert(VL == 16, "a vector holds a tile row of 16 float32 or 16 pairs");

constexpr int QB = 16;  // query rows a tile
constexpr int KC = 32;  // keys a product of P by V: A's row of 32 bfloat16

// The tile registers: the scores' two tiles of 16 keys (C0, C1) or the outputs' four tiles of 16 values
// (C0 .. C3), then A and two B's. Every one 16 rows of 64 bytes.
enum Tile { C0, C1, C2, C3, TA, TB0, TB1 };

// Result lane l of one butterfly step of a 16 x 16 transpose: the low row (or high) takes, in each group of 2b
// lanes, the first (second) b lanes of x then the same of y
constexpr int pick(int b, bool high, int l) {
  const int g = l / (2 * b) * 2 * b, r = l % (2 * b), half = high ? b : 0;
  return r < b ? g + r + half : VL + g + r - b + half;
}

template <int B, size_t... I>
inline void butterfly(vuint& x, vuint& y, std::index_sequence<I...>) {
#if defined(__clang__)
  const vuint low = __builtin_shufflevector(x, y, pick(B, false, I)...);
  const vuint high = __builtin_shufflevector(x, y, pick(B, true, I)...);
#else
  const vuint low = __builtin_shuffle(x, y, vint{pick(B, false, I)...});
  const vuint high = __builtin_shuffle(x, y, vint{pick(B, true, I)...});
#endif
  x = low, y = high;
}

template <int B>
inline void butterflies(vuint* r) {
  for (int i = 0; i < VL; ++i)
    if (!(i & B)) butterfly<B>(r[i], r[i + B], std::make_index_sequence<VL>{});
}

// r[i][j] <-> r[j][i]: swap the off-diagonal halves, then their halves, down to single lanes (4 x 16 shuffles)
inline void transpose(vuint* r) {
  butterflies<8>(r);
  butterflies<4>(r);
  butterflies<2>(r);
  butterflies<1>(r);
}

inline vuint widen(const c10::BFloat16* p) {  // 16 bfloat16 -> the low halves of 16 dwords
  vhalfword h;
  __builtin_memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, vuint);
}

template <typename Tiles, typename T>
void attend(const T* q, int64_t q_row_stride, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
            int64_t head_stride, int64_t slot_stride, const int32_t* table, int64_t block_size, int64_t head, int64_t G,
            int64_t D, int64_t token0, int64_t n_pos, int64_t pos0, int64_t window, float scale, float softcap, T* out,
            int64_t H, const T* cos, const T* sin, const float* sinks) {
  using bf16 = c10::BFloat16;
  const int64_t nq = n_pos * G, NQ = (nq + QB - 1) / QB * QB;  // query rows, and A's (zero rows past nq)
  const int64_t pos_last = pos0 + n_pos - 1;
  auto first_key = [&](int64_t pos) { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : int64_t(0); };
  const int64_t lo = first_key(pos0) / KC * KC;                 // the unit's keys lo .. lo + L - 1,
  const int64_t L = (pos_last + 1 - lo + KC - 1) / KC * KC;     // zeros past pos_last
  const int64_t DC = D / 32, DE = D / 16;                       // A's tiles of a query row; O's tiles of one
  // the keys a block of 16 query rows needs, [from, to): whole chunks of KC from the first row's first key
  auto keys_of = [&](int64_t r0) {
    const int64_t last_row = std::min(r0 + QB, nq) - 1;
    return std::pair{(first_key(pos0 + r0 / G) - lo) / KC * KC, (pos0 + last_row / G + 1 - lo + KC - 1) / KC * KC};
  };

  thread_local std::vector<bf16> qb, pb;  // [NQ][D] queries, [NQ][L] probabilities: A's tiles
  thread_local std::vector<vuint> kt, vt;  // B's tiles of the keys and of the values, a row a vector
  thread_local std::vector<vfloat> scores;  // [NQ][L] float32
  thread_local std::vector<float> acc, total, rotated;
  qb.assign(NQ * D, bf16(0.0f));
  rotated.resize(D);
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t i = r / G, g = r % G;
    const T* src = q + (token0 + i) * q_row_stride + (head * G + g) * D;
    if (cos)
      rotate(src, cos + (token0 + i) * D, sin + (token0 + i) * D, D, rotated.data());
    else
      for (int64_t d = 0; d < D; ++d) rotated[d] = to_float(src[d]);
    for (int64_t d = 0; d < D; ++d) qb[r * D + d] = static_cast<bf16>(rotated[d] * scale);
  }

  auto row = [&](const bf16* base, int64_t pos) -> const bf16* {  // a key's row, nullptr past the last
    if (pos > pos_last) return nullptr;
    return base + (static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size) * slot_stride;
  };
  const bf16* k_head = k_cache + head * head_stride;
  const bf16* v_head = v_cache + head * head_stride;
  kt.resize(L / VL * DC * VL);  // [key tile][DC][16 rows]
  for (int64_t j = 0; j < L / VL; ++j)
    for (int64_t c = 0; c < DC; ++c) {
      vuint* t = &kt[(j * DC + c) * VL];
      for (int n = 0; n < VL; ++n) {
        const bf16* k = row(k_head, lo + j * VL + n);
        if (k)
          __builtin_memcpy(&t[n], k + 32 * c, sizeof(vuint));
        else
          t[n] = vuint{};
      }
      transpose(t);
    }
  vt.resize(L / KC * DE * VL);  // [key chunk][DE][16 rows]
  for (int64_t kc = 0; kc < L / KC; ++kc)
    for (int p = 0; p < VL; ++p) {
      const bf16* even = row(v_head, lo + kc * KC + 2 * p);
      const bf16* odd = row(v_head, lo + kc * KC + 2 * p + 1);
      for (int64_t e = 0; e < DE; ++e)
        vt[(kc * DE + e) * VL + p] = (even ? widen(even + 16 * e) : vuint{}) | (odd ? widen(odd + 16 * e) << 16 : vuint{});
    }

  TileConfig config;
  for (int t = C0; t <= TB1; ++t) config.rows[t] = QB, config.colsb[t] = 64;
  Tiles::configure(config);

  scores.resize(NQ * L / VL);
  float* S = reinterpret_cast<float*>(scores.data());
  for (int64_t r0 = 0; r0 < NQ; r0 += QB) {
    const auto [from, to] = keys_of(r0);
    for (int64_t k0 = from; k0 < to; k0 += 2 * VL) {  // two tiles of 16 keys: one A, two B's
      Tiles::template zero<C0>();
      Tiles::template zero<C1>();
      for (int64_t c = 0; c < DC; ++c) {
        Tiles::template load<TA>(&qb[r0 * D + 32 * c], D * sizeof(bf16));
        Tiles::template load<TB0>(&kt[(k0 / VL * DC + c) * VL], sizeof(vuint));
        Tiles::template load<TB1>(&kt[((k0 / VL + 1) * DC + c) * VL], sizeof(vuint));
        Tiles::template dpbf16ps<C0, TA, TB0>();
        Tiles::template dpbf16ps<C1, TA, TB1>();
      }
      Tiles::template store<C0>(S + r0 * L + k0, L * sizeof(float));
      Tiles::template store<C1>(S + r0 * L + k0 + VL, L * sizeof(float));
    }
  }

  total.resize(nq);
  pb.assign(NQ * L, bf16(0.0f));
  for (int64_t v = 0; v < nq; ++v) {
    const int64_t pos = pos0 + v / G, a = first_key(pos);
    float* s = S + v * L - lo;  // indexed by key position
    total[v] = softmax(s, a, pos + 1, softcap, sinks ? &sinks[head * G + v % G] : nullptr);
    for (int64_t j = a / KT * KT; j < (pos + KT) / KT * KT; j += VL) {
      vfloat p;
      __builtin_memcpy(&p, s + j, sizeof(p));
      const vhalfword h = to_bf16(p);
      __builtin_memcpy(&pb[v * L + j - lo], &h, sizeof(h));
    }
  }

  acc.resize(NQ * D);
  for (int64_t r0 = 0; r0 < NQ; r0 += QB) {
    const auto [from, to] = keys_of(r0);
    for (int64_t e = 0; e < DE; e += 4) {  // four tiles of 16 values: one A, a B each
      Tiles::template zero<C0>();
      Tiles::template zero<C1>();
      Tiles::template zero<C2>();
      Tiles::template zero<C3>();
      for (int64_t k0 = from; k0 < to; k0 += KC) {
        const vuint* b = &vt[(k0 / KC * DE + e) * VL];
        Tiles::template load<TA>(&pb[r0 * L + k0], L * sizeof(bf16));
        Tiles::template load<TB0>(b, sizeof(vuint));
        Tiles::template dpbf16ps<C0, TA, TB0>();
        Tiles::template load<TB1>(b + VL, sizeof(vuint));
        Tiles::template dpbf16ps<C1, TA, TB1>();
        Tiles::template load<TB0>(b + 2 * VL, sizeof(vuint));
        Tiles::template dpbf16ps<C2, TA, TB0>();
        Tiles::template load<TB1>(b + 3 * VL, sizeof(vuint));
        Tiles::template dpbf16ps<C3, TA, TB1>();
      }
      float* o = &acc[r0 * D + 16 * e];
      Tiles::template store<C0>(o, D * sizeof(float));
      Tiles::template store<C1>(o + 16, D * sizeof(float));
      Tiles::template store<C2>(o + 32, D * sizeof(float));
      Tiles::template store<C3>(o + 48, D * sizeof(float));
    }
  }
  Tiles::release();

  for (int64_t v = 0; v < nq; ++v) {
    const float inv = 1.0f / total[v];
    T* dst = out + ((token0 + v / G) * H + head * G + v % G) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[v * D + d] * inv);
  }
}

}  // namespace amx_attention

template <typename T>
void attend_tiles(bool emulate, const T* q, int64_t q_row_stride, const c10::BFloat16* k_cache,
                  const c10::BFloat16* v_cache, int64_t head_stride, int64_t slot_stride, const int32_t* table,
                  int64_t block_size, int64_t head, int64_t G, int64_t D, int64_t token0, int64_t n_pos, int64_t pos0,
                  int64_t window, float scale, float softcap, T* out, int64_t H, const T* cos, const T* sin,
                  const float* sinks) {
  auto fn = emulate ? amx_attention::attend<EmulatedTiles, T> : amx_attention::attend<HardwareTiles, T>;
  fn(q, q_row_stride, k_cache, v_cache, head_stride, slot_stride, table, block_size, head, G, D, token0, n_pos, pos0,
     window, scale, softcap, out, H, cos, sin, sinks);
}

template void attend_tiles<float>(bool, const float*, int64_t, const c10::BFloat16*, const c10::BFloat16*, int64_t,
                                  int64_t, const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                  int64_t, int64_t, float, float, float*, int64_t, const float*, const float*,
                                  const float*);
template void attend_tiles<c10::BFloat16>(bool, const c10::BFloat16*, int64_t, const c10::BFloat16*,
                                          const c10::BFloat16*, int64_t, int64_t, const int32_t*, int64_t, int64_t,
                                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float,
                                          c10::BFloat16*, int64_t, const c10::BFloat16*, const c10::BFloat16*,
                                          const float*);

#endif  // __AMX_BF16__
