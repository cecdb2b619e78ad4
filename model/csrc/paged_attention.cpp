// Paged attention on the CPU, reading keys and values straight from the cache through each sequence's block
// table (no gathered copy), for decodes and prefill chunks alike.
//
// Every query is computed by the same code whatever its batch or chunk: its scores run over key tiles aligned
// to absolute key positions, its softmax and weighted sum run over its own keys in ascending order, all in
// float32. So a token's output has the same bits whether it is decoded alone, beside 63 others, or recomputed
// inside a prompt chunk after a preemption (model/attention.py's PyTorch path needs padding to get that).

#include "paged_attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// One level of sum_each's tree: a and b each hold 2H partial sums per group of lanes; the result holds H, a's
// groups first, each lane the sum of a lane and the lane H further on. lane(H, high, i) is the source lane (of
// the concatenation a, b) of result lane i in the low and the high halves.
constexpr int lane(int H, bool high, int i) {
  const int n = VL / (2 * H), s = i / H;  // n groups of 2H lanes in each input
  return (s / n) * VL + (s % n) * 2 * H + i % H + (high ? H : 0);
}

template <int H, size_t... I>
inline vfloat fold(vfloat a, vfloat b, std::index_sequence<I...>) {
#if defined(__clang__)
  return __builtin_shufflevector(a, b, lane(H, false, I)...) + __builtin_shufflevector(a, b, lane(H, true, I)...);
#else
  return __builtin_shuffle(a, b, vint{lane(H, false, I)...}) + __builtin_shuffle(a, b, vint{lane(H, true, I)...});
#endif
}

template <int H>
inline vfloat reduce(vfloat* p) {  // 2H vectors -> H, in place, until one is left
  for (int i = 0; i < H; ++i) p[i] = fold<H>(p[2 * i], p[2 * i + 1], std::make_index_sequence<VL>{});
  if constexpr (H == 1)
    return p[0];
  else
    return reduce<H / 2>(p);
}

// out[l] = the sum of the lanes of part[l] (VL vectors, overwritten), by a fixed tree of pairwise half-sums: at
// each level two vectors become one holding the halves of each input's partial sums added together
inline vfloat sum_each(vfloat* part) { return reduce<VL / 2>(part); }

struct Work {
  int64_t seq, head, first_query;
};

// The step's new keys (rotated when cos is given) and values, written into the caches at their slots.
template <typename T, typename C>
void store(const T* k, int64_t k_stride, const T* v, int64_t v_stride, const int64_t* slots, int64_t T_, int64_t KVH,
           int64_t D, const T* cos, const T* sin, C* k_cache, C* v_cache, int64_t head_stride, int64_t slot_stride) {
  at::parallel_for(0, T_, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> rotated(D);
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < KVH; ++h) {
        const T* src = k + t * k_stride + h * D;
        C* kd = k_cache + h * head_stride + slots[t] * slot_stride;
        if (cos) {
          rotate(src, cos + t * D, sin + t * D, D, rotated.data());
          for (int64_t d = 0; d < D; ++d) kd[d] = static_cast<C>(rotated[d]);
        } else {
          for (int64_t d = 0; d < D; ++d) kd[d] = static_cast<C>(to_float(src[d]));
        }
        const T* vs = v + t * v_stride + h * D;
        C* vd = v_cache + h * head_stride + slots[t] * slot_stride;
        for (int64_t d = 0; d < D; ++d) vd[d] = static_cast<C>(to_float(vs[d]));
      }
  });
}

