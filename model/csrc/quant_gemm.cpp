// GEMMs on quantized weights (CPU): y = x W^T (+ bias), x in bfloat16, W in groups of 32 weights along K,
// each group stored as small integers q with a float32 scale d (and, 4-bit, a minimum):
//   q4 (GGUF Q4_0, Q4_1, int4 at load): w = d * q + m, q in 0..15
//   q8 (GGUF Q8_0, int8 at load):       w = d * q,     q in -127..127
// The integers are exact in bfloat16, so a group's sum runs on the exact weights: sum_k x_k q_k, in float32
// (bfloat16 pair products are exact in float32), then times d (plus m * sum_k x_k). Nothing is rounded to a
// 16-bit weight. A 4-bit q is turned into a bfloat16 by writing it into the mantissa of 128.0, which gives
// 128 + q; the 128 * sum_k x_k that adds is taken back with the offset m - 128 d.
//
// Layout (model/quant.py packs it): output rows in tiles of 16 (one vector lane each), K in groups of 32:
//   q4: [tiles, groups, 8 chunks, 32 bytes]; chunk c, byte 2j + i holds lane j's q[4c + i] (low nibble) and
//       q[4c + 2 + i] (high nibble)
//   q8: [tiles, groups, 16 chunks, 32 bytes]; chunk c, byte 2j + i holds lane j's q[2c + i]
//   scales (d), mins (m): [tiles, groups, 16] float16 (as GGUF stores them: exact)
// Every row of x runs the same instructions in the same order whatever the batch, so a token's output has the
// same bits alone or in any batch (no padding needed).

#include "vec.h"

#include <ATen/Parallel.h>

#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

typedef uint8_t vbyte32 __attribute__((vector_size(32)));
typedef uint16_t vword32 __attribute__((vector_size(64)));
typedef int8_t vsbyte32 __attribute__((vector_size(32)));
typedef int16_t vsword32 __attribute__((vector_size(64)));
typedef uint32_t vuint __attribute__((vector_size(VL * sizeof(uint32_t))));

constexpr int TILE = 16;   // output rows per tile (vector lanes)
constexpr int GROUP = 32;  // weights per scale
constexpr int MAX_ROWS = 8;  // rows of x computed together (accumulators kept in registers)

template <typename V, typename W>
inline V bitcast(W w) {
  static_assert(sizeof(V) == sizeof(W));
  V v;
  __builtin_memcpy(&v, &w, sizeof(v));
  return v;
}

// acc + the pairwise dot products of 16 lanes of bfloat16 pairs: w (packed weights) and x (one pair, the same
// in every lane). With AVX512-BF16 one instruction; elsewhere the same products in float32.
inline vfloat dot_pairs(vfloat acc, vuint w, uint32_t x) {
#if defined(__AVX512BF16__)
  return bitcast<vfloat>(_mm512_dpbf16_ps(bitcast<__m512>(acc), bitcast<__m512bh>(w),
                                          bitcast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x)))));
#else
  const float x_even = bitcast<float>(x << 16), x_odd = bitcast<float>(x & 0xFFFF0000u);
  acc += bitcast<vfloat>(w & 0xFFFF0000u) * x_odd;
  return acc + bitcast<vfloat>(w << 16) * x_even;
#endif
}

// 16 float16 -> float32
inline vfloat load_halves(const at::Half* p) {
#if defined(__AVX512F__)
  return bitcast<vfloat>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#else
  vfloat v;
  for (int l = 0; l < VL; ++l) v[l] = static_cast<float>(p[l]);
  return v;
#endif
}

// 32 nibble-bytes -> two vectors of 16 bfloat16 pairs, 128 + q each (low nibbles, high nibbles)
inline void unpack_q4(const uint8_t* p, vuint& low, vuint& high) {
  vbyte32 b;
  __builtin_memcpy(&b, p, 32);
  const vuint w = bitcast<vuint>(__builtin_convertvector(b, vword32));  // lane j: byte 2j | byte 2j+1 << 16
  low = (w & 0x000F000Fu) | 0x43004300u;
  high = ((w >> 4) & 0x000F000Fu) | 0x43004300u;
}

// 32 int8 -> 16 bfloat16 pairs (exact: |q| < 256)
inline vuint unpack_q8(const uint8_t* p) {
#if defined(__AVX512BF16__)
  // each half to 16 float32, then both to bfloat16 in one instruction that keeps the bytes' order
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return bitcast<vuint>(_mm512_cvtne2ps_pbh(high, low));
#else
  vsbyte32 b;
  __builtin_memcpy(&b, p, 32);
  const vint w = bitcast<vint>(__builtin_convertvector(b, vsword32));  // lane j: q[2j] | q[2j+1] << 16 (signed)
  const vfloat even = __builtin_convertvector((w << 16) >> 16, vfloat), odd = __builtin_convertvector(w >> 16, vfloat);
  return (bitcast<vuint>(even) >> 16) | (bitcast<vuint>(odd) & 0xFFFF0000u);
#endif
}

