// The quantized GEMM on CPUs with AMX (the amx tier): each group's products on tiles.
//
// A group of G weights along K is one tile product: A = 16 rows of x (the group's G bfloat16), B = the group's
// exact integers as bfloat16 pairs for a tile of 16 outputs (the unpacked form quant_gemm_bf16.h makes: vector
// v holds the 16 lanes' weights k = 2v, 2v + 1, which is AMX's pair layout as it is), C = the 16 x 16 sums
// sum_k x_k q_k, from zero. C goes to memory and each row of it is scaled as the AVX-512 kernel scales its
// group sums: y += C d, then y += offset * sum_k x_k (128 + q and IQ4's levels as there). float32 activations
// (the tier's) are multiplied as two bfloat16 parts into the same C (a_tiles).
//
// TDPBF16PS sums a group's products in its own order and width (not float32 one product at a time: measured,
// neither VDPBF16PS's order nor any float32 sequence gives its bits), so this tier runs every batch size on
// tiles, a single row too: a row's bits depend only on its own x, never on the rows beside it in a tile, so a
// token's output has the same bits alone or in any batch, as on every tier.
//
// The tiles are configured once per call and thread (LDTILECFG is per thread, and torch's oneDNN may have
// configured them otherwise in between) and released at the end, so that a thread's context switches do not
// save 8 KiB of tile data.

#include "quant_gemm_bf16.h"

#if defined(__AMX_BF16__)

#include <sys/syscall.h>
#include <unistd.h>

namespace {

using namespace bf16_groups;

// LDTILECFG's 64 bytes, palette 1: per tile register its rows and bytes a row
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC 12's own LDTILECFG and TILELOADD intrinsics tell the compiler that the first reads 8 of its 64 bytes and
// the second no memory at all, so it may drop or delay the stores they read (seen: a configuration half
// written, then #UD at the first tile load). These two say what they read.
inline void load_tile_config(const TileConfig& config) { asm volatile("ldtilecfg %0" : : "m"(config)); }
#define TILE_LOAD(tmm, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #tmm : : "r"(base), "r"(static_cast<long>(stride)) : "memory")

// The tile registers: a group's products for two blocks of 16 rows (A) by two tiles of 16 outputs (B), each
// block and tile's sums in its own C. One A tile then serves two products and one B tile two: read from L2,
// a block's A and a tile's B for every product, the tile loads held each group's products to ~60 ns (16 x 16
// x 32; 1 thread), twice this way's
enum Tile { C00, C01, C10, C11, A0, A1, B0, B1 };

// Linux hands out the tile state (8 KiB per thread) only to a process that asks (arch_prctl
// ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); model/cpu_tier.py asks before choosing this tier, and this asks
// again for a module loaded without it. Once per process, for all its threads.
void require_tiles() {
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  TORCH_CHECK(granted, "the kernel refused this process AMX's tile state: run another CPU tier");
}

template <int BITS, int G, bool MIN>
struct AmxKernel {
  static constexpr int VECS = G / 2;  // pair vectors (B's rows) per group
  static constexpr int64_t GROUP_BYTES = TILE * G * BITS / 8;

  // a block of rows is two A tiles (32 rows), a step two tiles of outputs; the step's tiles are unpacked once
  // where more than one block reads them, else each group into scratch as it comes (it stays in L1)
  static constexpr int MAX_ROWS = 2 * TILE, MAX_TILES = 2;
  Plan plan(int64_t M) const {
    if (M <= TILE) return {TILE, 1, false, true};  // one block: one tile a step, its sums in registers
    return {MAX_ROWS, MAX_TILES, M > MAX_ROWS, true};
  }
  using Unpacked = vuint;
  static constexpr int UNPACKED = VECS + 2;  // per group: its pair vectors, then d and the offset (float32)

  const Packed& w;
  const c10::BFloat16* x;  // x's A tiles: [blocks of 16 rows, K / G, parts, tile_rows, G] (a_tiles)
  const float* xsum;       // [M, K / G]: the sums of x's parts (with a minimum)
  int64_t M;
  int tile_rows;  // A's and C's rows: 16, or M where fewer
  int parts;      // 1 (bfloat16 x), or 2 (float32 x: high and low bfloat16 parts)
  int64_t group_tiles() const { return parts * tile_rows * G; }  // bfloat16 of one group's A tiles