// One sequence, one KV head, queries [first_query, first_query + n_pos) of the sequence, at positions
// pos0 .. pos0 + n_pos - 1, with the G query heads that share the KV head. DC is the head size when known at
// compile time (the output rows then stay in registers), else 0.
template <typename T, typename C, int DC, bool STRIDED = false>
void attend(const T* q, int64_t q_row_stride, const C* k_cache, const C* v_cache, int64_t head_stride, int64_t slot_stride,
            const int32_t* table, int64_t block_size, int64_t head, int64_t G, int64_t head_size, int64_t token0,
            int64_t n_pos, int64_t pos0, int64_t window, float scale, float softcap, T* out, int64_t H, const T* cos,
            const T* sin, const float* sinks) {
  const int64_t D = DC ? DC : head_size;
  const int64_t nq = n_pos * G;
  const int64_t pos_last = pos0 + n_pos - 1;
  auto first_key = [&](int64_t pos) { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : int64_t(0); };
  const int64_t lo = first_key(pos0) / KT * KT;  // the scores hold keys lo .. lo + L - 1
  const int64_t L = (pos_last / KT + 1) * KT - lo;

  // queries and key rows as float vectors, zero-padded to DV vectors of KT lanes
  const int64_t DV = (D + KT - 1) / KT;
  // Per-thread scratch, kept between calls: a step runs this once per (sequence, KV head) unit, and allocating
  // it each time cost ~10% of a 32-sequence decode's attention (measured). It keeps its largest size per thread.
  thread_local std::vector<vfloat> qv, keys, score_tiles, value_rows;
  thread_local std::vector<float> acc, total;
  qv.assign(nq * DV, vfloat{});
  keys.assign(KT * DV, vfloat{});
  score_tiles.resize(nq * L / KT);
  value_rows.resize(D);
  acc.assign(nq * D, 0.0f);
  total.resize(nq);
  float* S = reinterpret_cast<float*>(score_tiles.data());
  float* values = reinterpret_cast<float*>(value_rows.data());  // KT value rows as [KT][D]

  for (int64_t i = 0; i < n_pos; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const T* src = q + (token0 + i) * q_row_stride + (head * G + g) * D;
      float* dst = reinterpret_cast<float*>(&qv[(i * G + g) * DV]);
      if (cos)  // rotated by its position, in float32
        rotate(src, cos + (token0 + i) * D, sin + (token0 + i) * D, D, dst);
      else
        for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d]);
      for (int64_t d = 0; d < D; ++d) dst[d] *= scale;
    }
  const C* k_head = k_cache + head * head_stride;
  const C* v_head = v_cache + head * head_stride;
  auto row = [&](const C* base, int64_t pos) {
    // a key's row: slot * D in a cache whose heads keep their slots together (D known at compile time there),
    // slot * slot_stride where a slot holds every head's (model/kv_cache.py, layers whose heads differ)
    return base + (static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size) * (STRIDED ? slot_stride : D);
  };
  // The rows of keys (or values) [t0, t0 + KT), asked for into L2 two tiles ahead of their use: the block table
  // scatters a sequence's rows over the cache, and the hardware's prefetcher stops at each block's few KB
  // (Qwen3-0.6B's heads, one sequence of 1,000 tokens: each row's loads waited on memory; 5.2 -> 4.5 ms a step's
  // attention; 32 of 200: 39 -> 35 ms, on a noisy host)
  auto prefetch_tile = [&](const C* base, int64_t t0) {
    for (int64_t pos = t0; pos < std::min(t0 + KT, pos_last + 1); ++pos) {
      const char* r = reinterpret_cast<const char*>(row(base, pos));
      for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(C)); b += 64) prefetch_l2(r + b);
    }
  };
  prefetch_tile(k_head, lo);
  prefetch_tile(k_head, lo + KT);

  // scores, a tile of KT keys at a time: per key a vector of partial sums over the head, then one tree
  // reduces the KT vectors into the KT scores
  for (int64_t t0 = lo; t0 <= pos_last; t0 += KT) {
    prefetch_tile(k_head, t0 + 2 * KT);
    const int64_t n = std::min<int64_t>(KT, pos_last + 1 - t0);
    float* kf = reinterpret_cast<float*>(keys.data());
    for (int64_t l = 0; l < KT; ++l) {  // lanes past D stay 0; keys past the last are 0 (their scores are masked)
      float* dst = kf + l * DV * KT;
      if (l < n) {
        const C* k = row(k_head, t0 + l);
        for (int64_t d = 0; d < D; ++d) dst[d] = to_float(k[d]);
      } else {
        for (int64_t d = 0; d < D; ++d) dst[d] = 0.0f;
      }
    }
    for (int64_t i = std::max<int64_t>(0, t0 - pos0); i < n_pos; ++i) {
      if (t0 + KT <= first_key(pos0 + i)) continue;
      for (int64_t g = 0; g < G; ++g) {
        const vfloat* qrow = &qv[(i * G + g) * DV];
        vfloat part[KT];
        for (int l = 0; l < KT; ++l) {
          part[l] = qrow[0] * keys[l * DV];
          for (int64_t c = 1; c < DV; ++c) part[l] += qrow[c] * keys[l * DV + c];
        }
        score_tiles[((i * G + g) * L + (t0 - lo)) / KT] = sum_each(part);
      }
    }
  }

  prefetch_tile(v_head, lo);
  prefetch_tile(v_head, lo + KT);

  // softmax of each query over its keys
  for (int64_t v = 0; v < nq; ++v) {
    const int64_t pos = pos0 + v / G;
    total[v] = softmax(&S[v * L - lo], first_key(pos), pos + 1, softcap, sinks ? &sinks[head * G + v % G] : nullptr);
  }

  // weighted sum of the values, keys in ascending order
  for (int64_t t0 = lo; t0 <= pos_last; t0 += KT) {
    prefetch_tile(v_head, t0 + 2 * KT);
    const int64_t n = std::min<int64_t>(KT, pos_last + 1 - t0);
    for (int64_t l = 0; l < n; ++l) {
      const C* val = row(v_head, t0 + l);
      for (int64_t d = 0; d < D; ++d) values[l * D + d] = to_float(val[d]);
    }
    for (int64_t v = std::max<int64_t>(0, t0 - pos0) * G; v < nq; ++v) {
      const int64_t pos = pos0 + v / G;
      const int64_t a = std::max(first_key(pos), t0), b = std::min(pos + 1, t0 + n);
      const float* p = &S[v * L - lo];
      float* o = &acc[v * D];
      if constexpr (DC > 0 && DC % KT == 0 && DC / KT <= 8) {  // the output row in registers
        vfloat o_reg[DC / KT];
        __builtin_memcpy(o_reg, o, sizeof(o_reg));
        for (int64_t j = a; j < b; ++j) {
          const vfloat* val = &value_rows[(j - t0) * D / KT];
          for (int t = 0; t < DC / KT; ++t) o_reg[t] += p[j] * val[t];
        }
        __builtin_memcpy(o, o_reg, sizeof(o_reg));
      } else {
        for (int64_t j = a; j < b; ++j)
          for (int64_t d = 0; d < D; ++d) o[d] += p[j] * values[(j - t0) * D + d];
      }
    }
  }

  for (int64_t v = 0; v < nq; ++v) {
    const float inv = 1.0f / total[v];
    T* dst = out + ((token0 + v / G) * H + head * G + v % G) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[v * D + d] * inv);
  }
}

}  // namespace

