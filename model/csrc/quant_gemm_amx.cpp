// The quantized GEMM on AMX's int8 tiles (the amx tier), for GEMMs of many rows: the same integer sums as the
// int16 vector kernel (quant_gemm_i16.cpp), which runs the few rows, so that a row's bits are the same whichever
// of the two multiplies it.
//
// x arrives as quant_gemm_i16.cpp rounds it: per row and 32 activations, integers xq with a step s, |xq| at most
// amx_activation_limit (below). A group's sum sum_k xq_k q_k is exact in int32 either way; how xq is cut into
// bytes depends on q:
//  - narrow q with a minimum (4 or 5 bits, 0 .. 2^bits - 1: Q4_0 .. Q5_K): F q fits a byte for F = 2^(8 - bits),
//    and |xq| < 128 F, so xq = F xh + xl (xh a signed byte, 0 <= xl < F) and the sum is ONE product of a row's
//    [xh | xl] (2G bytes) by [F q ; q]:  sum_k xh_k (F q_k) + sum_k xl_k q_k. A tile product costs the same for
//    32 bytes of K as for 64 (measured ~17 ns either way on an Emerald Rapids Xeon), so the second half is free.
//    x then keeps 11 or 10 bits below its group's largest value (bfloat16 keeps 8 below each value).
//  - Q6_K (10 bits of x only), 8-bit q and the formats' levels (up to 127 in magnitude): xq is int16,
//    xq = 256 xh + xl, two products (high bytes, low ones) into int32, summed as 256 high + low.
// Then, per group and in the same float32 operations in the same order as quant_gemm_i16.cpp, y += d (s sum),
// then + m (s sum_k xq_k) with a minimum. A tile's products pay for 16 rows whatever it holds: at a decode step's
// few rows the vector kernel is ~2x faster, at a prompt's hundreds the tiles.
//
// A: per block of 16 rows of xq and group, tile_rows rows of 2G bytes (one product: a row's high bytes then its
// low ones), or the rows' high bytes, then their low ones ([tile_rows][G] each: two products).
// B: per tile of 16 outputs and group, rows of 64 bytes, each the 16 outputs' q (or F q) for 4 consecutive k
// (AMX's quad layout), unpacked from the packed layout once per step (quant_gemm.cpp).
//
// The tiles are configured once per call and thread (LDTILECFG is per thread, and torch's oneDNN may have
// configured them otherwise in between) and released at the end, so that a thread's context switches do not
// save 8 KiB of tile data.

#include "quant_gemm.h"

#if defined(__AMX_INT8__)

#include "amx.h"

