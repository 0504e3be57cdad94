// The whole decoder stack of a Llama-family model for one decode-only step, in one call from Python.
//
// Why: at batch 1 a layer is a dozen small ops (two norms, four products, rope and the KV write, attention,
// SiLU); through Python each costs its interpreter and dispatcher time, about a tenth of what the products
// themselves take on a 135M model, paid 30 times a step. Here the same native ops run back to back in C++:
// the arithmetic is exactly that of the layers' native path (elementwise.cpp, decode_attention.cpp), and each
// float32 product is the native skinny_linear (rows <= native_rows), else the weight's oneDNN-packed copy
// through mkldnn::_linear_pointwise when there is one (what cpu_prepack.CPUFloat32Product calls), else
// at::linear (F.linear); a block-format weight's product (its format >= 0, a QuantType's kernel_id) is
// quant_linear, what NativeBlockProduct calls. Each of the four products of a layer has its own format, so a
// file whose layers mix formats (every Q4_K_M file does) runs here too; and a packed layer whose parts a file
// stores in different formats (format -2, parted.PartedBlockProduct) is its runs' quant_linear products side by
// side, then its bias, as the layer computes it.
//
// Contract (decode_stack): hidden [T, hidden] float32, the step's token embeddings, one token per request
// (row i is request i); layer_weights holds 7 tensors per layer, in order: input_layernorm [hidden],
// qkv_proj weight [(H + 2 Hk) D, hidden], qkv_proj bias (or an empty tensor), o_proj weight [hidden, H D],
// post_attention_layernorm [hidden], gate_up_proj weight [2 I, hidden], down_proj weight [hidden, I];
// packed_weights is empty or holds 4 per layer, the packed copies of qkv, o, gate_up and down (cpu_prepack), an
// empty tensor for a product with none;
// kv_caches one [2, blocks, block_size, Hk, D] per layer (float32, bf16 or half); positions int64 [T]; per KV
// cache group (engine/sched/kv_cache_groups.py) a slot_mapping int64 [T] and block_tables int32 [T, max_blocks],
// layer_groups the group of each layer; cos_sin the rope table [P, 2, D] float32; seq_lens int32 [T]; weight_formats 4 per layer, in the products' order: -1 (float32 weights), the kernel_id of the
// weight's block format, or -2 (parted: the weight its runs' bytes back to back, its packed_weights entry the
// runs' table int64 [runs, 3]: kernel_id, rows, row bytes); windows one per layer, its sliding window
// (paged_decode_attention's window: 0 for full attention). Writes each layer's new K/V into its cache and returns
// the final norm of the last layer's output [T, hidden].
#include "torch_ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <vector>

#include "vec.h"

#if SERVAL_FUSED_OPS

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale, c10::optional<torch::Tensor> out,
                                     int64_t window);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void rotary_embedding_and_cache(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                torch::Tensor cos_sin, torch::Tensor kv_cache, torch::Tensor slot_mapping);
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor w, int64_t qtype, c10::optional<torch::Tensor> bias);

namespace {

constexpr int64_t kTensorsPerLayer = 7;
constexpr int64_t kPackedPerLayer = 4;

struct StepArgs {
  torch::Tensor positions, cos_sin, seq_lens;
  std::vector<torch::Tensor> slot_mappings, block_tables;  // per KV cache group
  int64_t num_heads, num_kv_heads, head_dim, native_rows;
  double eps, scale;
};

torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const c10::optional<torch::Tensor>&,
                               c10::string_view, c10::List<c10::optional<c10::Scalar>>,
                               c10::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<c10::optional<c10::Scalar>>(), c10::string_view(""));
}

constexpr int64_t kParted = -2;

// A parted product: each run's quant_linear on its bytes of w, the outputs side by side, then + bias.
torch::Tensor parted_product(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& runs,
                             const c10::optional<torch::Tensor>& bias) {
  const auto table = runs.accessor<int64_t, 2>();
  std::vector<torch::Tensor> outputs;
  int64_t at = 0;
  for (int64_t i = 0; i < table.size(0); ++i) {
    const int64_t rows = table[i][1], row_bytes = table[i][2];
    outputs.push_back(quant_linear(x, w.narrow(0, at, rows * row_bytes).view({rows, row_bytes}), table[i][0],
                                   c10::nullopt));
    at += rows * row_bytes;
  }
  torch::Tensor y = at::cat(outputs, 1);
  return bias.has_value() ? y.add_(*bias) : y;
}

// x @ w.T (+ bias) for a weight in ``format`` (-1 float32, -2 parted, else a block format's kernel_id); packed
// is w's packed copy (a parted weight's runs), or an undefined or empty tensor.
torch::Tensor product(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& packed,
                      const torch::Tensor& bias, int64_t format, const StepArgs& a) {
  const c10::optional<torch::Tensor> b = bias.defined() && bias.numel() > 0 ? c10::optional<torch::Tensor>(bias) : c10::nullopt;
  if (format >= 0) return quant_linear(x, w, format, b);
  if (format == kParted) return parted_product(x, w, packed, b);
  if (x.size(0) <= a.native_rows) return skinny_linear(x, w, b);
  if (packed.defined() && packed.numel() > 0) return packed_linear(x, packed, b);
  return at::linear(x, w, b);
}