// q [T, H, D] (heads contiguous, rows may be strided: a view of the fused qkv output), k_cache and v_cache
// [KVH, slots, D] (a head's values contiguous; heads and slots at any strides, the same in both), of q's dtype or bfloat16, block_tables [S, N] int32, seqs [S, 3] int32 rows of (first flat token, query
// length, sequence length). Returns [T, H, D]: each query attends causally (and within `window` when > 0) to
// its sequence's keys, its scores soft-capped when softcap > 0, with sinks ([H] float32, GPT-OSS) a logit per head in
// each softmax's denominator. With k and v ([T, KVH, D], rows may be strided) and slots [T] int64, the step's new keys
// and values are first written into the caches; with cos and sin ([T, D], the model's dtype), q and the new
// keys are first rotated by their positions (RoPE, in float32; keys rounded once, when stored).
at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                              at::Tensor seqs, int64_t block_size, double scale, int64_t window, double softcap,
                              int64_t chunk,
                              std::optional<at::Tensor> k, std::optional<at::Tensor> v,
                              std::optional<at::Tensor> slots, std::optional<at::Tensor> cos,
                              std::optional<at::Tensor> sin, std::optional<at::Tensor> sinks,
                              std::optional<at::Tensor> prompt_runs, bool emulate_tiles) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [T, H, D], heads contiguous");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.stride(2) == 1 && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.strides() == k_cache.strides(),
              "the caches must be [KVH, slots, D] views alike, each head's values contiguous");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "float32, bfloat16 or float16 only (the kernel computes in float32)");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == q.scalar_type() || k_cache.scalar_type() == at::kBFloat16),
              "the caches must be of q's dtype or bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seqs.scalar_type() == at::kInt, "metadata must be int32");
  TORCH_CHECK(chunk > 0 && block_size > 0, "chunk and block_size must be positive");
  const int64_t T_ = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(0);
  const int64_t head_stride = k_cache.stride(0), slot_stride = k_cache.stride(1);
  TORCH_CHECK(k_cache.size(2) == D, "the caches' head size must be q's");
  TORCH_CHECK(H % KVH == 0, "query heads must be a multiple of KV heads");
  const int64_t G = H / KVH;
  TORCH_CHECK(k.has_value() == v.has_value() && k.has_value() == slots.has_value(), "k, v and slots go together");
  TORCH_CHECK(cos.has_value() == sin.has_value() && (!cos || k), "cos and sin go together, with k");
  at::Tensor slot_ids, cos_c, sin_c;
  if (k) {
    TORCH_CHECK(k->dim() == 3 && v->dim() == 3 && k->size(0) == T_ && k->size(1) == KVH && k->size(2) == D &&
                    v->sizes() == k->sizes() && k->stride(2) == 1 && k->stride(1) == D && v->stride(2) == 1 &&
                    v->stride(1) == D && k->scalar_type() == q.scalar_type() && v->scalar_type() == q.scalar_type(),
                "k and v must be [T, KVH, D] of q's dtype, heads contiguous");
    slot_ids = slots->to(at::kLong).contiguous();
    TORCH_CHECK(slot_ids.numel() == T_, "one slot per token");
  }
  if (cos) {
    cos_c = cos->contiguous();
    sin_c = sin->contiguous();
    TORCH_CHECK(cos_c.numel() == T_ * D && sin_c.numel() == T_ * D && cos_c.scalar_type() == q.scalar_type() &&
                    sin_c.scalar_type() == q.scalar_type(),
                "cos and sin must be [T, D] of q's dtype");
  }
  at::Tensor sinks_c;
  if (sinks) {
    sinks_c = sinks->contiguous();
    TORCH_CHECK(sinks_c.scalar_type() == at::kFloat && sinks_c.numel() == H, "sinks must be [H] float32");
  }
  const float* sinks_p = sinks ? sinks_c.data_ptr<float>() : nullptr;
  // the prompt's queries (prompt_runs), on AMX's tiles where the caches are bfloat16 and a head's values fill
  // whole tiles, else on vectors as the others (none named: empty)