namespace {

static_assert(VL == TILE, "one 16-lane vector per tile");

// GCC 12's own TILELOADD intrinsic tells the compiler that it reads no memory at all, so it may drop or delay
// the stores it reads. These two say what they read.
#define TILE_LOAD_T1(tmm, base, stride) \
  asm volatile("tileloaddt1 (%0,%1,1), %%tmm" #tmm : : "r"(base), "r"(static_cast<long>(stride)) : "memory")
#define TILE_LOAD(tmm, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #tmm : : "r"(base), "r"(static_cast<long>(stride)) : "memory")

// The tile registers: C in one of two sets by the group's parity, so that the next group's products run on the
// tiles while this one's sums are scaled on vectors; A and B. One product a group: C0, C1 (the parities), A (a
// row's [xh | xl]), B; two: C0H, C0L, C1H, C1L, AH, AL, B.
enum Tile { C0H, C0L, C1H, C1L, AH, AL, B };

inline __m512i widen_words(const uint8_t* p) {  // 16 words -> the low halves of 16 dwords
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int BITS, int G, bool MIN>
struct AmxKernel {
  static constexpr bool NIB = BITS < 8;
  static constexpr int HB = NIB ? BITS - 4 : 0;  // high bits above the nibble
  static constexpr bool LEVELS = NIB && !MIN;     // q indexes the format's levels (signed), as 8-bit q is
  static constexpr bool ONE = MIN && BITS <= 5;   // one product a group (narrow unsigned q), else two
  static constexpr int SHIFT = 8 - BITS;          // F = 2^SHIFT (one product)
  static constexpr int QUADS = G / 4;             // B's rows of a group's q
  static constexpr int B_ROWS = ONE ? 2 * QUADS : QUADS;
  static constexpr int64_t GROUP_BYTES = TILE * G * BITS / 8;

  // Blocks of 16 rows (A's), two tiles a step, unpacked once a step for all its blocks
  static constexpr int MAX_ROWS = TILE, MAX_TILES = 2;
  Plan plan(int64_t) const { return {TILE, MAX_TILES, true, true}; }
  using Unpacked = __m512i;
  static constexpr int UNPACKED = B_ROWS + 2;  // per group: B's rows, then d and m (float32)

  const Packed& w;
  const uint8_t* a;     // [blocks, groups, 2 tile_rows G bytes]: A (the header says how)
  const float* step;    // [M, K / 32] s of each row's 32, 0 in the last block's rows past M
  const float* xsum;    // [M, K / G] s sum_k xq_k of each row's group (with a minimum), the same
  int tile_rows;        // A's and C's rows: 16, or M where fewer
  int64_t group_a() const { return 2 * tile_rows * G; }  // bytes of one group's A

  struct ThreadScope {
    explicit ThreadScope(int rows) {
      TileConfig config;
      for (int t : {C0H, C0L, C1H, C1L}) config.rows[t] = rows, config.colsb[t] = TILE * sizeof(int32_t);
      for (int t : {AH, AL}) config.rows[t] = rows, config.colsb[t] = ONE ? 2 * G : G;
      config.rows[B] = B_ROWS, config.colsb[B] = TILE * 4;
      load_tile_config(config);
    }
    ~ThreadScope() { _tile_release(); }
    ThreadScope(const ThreadScope&) = delete;
  };
  ThreadScope thread_scope() const { return ThreadScope(tile_rows); }

  // Row c of a group's B: lane j's q[4c] .. q[4c + 3], a byte each (the packed layout: quant_gemm.cpp)
  static __m512i quads(const uint8_t* wg, int c, const int8_t* levels) {
    if constexpr (!NIB) {  // chunks 2c and 2c + 1: lane j's word (q[4c], q[4c + 1]), then (q[4c + 2], q[4c + 3])
      return _mm512_or_si512(widen_words(wg + 2 * c * 32), _mm512_slli_epi32(widen_words(wg + (2 * c + 1) * 32), 16));
    } else {
      // lane j: bytes 2j, 2j + 1 of chunk c at bits 0 and 16, then q[4c] | q[4c + 1] << 16 (low) and
      // q[4c + 2] | q[4c + 3] << 16 (high), the high bits added as quant_gemm.h says
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + c * 32)));
      const __m512i nibble = _mm512_set1_epi32(0x000F000F);
      vuint low = bitcast<vuint>(_mm512_and_si512(v, nibble));
      vuint high = bitcast<vuint>(_mm512_and_si512(_mm512_srli_epi32(v, 4), nibble));
      if constexpr (HB > 0) {
        const uint8_t* row = wg + nibble_bytes(G) + high_row(HB, c) * TILE;
        const vuint h = bitcast<vuint>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
        add_high<HB>(h >> high_shift(HB, c), low, high);
      }
      // bytes q[4c], q[4c + 2], q[4c + 1], q[4c + 3] (each q < 64), then in k's order
      const __m512i mixed = bitcast<__m512i>(low | (high << 8));
      const __m512i order = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15));
      __m512i q = _mm512_shuffle_epi8(mixed, order);
      if constexpr (LEVELS)  // the levels in each 128-bit lane: vpshufb looks a byte up within its lane
        q = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(levels))), q);
      return q;
    }
  }

  void unpack(int64_t t, __m512i* out) const {
    const uint8_t* wt = w.tile(t);
    for (int64_t g = 0; g < w.groups(); ++g) {
      __m512i* o = out + g * UNPACKED;
      for (int c = 0; c < QUADS; ++c) {
        const __m512i q = quads(wt + g * GROUP_BYTES, c, w.levels);
        if constexpr (ONE) {  // F q (each byte's shift keeps within it: F q < 256), then q
          o[c] = _mm512_and_si512(_mm512_slli_epi16(q, SHIFT), _mm512_set1_epi8(static_cast<char>(0xFF << SHIFT)));
          o[QUADS + c] = q;
        } else {
          o[c] = q;
        }
      }
      vfloat d, m;
      w.group_scales(t, g, 0, d, m);
      o[B_ROWS] = bitcast<__m512i>(d);
      o[B_ROWS + 1] = bitcast<__m512i>(m);
    }
  }

  // One group's products into C set P (tiles 0, 1 or 2, 3), C = A B from zero. q's sign picks the instruction:
  // A's high bytes are signed, its low ones unsigned (one product: below F, as signed too); q is unsigned with a
  // minimum, else signed. (GCC's tile intrinsics take the registers' numbers as literals.)
  template <int P>
  void products(const uint8_t* ag, const __m512i* b) const {
    static_assert(C0H == 0 && C0L == 1 && C1H == 2 && C1L == 3 && AH == 4 && AL == 5 && B == 6);
    TILE_LOAD(6, b, TILE * 4);
    TILE_LOAD(4, ag, ONE ? 2 * G : G);
    if constexpr (ONE) {
      if constexpr (P == 0) {
        _tile_zero(0);
        _tile_dpbsud(0, 4, 6);
      } else {
        _tile_zero(2);
        _tile_dpbsud(2, 4, 6);
      }
    } else {
      TILE_LOAD(5, ag + tile_rows * G, G);
      if constexpr (P == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbusd(1, 5, 6);
      } else {
        _tile_zero(2);
        _tile_zero(3);
        _tile_dpbssd(2, 4, 6);
        _tile_dpbusd(3, 5, 6);
      }
    }
  }
  template <int P>
  static void store(int32_t (*c)[TILE * TILE]) {
    constexpr long stride = TILE * sizeof(int32_t);
    if constexpr (P == 0) {
      _tile_stored(0, c[0], stride);
      if constexpr (!ONE) _tile_stored(1, c[1], stride);
    } else {
      _tile_stored(2, c[0], stride);
      if constexpr (!ONE) _tile_stored(3, c[1], stride);
    }
  }

  // A group's stored sums into the rows' accumulators: y += d (s sum) (+ m s sum_k xq_k), in the float32
  // operations and order of quant_gemm_i16.cpp's lanes. All 16 rows: past M, s and the sums of x are 0.
  [[gnu::always_inline]] void scale(const int32_t (*c)[TILE * TILE], const __m512i* ug, const float* s, const float* xs,
                                    __m512 (&y)[TILE]) const {
    const int64_t steps = w.K / GROUP, groups = w.groups();
    const __m512 d = _mm512_castsi512_ps(ug[B_ROWS]), m = _mm512_castsi512_ps(ug[B_ROWS + 1]);
#pragma GCC unroll 16
    for (int r = 0; r < TILE; ++r) {
      __m512i total = _mm512_load_si512(c[0] + r * TILE);
      if constexpr (!ONE) total = _mm512_add_epi32(_mm512_slli_epi32(total, 8), _mm512_load_si512(c[1] + r * TILE));
      y[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(s[r * steps])), d, y[r]);
      if constexpr (MIN) y[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * groups]), y[r]);
    }
  }

  // Rows m0 .. m0 + R - 1 (one block: m0 a multiple of 16) of tiles t .. t + nt - 1 into y ([R][nt * 16]): a
  // tile at a time, its 16 rows' sums in registers; each group's products issued one group ahead of its store
  // and two ahead of its scaling, so the tiles and the vectors work side by side
  void rows(int R, int nt, int64_t, int64_t m0, const __m512i* unpacked, const uint8_t* next, float* y) const {
    const int64_t groups = w.groups(), steps = w.K / GROUP, per_tile = groups * UNPACKED;
    const uint8_t* ab = a + m0 / TILE * groups * group_a();
    const int width = nt * TILE;
    alignas(64) int32_t c[4][2][TILE * TILE];  // four groups' stored sums: a group's are read two groups on
    const float* s0 = step + m0 * steps;
    const float* x0 = MIN ? xsum + m0 * groups : nullptr;
    for (int j = 0; j < nt; ++j) {
      const __m512i* u = unpacked + j * per_tile;
      __m512 acc[TILE];
#pragma GCC unroll 16
      for (int r = 0; r < TILE; ++r) acc[r] = _mm512_setzero_ps();
      const auto scaled = [&](int64_t g) [[gnu::always_inline]] {
        scale(c[g % 4], u + g * UNPACKED, s0 + g * G / GROUP, MIN ? x0 + g : nullptr, acc);
      };
      products<0>(ab, u);
      for (int64_t g = 0; g < groups; g += 2) {
        if (next && j == 0) fetch(next, nt, g);
        if (g + 1 < groups) products<1>(ab + (g + 1) * group_a(), u + (g + 1) * UNPACKED);
        store<0>(c[g % 4]);
        if (g >= 2) scaled(g - 2);
        if (g + 1 < groups) {
          if (next && j == 0) fetch(next, nt, g + 1);
          if (g + 2 < groups) products<0>(ab + (g + 2) * group_a(), u + (g + 2) * UNPACKED);
          store<1>(c[(g + 1) % 4]);
          if (g >= 1) scaled(g - 1);
        }
      }
      for (int64_t g = std::max<int64_t>(groups - 2, 0); g < groups; ++g) scaled(g);
#pragma GCC unroll 16
      for (int r = 0; r < TILE; ++r)
        if (r < R) _mm512_storeu_ps(y + r * width + j * TILE, acc[r]);
    }
  }

  // Group g of the next step's tiles, asked for ahead into L2: see quant_gemm_bf16.cpp
  void fetch(const uint8_t* next, int nt, int64_t g) const {
    for (int i = 0; i < nt; ++i)
      for (int64_t o = 0; o < GROUP_BYTES; o += 64) prefetch_l2(next + (i * w.groups() + g) * GROUP_BYTES + o);
  }
};

