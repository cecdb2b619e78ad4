// Packing a quantized weight's q into the kernel's layout (quant_gemm.h), once, at load: one pass over [N, K]
// where the same in PyTorch ops took ~4 s of a 1B model's ~6 s load (pad, masks, shifts, permutes, copies).
//
// Rows go in tiles of 16 (zero rows pad the last). For each tile and group of `group` along K, the group's bytes:
//   8 bits: chunk c, lane j's bytes 2j, 2j + 1 = q[2c], q[2c + 1] of row j (int8 as it is);
//   4 to 6 in the avx2 tier's module: its own layout, chunks in pairs (quant_gemm.h, PAIRED_CHUNKS); elsewhere
//   the nibble plane, chunk c, lane j's bytes 2j + i = lo(q[4c + i]) | lo(q[4c + 2 + i]) << 4; then, for 5
//   and 6 bits, the high-bit plane: rows of 16 bytes, one a lane, chunk c's 4 HB bits hi(q[4c]), hi(q[4c + 2]),
//   hi(q[4c + 1]), hi(q[4c + 3]) (HB bits each, in that order) from bit 4 HB c of the lane's bytes.

#include "kernels.h"
#include "quant_gemm.h"  // TILE

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <cstring>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include <memory>
#include <mutex>

namespace {

constexpr size_t HUGE = size_t{2} << 20;

// `used` bytes (whole pages, a frame or more) of a mapping of their own from a 2 MiB boundary, with 2 MiB pages asked for
// (MADV_HUGEPAGE) over its whole frames before anything is written there, so that the first writes fault them in
// as 2 MiB pages (transparent huge pages where the system allows; the hint's failure is harmless). nullptr where
// mmap fails or the system has no such hint.
uint8_t* map_for_huge_pages(size_t used) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  void* raw = mmap(nullptr, used + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(raw), at = (begin + HUGE - 1) & ~(HUGE - 1);
  if (at > begin) munmap(raw, at - begin);  // the slack before the boundary and after the mapping
  if (begin + HUGE > at) munmap(reinterpret_cast<void*>(at + used), begin + HUGE - at);
  madvise(reinterpret_cast<void*>(at), used / HUGE * HUGE, MADV_HUGEPAGE);
  return reinterpret_cast<uint8_t*>(at);
#else
  (void)used;
  return nullptr;
#endif
}

size_t whole_pages(size_t bytes) {
#if defined(__linux__)
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
#else
  return bytes;
#endif
}

void unmap(uint8_t* at, size_t used) {
#if defined(__linux__)
  munmap(at, used);
#endif
}

// Weights of less than a frame (an MoE layer's experts: Qwen3.6-35B-A3B's are 0.6-1.1 MiB packed) are carved one
// after the other out of a shared region of REGION bytes mapped as above, and so share its 2 MiB pages from the
// start. Each alone, from the allocator, they sat on 4 KiB pages until model/huge_pages.py's move copied them,
// 2.2 GB of the Qwen3.6 cut's in ~5 s of a core: beside the first minute's requests, c1 ran at 67-74 tok/s
// against 76-81 once moved (Zen 4, forced AVX2). A region's last frame is partly empty where the next weight did
// not fit: 256 MiB regions held the cut resident in 18 MiB less than 32 MiB ones, and the rest of a region is
// never touched (address space only). A region goes back to the system with the last weight carved from it; the
// current one is held by weak reference, so never by the carving alone.
constexpr size_t REGION = size_t{256} << 20, CARVE_ALIGN = 64;

struct Region {
  uint8_t* at;
  ~Region() { unmap(at, REGION); }
};

std::mutex carving;
std::weak_ptr<Region> current_region;
size_t region_used = 0;

// A packed weight's bytes, in memory of their own (a frame or more) or in a shared region (less), so that its
// frames are on 2 MiB pages from the first write. The allocator's memory is no place for them: a buffer of less
// than glibc's mmap threshold (raised up to 32 MiB by the load's own freed temporaries) comes from memory already
// faulted in on 4 KiB pages, which the hint does not change. So it was for Qwen3.5 ~1.5B's Q4_K_M: 104 of its
// 888 MiB on 2 MiB pages after load, and a busy server's decode steps 1.4x slower (38 against 27 ms, Zen 4)
// for the minutes model/huge_pages.py's move took to copy them, a frame a second. A big weight's last partial
// frame stays on 4 KiB pages: a 2 MiB page there would be mostly empty. Where no mapping can be had: the
// allocator's memory.
at::Tensor empty_on_huge_pages(int64_t n) {
  const auto bytes_of = at::TensorOptions().dtype(at::kByte);
  const size_t bytes = static_cast<size_t>(n);
  if (bytes >= HUGE) {
    const size_t used = whole_pages(bytes);
    if (uint8_t* at = map_for_huge_pages(used))
      return at::from_blob(at, {n}, [used](void* p) { unmap(static_cast<uint8_t*>(p), used); }, bytes_of);
  } else if (bytes > 0) {
    std::lock_guard<std::mutex> lock(carving);
    std::shared_ptr<Region> region = current_region.lock();
    if (!region || region_used + bytes > REGION) {
      uint8_t* at = map_for_huge_pages(REGION);
      region = at ? std::shared_ptr<Region>(new Region{at}) : nullptr;
      current_region = region;
      region_used = 0;
    }
    if (region) {
      uint8_t* at = region->at + region_used;
      region_used = (region_used + bytes + CARVE_ALIGN - 1) / CARVE_ALIGN * CARVE_ALIGN;
      return at::from_blob(at, {n}, [region](void*) {}, bytes_of);  // the region lives while its weights do
    }
  }
  return at::empty({n}, bytes_of);
}

// One tile's bytes for one group: rows[j] points at row j's group of q (a padding row's at zeros)
void pack_group(const uint8_t* const* rows, int64_t bits, int64_t group, uint8_t* out) {
  if (bits == 8) {
    for (int64_t c = 0; c < group / 2; ++c)
      for (int64_t j = 0; j < TILE; ++j)
        for (int64_t i = 0; i < 2; ++i) out[(c * TILE + j) * 2 + i] = rows[j][2 * c + i];
    return;
  }
  if (PAIRED_CHUNKS) {  // the avx2 tier's (quant_gemm.h)
    const int64_t HB = bits - 4;
    std::memset(out, 0, TILE * group * bits / 8);
    uint32_t* high = reinterpret_cast<uint32_t*>(out + TILE * group / 2);
    for (int64_t j = 0; j < TILE; ++j)
      for (int64_t k = 0; k < group; ++k) {
        const int64_t c = k / 4, i = k % 4, q = rows[j][k];
        out[c / 2 * 64 + 4 * j + i] |= static_cast<uint8_t>((q & 15) << (4 * (c % 2)));
        if (HB) high[j] |= static_cast<uint32_t>(q >> 4) << (8 * i + HB * c);
      }
    return;
  }
  for (int64_t c = 0; c < group / 4; ++c)
    for (int64_t j = 0; j < TILE; ++j)
      for (int64_t i = 0; i < 2; ++i) {
        const uint8_t* q = rows[j] + 4 * c;
        out[(c * TILE + j) * 2 + i] = static_cast<uint8_t>((q[i] & 15) | (q[2 + i] & 15) << 4);
      }
  if (bits == 4) return;
  const int64_t HB = bits - 4;
  uint8_t* high = out + TILE * group / 2;
  std::memset(high, 0, TILE * group * HB / 8);
  for (int64_t c = 0; c < group / 4; ++c)
    for (int64_t j = 0; j < TILE; ++j) {
      const uint8_t* q = rows[j] + 4 * c;
      const int chunk = (q[0] >> 4) | (q[2] >> 4) << HB | (q[1] >> 4) << 2 * HB | (q[3] >> 4) << 3 * HB;
      high[4 * HB * c / 8 * TILE + j] |= static_cast<uint8_t>(chunk << (4 * HB * c % 8));
    }
}

}  // namespace