  // Per thread, for the loop's duration (run_tiles): the tile configuration, then its release
  struct ThreadScope {
    explicit ThreadScope(int rows) {
      TileConfig config;
      for (int t : {C00, C01, C10, C11}) config.rows[t] = rows, config.colsb[t] = TILE * sizeof(float);
      for (int t : {A0, A1}) config.rows[t] = rows, config.colsb[t] = G * sizeof(c10::BFloat16);
      for (int t : {B0, B1}) config.rows[t] = VECS, config.colsb[t] = TILE * sizeof(uint32_t);
      load_tile_config(config);
    }
    ~ThreadScope() { _tile_release(); }
    ThreadScope(const ThreadScope&) = delete;
  };
  ThreadScope thread_scope() const { return ThreadScope(tile_rows); }

  void unpack(int64_t t, vuint* out) const {
    for (int64_t g = 0; g < w.groups(); ++g) unpack_group<BITS, G, MIN>(w, t, g, out + g * UNPACKED);
  }

  // One group's products, C = A B from zero, for `blocks` A tiles (a: the first's; the second follows) by
  // `tiles` B tiles (b), stored into c[block][tile] (16 rows of 16 float32 each). GCC's tile intrinsics take
  // their registers as literals (they are pasted into the assembly).
  // x's parts (float32 x) add into the same C, the high part's products first.
  void products(int blocks, int tiles, const c10::BFloat16* a0, const c10::BFloat16* a1, const vuint* b0,
                const vuint* b1, float (*c)[2][TILE * TILE]) const {
    constexpr long a_stride = G * sizeof(c10::BFloat16), b_stride = TILE * sizeof(uint32_t);
    constexpr long c_stride = TILE * sizeof(float);
    static_assert(C00 == 0 && C01 == 1 && C10 == 2 && C11 == 3 && A0 == 4 && A1 == 5 && B0 == 6 && B1 == 7);
    TILE_LOAD(6, b0, b_stride);
    if (tiles > 1) TILE_LOAD(7, b1, b_stride);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int part = 0; part < parts; ++part) {
      const int64_t at = part * tile_rows * G;
      TILE_LOAD(4, a0 + at, a_stride);
      _tile_dpbf16ps(0, 4, 6);
      if (tiles > 1) _tile_dpbf16ps(1, 4, 7);
      if (blocks > 1) {
        TILE_LOAD(5, a1 + at, a_stride);
        _tile_dpbf16ps(2, 5, 6);
        if (tiles > 1) _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c[0][0], c_stride);
    if (tiles > 1) _tile_stored(1, c[0][1], c_stride);
    if (blocks > 1) {
      _tile_stored(2, c[1][0], c_stride);
      if (tiles > 1) _tile_stored(3, c[1][1], c_stride);
    }
  }

  // Rows m0 .. m0 + R - 1 (R <= 32) of tiles t .. t + nt - 1 (nt <= 2) into out ([R][nt * 16]): blocks m0 / 16
  // and the next, whose A tiles hold tile_rows rows of x from their `first` (a_tiles), the block's rows among
  // them. The sums accumulate in `out`, in L1: the four tiles' 64 vectors are twice the registers there are.
  //
  // Unpacked as it goes, a group is unpacked UNPACK_AHEAD groups before its products: a tile load of B right
  // after the vector stores that wrote it waited for them (1 row: 43 ns a group, 17 with the unpack three
  // groups earlier, in isolation).
  static constexpr int UNPACK_AHEAD = 6, RING = 8;

  // Group g of tiles t .. t + nt - 1, UNPACK_AHEAD groups ahead of its products: asked for from L2 a step ahead
  // (next), and unpacked into scratch[g % RING] unless the step's tiles were unpacked once
  void unpack_ahead(int64_t g, int64_t t, int nt, const vuint* unpacked, const uint8_t* next,
                    vuint (*scratch)[MAX_TILES][UNPACKED]) const {
    const int64_t groups = w.groups();
    if (g >= groups) return;
    for (int j = 0; j < nt; ++j) {
      if (next)
        for (int64_t i = 0; i < GROUP_BYTES; i += 64) prefetch_l2(next + (j * groups + g) * GROUP_BYTES + i);
      if (!unpacked) unpack_group<BITS, G, MIN>(w, t + j, g, scratch[g % RING][j]);
    }
  }