// A prompt's rows on bfloat16 tiles (gemm_amx_bf16): the weights dequantized, w = d q (+ m) in float32 and
// rounded to bfloat16, a step's tiles at a time, then multiplied as oneDNN multiplies dense bfloat16 weights,
// summed in float32 inside the C tiles across the whole of K. No per-group scaling on vectors (what bounds the
// integer tiles above: docs/performance-history.md); the unpacking's vector work is paid once per step for all
// of its rows. A row's bits depend only on its own x and the weights: every C row is its A row times B, over
// the same K steps in the same order, whatever the rows beside it.
//
// A: x in bfloat16, rows of K, padded with zero rows to whole blocks of 32 (read as tiles of 16 rows straight
// from it). B: per tile of 16 outputs and 32 of K, 16 rows of 64 bytes, row r lane j the outputs j's weights
// k = 2r, 2r + 1 (AMX's pair layout), unpacked for all of K (K / 2 vectors a tile: 36 KiB a step at K = 576).
// C: four tiles, two blocks of 16 rows times two tiles of 16 outputs (a 2 x 2 pattern, as oneDNN's).
#if defined(__AMX_BF16__)

enum Bf16Tile { C00, C01, C10, C11, A0, A1, B0, B1 };

template <int BITS, int G, bool MIN>
struct AmxBf16Kernel {
  using Quads = AmxKernel<BITS, G, MIN>;
  static constexpr int QUADS = G / 4;

