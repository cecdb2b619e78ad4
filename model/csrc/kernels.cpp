// The Python module of kvserve's CPU kernels, built by model/kernels.py (torch.utils.cpp_extension).
#include <torch/extension.h>

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                              torch::Tensor seqs, int64_t block_size, double scale, int64_t window, int64_t chunk);
std::vector<torch::Tensor> rms_norm(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight,
                                    double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over a block-table KV cache (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm of x, or of x + residual also returned (CPU)");
}