#if !defined(__AMX_BF16__)
  TORCH_CHECK(!prompt_runs, "a prompt's queries on AMX's tiles: the amx tier only");
#endif
  std::vector<char> on_tiles = prompt_rows(prompt_runs, T_);
  if (k_cache.scalar_type() != at::kBFloat16 || q.scalar_type() == at::kHalf || !tiles_fit(D)) on_tiles.clear();
  auto tiled = [&](int64_t t) { return !on_tiles.empty() && on_tiles[t]; };
  auto out = at::empty({T_, H, D}, q.options());
  auto tables = block_tables.contiguous();
  auto seq_info = seqs.contiguous();
  const int32_t* seq = seq_info.data_ptr<int32_t>();
  // Few units leave threads idle: a lone sequence verifying its drafts is 3 units (SmolLM2's KV heads), 2 + 1 on
  // 2 threads. Where a step has fewer than two a thread, its queries go in smaller chunks (a query's numbers do
  // not depend on its unit's).
  auto units = [&](int64_t c) {
    int64_t n = 0;
    for (int64_t s = 0; s < seq_info.size(0); ++s) n += (seq[s * 3 + 1] + c - 1) / c * KVH;
    return n;
  };
  while (chunk > 1 && units(chunk) < 2 * at::get_num_threads()) chunk = (chunk + 1) / 2;
  std::vector<Work> work;  // every (sequence, KV head, chunk of queries): the unit of parallelism
  for (int64_t s = 0; s < seq_info.size(0); ++s)
    for (int64_t c = 0; c < seq[s * 3 + 1]; c += chunk)
      for (int64_t h = 0; h < KVH; ++h) work.push_back({s, h, c});
  // the caches hold q's dtype, or bfloat16 under float32 activations (model/cpu_tier.py: half the bytes a step
  // reads, converted to float32 by a shift)
  auto run = [&](auto q_type, auto cache_type) {
    using T = decltype(q_type);
    using C = decltype(cache_type);
    auto fn = slot_stride != D ? attend<T, C, 0, true>
              : D == 64        ? attend<T, C, 64>
              : D == 128       ? attend<T, C, 128>
                               : attend<T, C, 0>;
    auto tiles = [&](auto... args) {  // rows are tiled only where the types fit
#if defined(__AMX_BF16__)
      if constexpr (std::is_same_v<C, c10::BFloat16> && !std::is_same_v<T, c10::Half>) return attend_tiles<T>(args...);
#endif
      TORCH_CHECK(false, "no tiles for these types");
    };
    const T* qp = q.data_ptr<T>();
    const C* kp = k_cache.data_ptr<C>();
    const C* vp = v_cache.data_ptr<C>();
    T* op = out.data_ptr<T>();
    const int32_t* tp = tables.data_ptr<int32_t>();
    const T* cp = cos ? cos_c.data_ptr<T>() : nullptr;
    const T* sp = cos ? sin_c.data_ptr<T>() : nullptr;
    if (k)
      store(k->data_ptr<T>(), k->stride(0), v->data_ptr<T>(), v->stride(0), slot_ids.data_ptr<int64_t>(), T_, KVH, D,
            cp, sp, k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), head_stride, slot_stride);
    const int64_t N = tables.size(1);
    // Work items are dealt out round-robin: a prompt's later chunks cost more (more keys), so contiguous
    // ranges per thread would leave one thread with most of the work.
    const int64_t n_work = work.size(), n_threads = std::min<int64_t>(at::get_num_threads(), n_work);
    at::parallel_for(0, n_threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t w0 = begin; w0 < end; ++w0)
        for (int64_t w = w0; w < n_work; w += n_threads) {
          const Work& it = work[w];
          const int64_t token0 = seq[it.seq * 3], q_len = seq[it.seq * 3 + 1], seq_len = seq[it.seq * 3 + 2];
          const int64_t first = token0 + it.first_query, last = token0 + std::min(it.first_query + chunk, q_len);
          for (int64_t t0 = first, t1; t0 < last; t0 = t1) {  // the unit's runs of prompt rows and of others
            for (t1 = t0 + 1; t1 < last && tiled(t1) == tiled(t0);) ++t1;
            const int64_t pos = seq_len - q_len + (t0 - token0);
            if (tiled(t0))
              tiles(emulate_tiles, qp, q.stride(0), kp, vp, head_stride, slot_stride, tp + it.seq * N, block_size,
                    it.head, G, D, t0, t1 - t0, pos, window, static_cast<float>(scale), static_cast<float>(softcap),
                    op, H, cp, sp, sinks_p);
            else
              fn(qp, q.stride(0), kp, vp, head_stride, slot_stride, tp + it.seq * N, block_size, it.head, G, D, t0,
                 t1 - t0, pos, window, static_cast<float>(scale), static_cast<float>(softcap), op, H, cp, sp, sinks_p);
          }
        }
    });
  };
  const bool bf16_cache = k_cache.scalar_type() == at::kBFloat16;
  switch (q.scalar_type()) {
    case at::kFloat:
      bf16_cache ? run(float{}, c10::BFloat16{}) : run(float{}, float{});
      break;
    case at::kBFloat16:
      run(c10::BFloat16{}, c10::BFloat16{});
      break;
    default:
      run(c10::Half{}, c10::Half{});
  }
  return out;
}