  static constexpr int UNPACKED = G / 2;  // B's rows of a group: a pair of k each

  const Packed& w;
  const c10::BFloat16* x;  // [blocks of 32 rows, K]

  struct ThreadScope {
    ThreadScope() {
      TileConfig config;
      for (int t = C00; t <= B1; ++t) config.rows[t] = TILE, config.colsb[t] = 64;
      load_tile_config(config);
    }
    ~ThreadScope() { _tile_release(); }
    ThreadScope(const ThreadScope&) = delete;
  };

  // Byte i of each lane as float32: q unsigned with a minimum, else signed (8-bit q, the formats' levels)
  template <int I>
  static __m512 byte_of(__m512i v) {
    if constexpr (MIN) return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * I), _mm512_set1_epi32(255)));
    return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * I), 24));
  }

  // Two k's 16 weights as one B row: lane j (w0[j], w1[j]) in bfloat16, rounded to nearest even
  static __m512i pair(__m512 w0, __m512 w1) {
    const __m512i halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w1, w0));  // w0's 16, then w1's
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                                6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, halves);
  }

  // One B row from 32 int16 q already in its order (lane j's two k at words 2j, 2j + 1): d q + m, where d2 and
  // m2 hold each lane's d and m twice (lanes 0 .. 7 in [0], 8 .. 15 in [1])
  static __m512i pair_row(__m512i q, const __m512 (&d2)[2], const __m512 (&m2)[2]) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(q, 1)));
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, d2[1], m2[1]), _mm512_fmadd_ps(lo, d2[0], m2[0])));
  }

  // w = d q + m in float32 (one rounding, as an FMA), then bfloat16: a group's B rows. The 4- and 8-bit layouts
  // hold a lane's k in pairs already (4-bit chunk c: lane j's word 2j + i has q[4c + i] in its low nibble and
  // q[4c + 2 + i] in its high one; 8-bit chunk c: byte 2j + i is q[2c + i]); the 5- and 6-bit ones by quads.
  void unpack(int64_t t, __m512i* out) const {
    const uint8_t* wt = w.tile(t);
    const __m512i lanes_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i lanes_hi = _mm512_add_epi32(lanes_lo, _mm512_set1_epi32(8));
    const __m512i levels = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.levels))));
    for (int64_t g = 0; g < w.groups(); ++g) {
      vfloat dv, mv;
      w.group_scales(t, g, 0, dv, mv);
      const __m512 d = bitcast<__m512>(dv), m = bitcast<__m512>(mv);
      const uint8_t* wg = wt + g * Quads::GROUP_BYTES;
      __m512i* o = out + g * UNPACKED;
      if constexpr (BITS == 4 || BITS == 8) {
        const __m512 d2[2] = {_mm512_permutexvar_ps(lanes_lo, d), _mm512_permutexvar_ps(lanes_hi, d)};
        const __m512 m2[2] = {_mm512_permutexvar_ps(lanes_lo, m), _mm512_permutexvar_ps(lanes_hi, m)};
        for (int c = 0; c < G / (BITS == 4 ? 4 : 2); ++c) {
          const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + c * 32));
          if constexpr (BITS == 8) {
            o[c] = pair_row(_mm512_cvtepi8_epi16(bytes), d2, m2);
          } else {
            const __m512i v = _mm512_cvtepu8_epi16(bytes), nibble = _mm512_set1_epi16(15);
            __m512i q0 = _mm512_and_si512(v, nibble), q1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            if constexpr (!MIN) {  // q indexes the format's levels
              q0 = _mm512_permutexvar_epi16(q0, levels);
              q1 = _mm512_permutexvar_epi16(q1, levels);
            }
            o[2 * c] = pair_row(q0, d2, m2);
            o[2 * c + 1] = pair_row(q1, d2, m2);
          }
        }
      } else {
        for (int c = 0; c < QUADS; ++c) {
          const __m512i q = Quads::quads(wg, c, w.levels);
          o[2 * c] = pair(_mm512_fmadd_ps(byte_of<0>(q), d, m), _mm512_fmadd_ps(byte_of<1>(q), d, m));
          o[2 * c + 1] = pair(_mm512_fmadd_ps(byte_of<2>(q), d, m), _mm512_fmadd_ps(byte_of<3>(q), d, m));
        }
      }
    }
  }

  // The GEMM: steps of two tiles in parallel; in each, the tiles unpacked once, then every block of 32 rows
  void run(int64_t M, const Output& out) const {
    const int64_t tiles = w.tiles(), steps = (tiles + 1) / 2, per_tile = w.groups() * UNPACKED;
    at::parallel_for(0, steps, 1, [&](int64_t s0, int64_t s1) {
      const ThreadScope scope;
      std::vector<__m512i> unpacked(2 * per_tile);
      alignas(64) float y[2 * TILE * 2 * TILE];
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t t = 2 * s, n0 = t * TILE;
        const bool two = t + 1 < tiles;
        unpack(t, unpacked.data());
        if (two) unpack(t + 1, unpacked.data() + per_tile);
        const int64_t n = std::min<int64_t>((two ? 2 : 1) * TILE, w.N - n0);
        for (int64_t m0 = 0; m0 < M; m0 += 2 * TILE) {
          const int rows = static_cast<int>(std::min<int64_t>(2 * TILE, M - m0));
          if (rows > TILE)
            two ? block<true, true>(m0, unpacked.data(), y) : block<true, false>(m0, unpacked.data(), y);
          else
            two ? block<false, true>(m0, unpacked.data(), y) : block<false, false>(m0, unpacked.data(), y);
          store(out, m0, rows, n0, n, two ? 2 * TILE : TILE, y);
        }
      }
    });
  }

  // C = A B over all of K for rows m0 .. m0 + 31 (or 15) and one tile's outputs (or two) into y [32][width]
  template <bool TWO_BLOCKS, bool TWO_TILES>
  void block(int64_t m0, const __m512i* unpacked, float* y) const {
    static_assert(C00 == 0 && C01 == 1 && C10 == 2 && C11 == 3 && A0 == 4 && A1 == 5 && B0 == 6 && B1 == 7);
    const int64_t K = w.K, a_stride = K * 2, per_tile = w.groups() * UNPACKED;
    const auto* a = reinterpret_cast<const uint8_t*>(x + m0 * K);
    const __m512i* b = unpacked;
    _tile_zero(0);
    if constexpr (TWO_TILES) _tile_zero(1);
    if constexpr (TWO_BLOCKS) _tile_zero(2);
    if constexpr (TWO_BLOCKS && TWO_TILES) _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32, b += TILE) {  // 32 of K a product: 16 rows of pairs
      TILE_LOAD(4, a + 2 * k, a_stride);
      TILE_LOAD_T1(6, b, 64);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (TWO_TILES) {
        TILE_LOAD_T1(7, b + per_tile, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if constexpr (TWO_BLOCKS) {
        TILE_LOAD(5, a + TILE * a_stride + 2 * k, a_stride);
        _tile_dpbf16ps(2, 5, 6);
        if constexpr (TWO_TILES) _tile_dpbf16ps(3, 5, 7);
      }
    }
    const int width = TWO_TILES ? 2 * TILE : TILE;
    const long stride = width * sizeof(float);
    _tile_stored(0, y, stride);
    if constexpr (TWO_TILES) _tile_stored(1, y + TILE, stride);
    if constexpr (TWO_BLOCKS) _tile_stored(2, y + TILE * width, stride);
    if constexpr (TWO_BLOCKS && TWO_TILES) _tile_stored(3, y + TILE * width + TILE, stride);
  }

  // y's rows (+ bias) into the output, columns n0 .. n0 + n - 1; bfloat16 by VCVTNEPS2BF16 (nearest even)
  void store(const Output& out, int64_t m0, int rows, int64_t n0, int64_t n, int width, const float* y) const {
    for (int r = 0; r < rows; ++r)
      for (int64_t l = 0; l < n; l += TILE) {
        const __mmask16 lanes = n - l >= TILE ? 0xFFFF : static_cast<__mmask16>((1u << (n - l)) - 1);
        __m512 v = _mm512_load_ps(y + r * width + l);
        if (w.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, w.bias + n0 + l));
        const int64_t at = (m0 + r) * out.ld + n0 + l;
        if (out.f32)
          _mm512_mask_storeu_ps(out.f32 + at, lanes, v);
        else
          _mm256_mask_storeu_epi16(out.bf16 + at, lanes, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
      }
  }
};

