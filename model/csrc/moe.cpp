// A sparse Mixture-of-Experts FFN in one call (model/moe.py says what it computes): a float32 router scores every
// expert for each token, the token takes its top k (softmax over all experts, renormalized over the k where the
// family says), the step's tokens are grouped by expert so each chosen expert's weights are read once a step
// however many tokens chose it, and each token's outputs are summed in float32, expert after expert in ascending
// id. Every part gives a token the same bits whatever else is in its step: the router's dot products run in a
// fixed order (not a BLAS GEMM, whose summation order may follow the batch's size), the quantized GEMMs are
// row-invariant (quant_gemm.cpp), and a token's sum has the same terms in the same order. So greedy decoding is
// the same alone and batched, and speculation stays exact.

#include <ATen/Parallel.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>

#include "kernels.h"
#include "layer_stack.h"
#include "vec.h"

namespace {

// x [T, K] float32 . w [N, K] float32 (+ bias [N]) -> [T, N]: each dot product in VL lanes, then a fixed tree
at::Tensor scores(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias = std::nullopt) {
  const int64_t T = x.size(0), N = w.size(0), K = x.size(1);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(1) == K, "router: float32 [N, K]");
  auto out = at::empty({T, N}, x.options().dtype(at::kFloat));
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "router bias: float32 [N]");
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>(), *bp = bias ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T * N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float *a = xp + (i / N) * K, *b = wp + (i % N) * K;
      vfloat acc{};
      int64_t k = 0;
      for (; k + VL <= K; k += VL) acc += load_floats(a + k) * load_floats(b + k);
      float sum = hsum(acc);
      for (; k < K; ++k) sum += a[k] * b[k];
      op[i] = bp ? sum + bp[i % N] : sum;
    }
  });
  return out;
}

// The runs of prompt rows among an expert's tokens (ascending rows of the step), as quant_gemm_rows takes them:
// [R, 2] int64 of positions in `rows`, from the step's prompt flags
at::Tensor expert_runs(const std::vector<int64_t>& rows, const std::vector<char>& prompt) {
  std::vector<int64_t> runs;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!prompt[rows[i]]) continue;
    if (!runs.empty() && runs.back() == static_cast<int64_t>(i))
      runs.back() = static_cast<int64_t>(i) + 1;
    else
      runs.insert(runs.end(), {static_cast<int64_t>(i), static_cast<int64_t>(i) + 1});
  }
  auto out = at::empty({static_cast<int64_t>(runs.size() / 2), 2}, at::kLong);
  std::copy(runs.begin(), runs.end(), out.data_ptr<int64_t>());
  return out;
}

}  // namespace