// q [N, K]: uint8 0 .. 2^bits - 1 (bits 4 to 6) or int8 (bits 8). Returns packed uint8 [tiles, K / group,
// 2 * group * bits] (16 rows' worth of a group's bits: 2 * group * bits bytes).
at::Tensor pack_quant(at::Tensor q, int64_t bits, int64_t group) {
  TORCH_CHECK(q.dim() == 2 && q.element_size() == 1, "q must be [N, K] of bytes");
  TORCH_CHECK(bits == 8 || (bits >= 4 && bits <= 6), "4 to 6 bits, or 8");
  TORCH_CHECK(group % 8 == 0 && q.size(1) % group == 0, "K must be whole groups of a multiple of 8");
  q = q.contiguous();
  const int64_t N = q.size(0), K = q.size(1), T = (N + TILE - 1) / TILE, G = K / group;
  const int64_t bytes = 2 * group * bits;
  auto packed = empty_on_huge_pages(T * G * bytes).view({T, G, bytes});
  const auto* qp = static_cast<const uint8_t*>(q.data_ptr());
  auto* out = packed.data_ptr<uint8_t>();
  const std::vector<uint8_t> zeros(group, 0);  // the padding rows' q
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    const uint8_t* rows[TILE];
    for (int64_t t = begin; t < end; ++t)
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t j = 0; j < TILE; ++j)
          rows[j] = t * TILE + j < N ? qp + (t * TILE + j) * K + g * group : zeros.data();
        pack_group(rows, bits, group, out + (t * G + g) * bytes);
      }
  });
  return packed;
}