#endif  // __AMX_BF16__

}  // namespace

#if defined(__AMX_BF16__)
void gemm_amx_bf16(const Packed& w, const c10::BFloat16* x, int64_t M, const Output& out) {
  require_tiles();
  dispatch(w, [&](auto bits, auto g, auto min) { AmxBf16Kernel<bits(), g(), min()>{w, x}.run(M, out); });
}
#endif

void gemm_amx(const Packed& w, const int16_t* xq, const float* step, const float* xsum, int64_t M,
              const Output& out) {
  require_tiles();
  const int tile_rows = static_cast<int>(std::min<int64_t>(M, TILE));
  const int64_t blocks = (M + TILE - 1) / TILE, K = w.K, per_block = 2 * tile_rows * K;  // bytes of a block's A
  // A's tiles in the calling thread's buffer, kept at its largest size (a 512-row x's are 2 MB for K = 2048)
  thread_local std::vector<__m512i> buffer;
  const size_t vectors = (blocks * per_block + 63) / 64;
  if (buffer.size() < vectors) buffer.resize(vectors);
  auto* a = reinterpret_cast<uint8_t*>(buffer.data());  // a pointer: in the region a thread_local is a worker's
  dispatch(w, [&](auto bits, auto g, auto min) {
    constexpr int G = g();
    using Kernel = AmxKernel<bits(), G, min()>;
    const int64_t groups = K / G;
    at::parallel_for(0, blocks, blocks > 1 ? 1 : blocks + 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t gi = 0; gi < groups; ++gi)
          for (int r = 0; r < tile_rows; ++r) {
            // one product: row r's 2G bytes, xh then xl; two: row r's G high bytes, then (a tile on) its low ones
            uint8_t* high = a + b * per_block + gi * 2 * tile_rows * G + r * (Kernel::ONE ? 2 * G : G);
            uint8_t* low = high + (Kernel::ONE ? G : tile_rows * G);
            const int64_t row = b * TILE + r;
            if (row >= M) {  // the last block's rows past x: zeros, whose sums nobody reads
              std::memset(high, 0, G);
              std::memset(low, 0, G);
              continue;
            }
            const int16_t* src = xq + row * K + gi * G;
            for (int k = 0; k < G; k += 16) {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k));
              __m256i h, l;
              if constexpr (Kernel::ONE) {  // xq = F xh + xl, 0 <= xl < F
                h = _mm256_srai_epi16(v, Kernel::SHIFT);
                l = _mm256_and_si256(v, _mm256_set1_epi16((1 << Kernel::SHIFT) - 1));
              } else {
                h = _mm256_srai_epi16(v, 8);
                l = v;
              }
              _mm_storeu_si128(reinterpret_cast<__m128i*>(high + k), _mm256_cvtepi16_epi8(h));
              _mm_storeu_si128(reinterpret_cast<__m128i*>(low + k), _mm256_cvtepi16_epi8(l));
            }
          }
    });
    run_tiles(Kernel{w, a, step, xsum, tile_rows}, w, M, out);
  });
}

#endif
