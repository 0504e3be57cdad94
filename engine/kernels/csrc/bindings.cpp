// Python bindings of Serval's native CPU ops (engine/kernels/cpu.py builds and loads them).
// torch's pybind11 type casters alone, not <torch/extension.h> (the whole C++ frontend): this file then
// compiles in about a third of the time, and every first start compiles it.
#include <torch/csrc/utils/pybind.h>

#include "torch_ops.h"

#include "vec.h"

namespace py = pybind11;

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale, c10::optional<torch::Tensor> out,
                                     int64_t window);
torch::Tensor argmax_rows(torch::Tensor logits);
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows);
#if SERVAL_FUSED_OPS
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void rotary_embedding_and_cache(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                torch::Tensor cos_sin, torch::Tensor kv_cache, torch::Tensor slot_mapping);
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor w, int64_t qtype, c10::optional<torch::Tensor> bias);
torch::Tensor quant_linear_reference(torch::Tensor x, torch::Tensor w, int64_t qtype,
                                     c10::optional<torch::Tensor> bias);
torch::Tensor decode_stack(torch::Tensor hidden, std::vector<torch::Tensor> layer_weights,
                           std::vector<torch::Tensor> packed_weights, std::vector<torch::Tensor> kv_caches, torch::Tensor final_norm, torch::Tensor positions,
                           std::vector<torch::Tensor> slot_mappings, torch::Tensor cos_sin,
                           std::vector<torch::Tensor> block_tables, torch::Tensor seq_lens, int64_t num_heads,
                           int64_t num_kv_heads, double eps, double scale, int64_t native_rows,
                           std::vector<int64_t> weight_formats, std::vector<int64_t> windows,
                           std::vector<int64_t> layer_groups);
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#if !SERVAL_QUANT_ONLY  // SERVAL_QUANT_ONLY: the block products alone (cpu.py's SERVAL_CPU_KERNELS_SUBSET=quant)
  m.def("argmax_rows", &argmax_rows, "Row-wise argmax of float32 logits [n, V] -> int64 [n]");
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is 0 (float32 logits, int32 bitmask)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache (q [n, H, D] -> [n, H, D], written into out if given); "
        "window > 0: each query attends its last `window` keys only",
        py::arg("q"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("out") = py::none(), py::arg("window") = 0);
#endif
#if SERVAL_FUSED_OPS && !SERVAL_QUANT_ONLY
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "In place: residual = x + residual; x = rms_norm(residual) * weight (rows of the last dim)");
  m.def("rms_norm", &rms_norm, "rms_norm(x) * weight over the last dim, as Hugging Face computes it");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of gate_up [T, 2I] -> [T, I]");
  m.def("rotary_embedding_and_cache", &rotary_embedding_and_cache,
        "In place: rope on q [T, H, D] and k [T, Hk, D]; then k, v rows into kv_cache at slot_mapping");
  m.def("skinny_linear", &skinny_linear, "x [M, K] @ w[N, K]^T (+ bias) for 1 <= M <= 8 rows, float32",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
#endif
#if SERVAL_FUSED_OPS
  m.def("quant_linear", &quant_linear,
        "x [M, K] @ dequantize(w [N, row_bytes], qtype)^T (+ bias), float32; qtype: 0 Q8_0, 1 Q4_0, 2 Q4_1, "
        "3 Q5_0, 4 Q5_1, 10 Q4_K, 11 Q5_K, 12 Q6_K; batch-invariant",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias") = py::none());
  m.def("quant_linear_reference", &quant_linear_reference,
        "quant_linear's arithmetic in scalar code, operation for operation (its bit-exact reference)",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias") = py::none());
#endif
#if SERVAL_FUSED_OPS && !SERVAL_QUANT_ONLY
  m.def("decode_stack", &decode_stack,
        "A Llama decoder stack's decode-only step (one token per request, float32): final-normed hidden [T, hidden]",
        py::arg("hidden"), py::arg("layer_weights"), py::arg("packed_weights"), py::arg("kv_caches"), py::arg("final_norm"), py::arg("positions"),
        py::arg("slot_mappings"), py::arg("cos_sin"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("eps"), py::arg("scale"), py::arg("native_rows"),
        py::arg("weight_formats"), py::arg("windows"), py::arg("layer_groups"));
#endif
}
