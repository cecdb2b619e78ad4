// The Python module of kvserve's CPU kernels, built by model/kernels.py (torch.utils.cpp_extension).
#include <torch/extension.h>

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                              torch::Tensor seqs, int64_t block_size, double scale, int64_t window, int64_t chunk,
                              std::optional<torch::Tensor> k, std::optional<torch::Tensor> v,
                              std::optional<torch::Tensor> slots, std::optional<torch::Tensor> cos,
                              std::optional<torch::Tensor> sin);
torch::Tensor silu_mul(torch::Tensor x);
std::vector<torch::Tensor> rms_norm(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight,
                                    double eps);
torch::Tensor q4_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor mins,
                      std::optional<torch::Tensor> bias, int64_t N, bool float_out);
torch::Tensor q8_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, std::optional<torch::Tensor> bias,
                      int64_t N, bool float_out);
torch::Tensor q4_rows(torch::Tensor packed, torch::Tensor scales, torch::Tensor mins, torch::Tensor ids, int64_t K);
torch::Tensor q8_rows(torch::Tensor packed, torch::Tensor scales, torch::Tensor ids, int64_t K);

// The heavy kernels let go of the GIL while they run: the engine steps on its own thread, and the server's event
// loop must be able to stream tokens and take requests meanwhile (holding it, a kernel made the loop wait for
// Python's switch interval, 5 ms, each time).
using no_gil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over a block-table KV cache (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seqs"),
        py::arg("block_size"), py::arg("scale"), py::arg("window"), py::arg("chunk"), py::arg("k") = py::none(),
        py::arg("v") = py::none(), py::arg("slots") = py::none(), py::arg("cos") = py::none(),
        py::arg("sin") = py::none(), no_gil());
  m.def("silu_mul", &silu_mul, "SwiGLU's silu(gate) * up of x = [gate, up] (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm of x, or of x + residual also returned (CPU)");
  m.def("q4_gemm", &q4_gemm, "x W^T on 4-bit weights in groups of 32 (w = d q + m), x bfloat16 (CPU)",
        no_gil());
  m.def("q8_gemm", &q8_gemm, "x W^T on 8-bit weights in groups of 32 (w = d q), x bfloat16 (CPU)",
        no_gil());
  m.def("q4_rows", &q4_rows, "rows of a packed 4-bit weight, dequantized to float32");
  m.def("q8_rows", &q8_rows, "rows of a packed 8-bit weight, dequantized to float32");
}