// x [T, hidden] (float32 or bfloat16) -> [T, hidden] in x's dtype
at::Tensor MoeFfn::operator()(const at::Tensor& x_in, const std::optional<at::Tensor>& router_input,
                              const std::optional<at::Tensor>& prompt_runs) const {
  const at::Tensor x = x_in.contiguous();
  const int64_t T = x.size(0), E = router.size(0), k = top_k, hidden = x.size(1);
  TORCH_CHECK(x.dim() == 2 && static_cast<int64_t>(up.size()) == E && static_cast<int64_t>(down.size()) == E &&
                  k >= 1 && k <= E,
              "experts mismatch");
  TORCH_CHECK(!router_input || router_input->sizes() == x.sizes(), "the router's input is not x's shape");
  TORCH_CHECK(router_scale.has_value() == expert_scale.has_value() &&
                  (!expert_scale || (expert_scale->scalar_type() == at::kFloat && expert_scale->is_contiguous() &&
                                     expert_scale->numel() == E)),
              "a scaled router: router_scale [hidden] and expert_scale [experts] float32");
  at::Tensor routed = router_input ? *router_input : x;
  if (router_scale)  // Gemma 4's, with model/moe.py's ops and roundings: the unit norm rounded once to x's dtype
    routed = rms_norm(routed, std::nullopt, std::nullopt, eps)[0]
                 .mul(*router_scale)
                 .mul(std::pow(static_cast<double>(hidden), -0.5));
  routed = routed.to(at::kFloat).contiguous();
  const at::Tensor logits = scores(routed, router, router_bias);  // [T, E]
  // each token's top k: softmax over every expert, the k largest (ties to the lower id), renormalized or not
  std::vector<int64_t> chosen(T * k);
  std::vector<float> weights(T * k);
  const float* lp = logits.data_ptr<float>();
  const float* expert_scales = expert_scale ? expert_scale->data_ptr<float>() : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    const float* l = lp + t * E;
    const float top = *std::max_element(l, l + E);
    std::vector<float> p(E);
    float sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - top));
    std::vector<int64_t> ids(E);
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                      [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float chosen_sum = 0;
    for (int64_t j = 0; j < k; ++j) chosen_sum += p[ids[j]];
    for (int64_t j = 0; j < k; ++j) {
      chosen[t * k + j] = ids[j];
      weights[t * k + j] = renormalize ? p[ids[j]] / chosen_sum : p[ids[j]] / sum;
      if (expert_scales) weights[t * k + j] *= expert_scales[ids[j]];
    }
  }
  // (token, weight) pairs of each expert, tokens ascending
  std::vector<std::vector<int64_t>> tokens(E);
  std::vector<std::vector<float>> token_weights(E);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      tokens[chosen[t * k + j]].push_back(t);
      token_weights[chosen[t * k + j]].push_back(weights[t * k + j]);
    }
  // Each chosen expert's MLP on its tokens, the experts shared out among the threads, each expert's GEMMs on
  // one thread (a GEMM called inside the parallel region runs on its caller's): one parallel region a step, not
  // two a chosen expert, and each thread streams whole experts' weights. The largest first, each taken by the
  // next free thread, so that a prefill's uneven experts end together. A GEMM's rows get the same bits on one
  // thread or many (quant_gemm.h, run_tiles), so this changes no output.
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (!tokens[e].empty()) active.push_back(e);
  std::vector<int64_t> order = active;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return tokens[a].size() > tokens[b].size(); });
  // each row's part: a prompt token's or not (prompt_runs), for its experts' GEMMs
  const std::vector<char> prompt = prompt_rows(prompt_runs, T);
  std::vector<at::Tensor> ys(E);
  std::atomic<size_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (size_t i = next++; i < order.size(); i = next++) {
      const int64_t e = order[i];
      auto rows = at::empty({static_cast<int64_t>(tokens[e].size())}, x.options().dtype(at::kLong));
      std::copy(tokens[e].begin(), tokens[e].end(), rows.data_ptr<int64_t>());
      std::optional<at::Tensor> runs;
      if (prompt_runs) runs = expert_runs(tokens[e], prompt);
      const auto h = activation(step_gemm(up[e], x.index_select(0, rows), runs));
      ys[e] = step_gemm(down[e], h, runs).to(at::kFloat).contiguous();
    }
  });
  auto out = at::zeros({T, hidden}, x.options().dtype(at::kFloat));
  float* outp = out.data_ptr<float>();
  for (const int64_t e : active) {  // ascending id: a token's terms are added in the same order in any batch
    const float* yp = ys[e].data_ptr<float>();
    for (size_t r = 0; r < tokens[e].size(); ++r) {
      float* o = outp + tokens[e][r] * hidden;
      const float w = token_weights[e][r];
      for (int64_t c = 0; c < hidden; ++c) o[c] += w * yp[r * hidden + c];
    }
  }
  if (shared_up) {  // Qwen2-MoE: every token's shared expert, scaled by sigmoid(gate . x)
    // the gate reads x: the router's float32 input where that is x itself (Qwen2-MoE's plain router)
    const bool routed_is_x = !router_input && !router_scale;
    const at::Tensor gate = scores(routed_is_x ? routed : x.to(at::kFloat).contiguous(), *shared_gate);  // [T, 1]
    const at::Tensor y =
        step_gemm(*shared_down, activation(step_gemm(*shared_up, x, prompt_runs)), prompt_runs).to(at::kFloat).contiguous();
    const float *gp = gate.data_ptr<float>(), *yp = y.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      const float g = 1.0f / (1.0f + std::exp(-gp[t]));
      for (int64_t c = 0; c < hidden; ++c) outp[t * hidden + c] += g * yp[t * hidden + c];
    }
  }
  return out.to(x.scalar_type());
}