  void rows(int R, int nt, int64_t t, int64_t m0, const vuint* unpacked, const uint8_t* next, float* out) const {
    if (R <= TILE && nt == 1) {
      switch (R) {
#define ROWS(n) \
  case n: return rows_in_registers<n>(t, m0, unpacked, next, out);
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
        ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
#undef ROWS
      }
    }
    const int64_t groups = w.groups();
    const int blocks = R > TILE ? 2 : 1;
    const int64_t block = m0 / TILE;
    int rows_of[2], skip[2];  // per block: its rows of this call, and where they start in its A tiles
    for (int i = 0; i < blocks; ++i) {
      const int64_t row = m0 + i * TILE, first = std::min<int64_t>(row, M - tile_rows);
      rows_of[i] = static_cast<int>(std::min<int64_t>(TILE, m0 + R - row));
      skip[i] = static_cast<int>(row - first);
    }
    const c10::BFloat16* a = x + block * groups * group_tiles();
    const int64_t a_block = groups * group_tiles();  // from one block's A tiles to the next's
    const int64_t per_tile = groups * UNPACKED;
    alignas(64) vuint scratch[unpacked ? 1 : RING][MAX_TILES][UNPACKED];
    alignas(64) float c[2][2][TILE * TILE];
    auto group = [&](int64_t g, int j) {  // group g's unpacked vectors of the step's tile j
      return unpacked ? unpacked + j * per_tile + g * UNPACKED : scratch[g % RING][j];
    };
    const int width = nt * TILE;
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < width; l += VL) store_floats(vfloat{}, out + r * width + l);
    for (int64_t g = 0; g < UNPACK_AHEAD; ++g) unpack_ahead(g, t, nt, unpacked, next, scratch);
    for (int64_t g = 0; g < groups; ++g) {
      unpack_ahead(g + UNPACK_AHEAD, t, nt, unpacked, next, scratch);
      products(blocks, nt, a + g * group_tiles(), a + a_block + g * group_tiles(), group(g, 0), group(g, 1), c);
      for (int j = 0; j < nt; ++j) {
        const vuint* u = group(g, j);
        const vfloat d = bitcast<vfloat>(u[VECS]), offset = bitcast<vfloat>(u[VECS + 1]);
        for (int i = 0; i < blocks; ++i) {
          const float* cg = c[i][j] + skip[i] * TILE;
          float* y = out + i * TILE * width + j * TILE;
          const float* xs = xsum + (m0 + i * TILE) * groups + g;
          for (int r = 0; r < rows_of[i]; ++r) {
            vfloat v = load_floats(y + r * width) + load_floats(cg + r * TILE) * d;
            if constexpr (MIN) v += offset * xs[r * groups];
            store_floats(v, y + r * width);
          }
        }
      }
    }
  }

  // One group's products on C tile I, its A and B on the pair I % 2 (A0, B0 or A1, B1), x's parts into the
  // same C; and C tile I's store into c
  template <int I>
  void multiply(const c10::BFloat16* a, const vuint* b) const {
    constexpr long a_stride = G * sizeof(c10::BFloat16), b_stride = TILE * sizeof(uint32_t);
#define MULTIPLY(C, A, B)                                       \
  TILE_LOAD(B, b, b_stride);                                    \
  _tile_zero(C);                                                \
  for (int part = 0; part < parts; ++part) {                    \
    TILE_LOAD(A, a + part * tile_rows * G, a_stride);           \
    _tile_dpbf16ps(C, A, B);                                    \
  }
    static_assert(C00 == 0 && C11 == 3 && A0 == 4 && A1 == 5 && B0 == 6 && B1 == 7);
    if constexpr (I == 0) {
      MULTIPLY(0, 4, 6)
    } else if constexpr (I == 1) {
      MULTIPLY(1, 5, 7)
    } else if constexpr (I == 2) {
      MULTIPLY(2, 4, 6)
    } else {
      MULTIPLY(3, 5, 7)
    }
#undef MULTIPLY
  }
  template <int I>
  static void store(float* c) {
    constexpr long c_stride = TILE * sizeof(float);
    if constexpr (I == 0)
      _tile_stored(0, c, c_stride);
    else if constexpr (I == 1)
      _tile_stored(1, c, c_stride);
    else if constexpr (I == 2)
      _tile_stored(2, c, c_stride);
    else
      _tile_stored(3, c, c_stride);
  }