// Pair vectors per group: vector v of group g holds the 16 lanes' weights k = 2v, 2v + 1 of the group
constexpr int VECS = GROUP / 2;

// Packed bytes of one group of a tile: 16 lanes x 32 weights, 4 or 8 bits each
template <bool Q4>
constexpr int64_t GROUP_BYTES = Q4 ? 256 : 512;

// A group's scale d and offset m - 128 d (4-bit; 0 for 8-bit), float32, from the packed float16 ones
template <bool Q4>
inline void group_scales(const at::Half* scale, const at::Half* min, vfloat& d, vfloat& offset) {
  d = load_halves(scale);
  offset = Q4 ? load_halves(min) - 128.0f * d : vfloat{};
}

// An unpacked tile: per group, its VECS bfloat16 pair vectors, then d and the offset as float32 vectors
constexpr int UNPACKED = VECS + 2;

// the tile unpacked once, [groups][UNPACKED], to reuse it over many rows
template <bool Q4>
void unpack_tile(const uint8_t* w, const at::Half* scale, const at::Half* min, int64_t groups, vuint* out) {
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * GROUP_BYTES<Q4>;
    vuint* o = out + g * UNPACKED;
    for (int c = 0; c < (Q4 ? 8 : 16); ++c) {
      if constexpr (Q4)
        unpack_q4(wg + c * 32, o[2 * c], o[2 * c + 1]);
      else
        o[c] = unpack_q8(wg + c * 32);
    }
    vfloat d, offset;
    group_scales<Q4>(scale + g * TILE, Q4 ? min + g * TILE : nullptr, d, offset);
    o[VECS] = bitcast<vuint>(d);
    o[VECS + 1] = bitcast<vuint>(offset);
  }
}

// y[r] (16 outputs of one tile) for R rows of x, over all groups: from the packed weights, or (unpacked set)
// from the tile unpacked once. Either way each row gets the same operations in the same order. With next set
// (the following tile's packed weights), each group asks for that tile's matching bytes ahead: a step reads
// its weights from memory (tens of MB), and the hardware's prefetcher alone stalls at each tile's start
// (measured on the default model's GEMMs, cold: 1.10-1.24x at 1-8 rows, 1.04x at 32-64).
template <bool Q4, int R>
void tile_rows(const uint32_t* const* x, const float* const* xsum, const uint8_t* w, const vuint* unpacked,
               const at::Half* scale, const at::Half* min, int64_t groups, vfloat* out, const uint8_t* next) {
  vfloat y[R];  // local, so that the compiler keeps it in registers
  for (int r = 0; r < R; ++r) y[r] = vfloat{};
  for (int64_t g = 0; g < groups; ++g) {
    vfloat acc[R];
    for (int r = 0; r < R; ++r) acc[r] = vfloat{};
    const int64_t k0 = g * VECS;  // the group's first bfloat16 pair
    if (next)
      for (int64_t i = 0; i < GROUP_BYTES<Q4>; i += 64) __builtin_prefetch(next + g * GROUP_BYTES<Q4> + i);
    auto dot_rows = [&](vuint pairs, int64_t k) {
      for (int r = 0; r < R; ++r) acc[r] = dot_pairs(acc[r], pairs, x[r][k]);
    };
    vfloat d, offset;
    if (unpacked) {
      const vuint* u = unpacked + g * UNPACKED;
      for (int v = 0; v < VECS; ++v) dot_rows(u[v], k0 + v);
      d = bitcast<vfloat>(u[VECS]);
      offset = bitcast<vfloat>(u[VECS + 1]);
    } else {
      if constexpr (Q4) {
        for (int c = 0; c < 8; ++c) {
          vuint low, high;
          unpack_q4(w + g * GROUP_BYTES<Q4> + c * 32, low, high);
          dot_rows(low, k0 + 2 * c);
          dot_rows(high, k0 + 2 * c + 1);
        }
      } else {
        for (int c = 0; c < 16; ++c) dot_rows(unpack_q8(w + g * GROUP_BYTES<Q4> + c * 32), k0 + c);
      }
      group_scales<Q4>(scale + g * TILE, Q4 ? min + g * TILE : nullptr, d, offset);
    }
    for (int r = 0; r < R; ++r) y[r] += acc[r] * d;
    if constexpr (Q4)
      for (int r = 0; r < R; ++r) y[r] += offset * xsum[r][g];
  }
  for (int r = 0; r < R; ++r) out[r] = y[r];
}