// One layer: (hidden, residual) -> (its MLP output, the residual stream before it), like DecoderLayer.forward.
torch::Tensor layer(const torch::Tensor* w, const torch::Tensor* packed, const int64_t* formats,
                    const torch::Tensor& kv_cache, int64_t window, int64_t group, torch::Tensor hidden,
                    torch::Tensor& residual, const StepArgs& a) {
  const torch::Tensor none;
  const int64_t t = hidden.size(0), d = a.head_dim;
  if (!residual.defined()) {
    residual = hidden;
    hidden = rms_norm(hidden, w[0], a.eps);
  } else {
    fused_add_rms_norm(hidden, residual, w[0], a.eps);  // in place: hidden = norm, residual = sum
  }
  const torch::Tensor qkv = product(hidden, w[1], packed ? packed[0] : none, w[2], formats[0], a);
  const int64_t q_size = a.num_heads * d, kv_size = a.num_kv_heads * d;
  torch::Tensor q = qkv.narrow(1, 0, q_size).view({t, a.num_heads, d});
  torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, a.num_kv_heads, d});
  torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, a.num_kv_heads, d});
  rotary_embedding_and_cache(a.positions, q, k, v, a.cos_sin, kv_cache, a.slot_mappings[group]);
  torch::Tensor attn = torch::empty({t, a.num_heads, d}, hidden.options());
  paged_decode_attention(q, kv_cache, a.block_tables[group], a.seq_lens, a.scale, attn, window);
  torch::Tensor out = product(attn.view({t, q_size}), w[3], packed ? packed[1] : none, none, formats[1], a);
  fused_add_rms_norm(out, residual, w[4], a.eps);  // out = norm(out + residual), residual = the sum
  const torch::Tensor gate_up = product(out, w[5], packed ? packed[2] : none, none, formats[2], a);
  return product(silu_and_mul(gate_up), w[6], packed ? packed[3] : none, none, formats[3], a);
}

}  // namespace

torch::Tensor decode_stack(torch::Tensor hidden, std::vector<torch::Tensor> layer_weights,
                           std::vector<torch::Tensor> packed_weights, std::vector<torch::Tensor> kv_caches, torch::Tensor final_norm, torch::Tensor positions,
                           std::vector<torch::Tensor> slot_mappings, torch::Tensor cos_sin,
                           std::vector<torch::Tensor> block_tables, torch::Tensor seq_lens, int64_t num_heads,
                           int64_t num_kv_heads, double eps, double scale, int64_t native_rows,
                           std::vector<int64_t> weight_formats, std::vector<int64_t> windows,
                           std::vector<int64_t> layer_groups) {
  const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(layer_weights.size()) == kTensorsPerLayer * num_layers,
              "decode_stack: 7 weight tensors per layer expected");
  TORCH_CHECK(packed_weights.empty() || static_cast<int64_t>(packed_weights.size()) == kPackedPerLayer * num_layers,
              "decode_stack: no packed weights or 4 per layer expected");
  TORCH_CHECK(static_cast<int64_t>(weight_formats.size()) == kPackedPerLayer * num_layers,
              "decode_stack: 4 weight formats per layer expected");
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == num_layers && static_cast<int64_t>(layer_groups.size()) ==
              num_layers, "decode_stack: one window and one KV cache group per layer expected");
  TORCH_CHECK(!block_tables.empty() && block_tables.size() == slot_mappings.size(),
              "decode_stack: one slot mapping and block table per KV cache group expected");
  for (const int64_t group : layer_groups)
    TORCH_CHECK(group >= 0 && group < static_cast<int64_t>(block_tables.size()), "decode_stack: no such group");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == torch::kFloat32 && hidden.is_contiguous(),
              "decode_stack: contiguous float32 hidden [T, hidden] expected");
  TORCH_CHECK(block_tables[0].size(0) == hidden.size(0) && seq_lens.size(0) == hidden.size(0),
              "decode_stack: one token per request");
  const int64_t head_dim = kv_caches.empty() ? 0 : kv_caches[0].size(4);
  const StepArgs args{positions, cos_sin,     seq_lens, slot_mappings, block_tables, num_heads, num_kv_heads,
                      head_dim,  native_rows, eps,      scale};
  torch::Tensor residual;
  for (int64_t i = 0; i < num_layers; ++i) {
    const torch::Tensor* packed = packed_weights.empty() ? nullptr : packed_weights.data() + i * kPackedPerLayer;
    hidden = layer(layer_weights.data() + i * kTensorsPerLayer, packed, weight_formats.data() + i * kPackedPerLayer,
                   kv_caches[i], windows[i], layer_groups[i], hidden, residual, args);
  }
  fused_add_rms_norm(hidden, residual, final_norm, eps);
  return hidden;
}

#endif  // SERVAL_FUSED_OPS