  // The same sums for one block of R <= 16 rows and one tile, in registers: a decode step's few rows, where
  // the stores and loads of sums in L1 cost more than the tiles they would spare (1 row, 4096 x 2048: 0.43 ms
  // this way, 0.53 through L1). The four C tiles take turns: a group's products are issued two groups before
  // its sums are scaled and stored one before, so that no tile op waits on the last one's product (one C
  // tile for every group: each group waited out a product's latency and its store's)
  template <int R>
  void rows_in_registers(int64_t t, int64_t m0, const vuint* unpacked, const uint8_t* next, float* out) const {
    const int64_t groups = w.groups();
    const int64_t skip = m0 - std::min<int64_t>(m0, M - tile_rows);
    const c10::BFloat16* a = x + m0 / TILE * groups * group_tiles();
    alignas(64) vuint scratch[unpacked ? 1 : RING][MAX_TILES][UNPACKED];
    alignas(64) float c[4][TILE * TILE];
    auto group = [&](int64_t g) { return unpacked ? unpacked + g * UNPACKED : scratch[g % RING][0]; };
    // iteration g (on C tile g % 4): group g + 2's products, group g + 1's store
    auto stages = [&](auto i, int64_t g) {
      constexpr int I = decltype(i)::value;
      if (g + 2 < groups) multiply<(I + 2) % 4>(a + (g + 2) * group_tiles(), group(g + 2));
      if (g + 1 < groups) store<(I + 1) % 4>(c[(g + 1) % 4]);
    };
    vfloat y[R];  // local, so that the compiler keeps it in registers
    for (int r = 0; r < R; ++r) y[r] = vfloat{};
    for (int64_t g = 0; g < UNPACK_AHEAD; ++g) unpack_ahead(g, t, 1, unpacked, next, scratch);
    multiply<0>(a, group(0));
    if (groups > 1) multiply<1>(a + group_tiles(), group(1));
    store<0>(c[0]);
    for (int64_t g = 0; g < groups; ++g) {
      unpack_ahead(g + UNPACK_AHEAD, t, 1, unpacked, next, scratch);
      switch (g % 4) {
        case 0: stages(std::integral_constant<int, 0>{}, g); break;
        case 1: stages(std::integral_constant<int, 1>{}, g); break;
        case 2: stages(std::integral_constant<int, 2>{}, g); break;
        default: stages(std::integral_constant<int, 3>{}, g); break;
      }
      const vuint* u = group(g);
      const vfloat d = bitcast<vfloat>(u[VECS]), offset = bitcast<vfloat>(u[VECS + 1]);
      const float* cg = c[g % 4] + skip * TILE;
      const float* xs = xsum + m0 * groups + g;
      for (int r = 0; r < R; ++r) {
        vfloat v = y[r] + load_floats(cg + r * TILE) * d;
        if constexpr (MIN) v += offset * xs[r * groups];
        y[r] = v;
      }
    }
    for (int r = 0; r < R; ++r) store_floats(y[r], out + r * TILE);
  }
};