template <bool Q4>
void rows_block(int R, const uint32_t* const* x, const float* const* xsum, const uint8_t* w, const vuint* unpacked, const uint8_t* next,
                const at::Half* scale, const at::Half* min, int64_t groups, vfloat* y) {
  switch (R) {
#define ROWS(n) \
  case n: return tile_rows<Q4, n>(x, xsum, w, unpacked, scale, min, groups, y, next);
    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
  }
}

// the sum of 32 bfloat16 in float32, in a fixed order: each pair, then a tree over the 16 pair sums
inline float group_sum(const c10::BFloat16* x) {
  vword32 h;
  __builtin_memcpy(&h, x, sizeof(h));
  const vuint w = bitcast<vuint>(h);  // lane j: x[2j] | x[2j + 1] << 16
  return hsum(bitcast<vfloat>(w << 16) + bitcast<vfloat>(w & 0xFFFF0000u));
}

typedef uint16_t vhalfword __attribute__((vector_size(VL * sizeof(uint16_t))));

// 16 float32 -> bfloat16 with c10's rounding (to nearest even, NaN to 0x7FC0), so the bits are what
// static_cast<c10::BFloat16> gives, 16 at a time
inline vhalfword to_bf16(vfloat v) {
  const vuint u = bitcast<vuint>(v);
  const vuint rounded = (u + ((u >> 16) & 1u) + 0x7FFFu) >> 16;
  const vuint nan = bitcast<vuint>(v != v);
  return __builtin_convertvector((rounded & ~nan) | (0x7FC0u & nan), vhalfword);
}

// the first n of v (+ bias) into dst
inline vfloat with_bias(vfloat v, int64_t n, const float* bias) {
  vfloat b{};
  if (bias) __builtin_memcpy(&b, bias, n * sizeof(float));
  return v + b;
}

inline void store(float* dst, int64_t n, vfloat v, const float* bias) {
  v = with_bias(v, n, bias);
  __builtin_memcpy(dst, &v, n * sizeof(float));
}

inline void store(c10::BFloat16* dst, int64_t n, vfloat v, const float* bias) {
  const vhalfword h = to_bf16(with_bias(v, n, bias));
  __builtin_memcpy(dst, &h, n * sizeof(uint16_t));
}

torch::Tensor gemm(bool q4, torch::Tensor x, torch::Tensor packed, torch::Tensor scales, std::optional<torch::Tensor> mins,
                   std::optional<torch::Tensor> bias, int64_t N, bool float_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bfloat16");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), groups = K / GROUP, tiles = (N + TILE - 1) / TILE;
  const int64_t chunk_bytes = (q4 ? 8 : 16) * 32;
  TORCH_CHECK(K % GROUP == 0, "K must be a multiple of 32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.numel() == tiles * groups * chunk_bytes, "packed weights mismatch");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.numel() == tiles * groups * TILE, "scales mismatch");
  TORCH_CHECK(!q4 || (mins && mins->numel() == scales.numel()), "mins mismatch");
  const float* bias_p = nullptr;
  torch::Tensor b;
  if (bias) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "bias mismatch");
    bias_p = b.data_ptr<float>();
  }
  packed = packed.contiguous();
  scales = scales.contiguous();
  torch::Tensor mins_c = q4 ? mins->contiguous() : torch::Tensor();
  auto out = torch::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* op = q4 ? mins_c.data_ptr<at::Half>() : nullptr;
  // each row's sum over each group (the offset term), left to right
  torch::Tensor xsum;
  const float* xs = nullptr;
  if (q4) {
    xsum = torch::empty({M, groups}, x.options().dtype(at::kFloat));
    float* dst = xsum.data_ptr<float>();
    const auto* xb = reinterpret_cast<const c10::BFloat16*>(x.data_ptr());
    at::parallel_for(0, M * groups, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) dst[i] = group_sum(xb + i * GROUP);
    });
    xs = dst;
  }
  // More than two blocks of rows: each tile's weights are unpacked once and reused by every block (measured:
  // up to two blocks, unpacking in each block is faster than storing the unpacked tile and reading it back).
  const bool reuse = M > 2 * MAX_ROWS;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    const uint32_t* xr[MAX_ROWS];
    const float* xsr[MAX_ROWS];
    vfloat y[MAX_ROWS];
    std::vector<vuint> unpacked(reuse ? groups * UNPACKED : 0);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * TILE, n = std::min<int64_t>(TILE, N - n0), off = t * groups;
      if (reuse && q4) unpack_tile<true>(wp + off * chunk_bytes, sp + off * TILE, op + off * TILE, groups, unpacked.data());
      if (reuse && !q4) unpack_tile<false>(wp + off * chunk_bytes, sp + off * TILE, nullptr, groups, unpacked.data());
      const vuint* up = reuse ? unpacked.data() : nullptr;
      // blocks of as equal a size as can be (9 rows: 5 + 4, not 8 + 1, whose one chain of products would
      // wait on each product's latency); a row's operations do not depend on its block
      const int64_t blocks = (M + MAX_ROWS - 1) / MAX_ROWS;
      for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
        const int R = static_cast<int>((M - m0) / (blocks - b));
        const uint8_t* next = b == 0 && t + 1 < t1 ? wp + (off + groups) * chunk_bytes : nullptr;  // once a tile
        for (int r = 0; r < R; ++r) {
          xr[r] = xp + (m0 + r) * (K / 2);
          xsr[r] = xs ? xs + (m0 + r) * groups : nullptr;
        }
        if (q4)
          rows_block<true>(R, xr, xsr, wp + off * chunk_bytes, up, next, sp + off * TILE, op + off * TILE, groups, y);
        else
          rows_block<false>(R, xr, xsr, wp + off * chunk_bytes, up, next, sp + off * TILE, nullptr, groups, y);
        const float* bp = bias_p ? bias_p + n0 : nullptr;
        for (int r = 0; r < R; ++r) {
          if (float_out)
            store(out.data_ptr<float>() + (m0 + r) * N + n0, n, y[r], bp);
          else
            store(reinterpret_cast<c10::BFloat16*>(out.data_ptr()) + (m0 + r) * N + n0, n, y[r], bp);
        }
        m0 += R;
      }
    }
  });
  return out;
}

}  // namespace