// x [M, K] as its A tiles, one after the other: block b's tiles hold rows first .. first + tile_rows - 1 of
// x (first = 16 b, or M - 16 for a block that ends x: x has no rows past M to read), [groups, parts,
// tile_rows, G] each: one tile load reads 1 KiB in a row, where from x itself it would read 16 lines K * 2
// bytes apart (for K = 2048, 4 KiB apart: one set of L1's). In vectors, so that a tile's rows start on cache
// lines (a tile load of rows that straddle two ran ~1.6x slower, measured in isolation).
//
// A float32 x is split into two bfloat16 parts, x = high + low + e with high = x rounded, low = x - high rounded
// (|e| <= 2^-17 |x|: 16 of float32's 24 bits), each multiplied on tiles; bfloat16 activations everywhere (the
// avx512bf16 tier's) lost top-1 agreement with float32 on the default model (kvserve bench-quality: 97.9%). The
// sums of x per group (the minimum's term, which takes back the 128 that each q carries) are of the parts that
// were multiplied, so the two cancel. Returns the tiles and the sums.
//
// Both live in the calling thread's buffers, kept at their largest size, rather than allocated each call (a
// 512-row x's tiles are 1.2 MB).
template <typename T>
std::pair<const c10::BFloat16*, const float*> a_tiles(const T* x, int64_t M, int64_t K, int G, int tile_rows) {
  constexpr int parts = std::is_same_v<T, float> ? 2 : 1;
  const int64_t blocks = (M + TILE - 1) / TILE, groups = K / G;
  const int64_t per_block = groups * parts * tile_rows * G;  // bfloat16
  thread_local std::vector<vuint> tiles;
  thread_local std::vector<float> sums;
  const size_t vectors = (blocks * per_block * sizeof(c10::BFloat16) + sizeof(vuint) - 1) / sizeof(vuint);
  if (tiles.size() < vectors) tiles.resize(vectors);
  if (sums.size() < static_cast<size_t>(M * groups)) sums.resize(M * groups);
  // pointers, not the buffers: in the parallel region a thread_local names each worker's own
  auto* out = reinterpret_cast<c10::BFloat16*>(tiles.data());
  float* row_sums = sums.data();
  // one block (a decode step's rows) on this thread: a parallel region costs more than its copy
  at::parallel_for(0, blocks, blocks > 1 ? 1 : blocks + 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t first = std::min<int64_t>(b * TILE, M - tile_rows);
      for (int64_t g = 0; g < groups; ++g)
        for (int r = 0; r < tile_rows; ++r) {
          const T* src = x + (first + r) * K + g * G;
          c10::BFloat16* high = out + b * per_block + (g * parts * tile_rows + r) * G;
          c10::BFloat16* low = high + tile_rows * G;
          alignas(64) float both[GROUP];  // float32 x: each value's two parts added, for the sums
          for (int k = 0; k < G; k += VL) {  // VL at a time (G is 16 or 32): c10's casts went a value at a time
            const vfloat v = load_floats(src + k);
            store_floats(v, high + k);
            if constexpr (parts == 2) {
              const vfloat h = load_floats(high + k);
              store_floats(v - h, low + k);
              store_floats(h + load_floats(low + k), both + k);
            }
          }
          // each row's sums once, from the block that holds it first (a last block repeats rows of the one
          // before)
          if (first + r < b * TILE) continue;
          if constexpr (parts == 2) {
            float pairs[GROUP / 2];  // G <= 32: each pair's two parts, then a tree over the pairs
            for (int j = 0; j < G / 2; ++j) pairs[j] = both[2 * j] + both[2 * j + 1];
            for (int width = G / 4; width > 0; width /= 2)
              for (int j = 0; j < width; ++j) pairs[j] += pairs[j + width];
            row_sums[(first + r) * groups + g] = pairs[0];
          } else {
            row_sums[(first + r) * groups + g] = G == 32 ? group_sum<32>(high) : group_sum<16>(high);
          }
        }
    }
  });
  return {out, row_sums};
}

template <typename T>
void gemm_amx_of(const Packed& w, const T* x, int64_t M, const Output& out) {
  require_tiles();
  const int tile_rows = static_cast<int>(std::min<int64_t>(M, TILE));
  const int parts = std::is_same_v<T, float> ? 2 : 1;
  dispatch(w, [&](auto bits, auto g, auto min) {
    const auto [a, sums] = a_tiles(x, M, w.K, g(), tile_rows);
    run_tiles(AmxKernel<bits(), g(), min()>{w, a, sums, M, tile_rows, parts}, w, M, out);
  });
}

}  // namespace

void gemm_amx(const Packed& w, const c10::BFloat16* x, int64_t M, const Output& out) {
  gemm_amx_of(w, x, M, out);
}
void gemm_amx(const Packed& w, const float* x, int64_t M, const Output& out) { gemm_amx_of(w, x, M, out); }

#endif