// x [M, K] bfloat16 -> [M, N] bfloat16 (float32 with float_out): see the layout above
torch::Tensor q4_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor mins,
                      std::optional<torch::Tensor> bias, int64_t N, bool float_out) {
  return gemm(true, x, packed, scales, mins, bias, N, float_out);
}

torch::Tensor q8_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, std::optional<torch::Tensor> bias,
                      int64_t N, bool float_out) {
  return gemm(false, x, packed, scales, std::nullopt, bias, N, float_out);
}

namespace {

// rows ids of the dequantized weight, float32 [n, K]: the exact values
torch::Tensor rows(bool q4, torch::Tensor packed, torch::Tensor scales, std::optional<torch::Tensor> mins,
                   torch::Tensor ids, int64_t K) {
  const int64_t groups = K / GROUP, chunk_bytes = (q4 ? 8 : 16) * 32;
  ids = ids.to(at::kLong).contiguous();
  packed = packed.contiguous();
  scales = scales.contiguous();
  torch::Tensor mins_c = q4 ? mins->contiguous() : torch::Tensor();
  const int64_t n = ids.numel();
  auto out = torch::empty({n, K}, scales.options().dtype(at::kFloat));
  const int64_t* ip = ids.data_ptr<int64_t>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* op = q4 ? mins_c.data_ptr<at::Half>() : nullptr;
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t row = ip[r], t = row / TILE, j = row % TILE;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* wg = wp + (t * groups + g) * chunk_bytes;
        const float d = static_cast<float>(sp[(t * groups + g) * TILE + j]);
        float* o = dst + r * K + g * GROUP;
        if (q4) {
          const float m = static_cast<float>(op[(t * groups + g) * TILE + j]);
          for (int c = 0; c < 8; ++c)
            for (int i = 0; i < 2; ++i) {
              const uint8_t b = wg[c * 32 + 2 * j + i];
              o[4 * c + i] = static_cast<float>(b & 15) * d + m;  // two roundings, as model/quant.py's
              o[4 * c + 2 + i] = static_cast<float>(b >> 4) * d + m;
            }
        } else {
          for (int c = 0; c < 16; ++c)
            for (int i = 0; i < 2; ++i) o[2 * c + i] = static_cast<int8_t>(wg[c * 32 + 2 * j + i]) * d;
        }
      }
    }
  });
  return out;
}

}  // namespace

torch::Tensor q4_rows(torch::Tensor packed, torch::Tensor scales, torch::Tensor mins, torch::Tensor ids, int64_t K) {
  return rows(true, packed, scales, mins, ids, K);
}

torch::Tensor q8_rows(torch::Tensor packed, torch::Tensor scales, torch::Tensor ids, int64_t K) {
  return rows(false, packed, scales, std::nullopt, ids, K);
}
