// The CPU decoder's layer loop for int8w (model/cpu_forward.py's loop, the same ops in the same order): each
// layer's nine calls go to mvllm's fused and int8 ops through the dispatcher from C++, so a decode step pays no
// Python between them (on the 2-vCPU machine, 6-7 ms of a 57-63 ms step was Python between the ops).
// The ops are looked up by name: mvllm_fused and mvllm_int8 must be loaded first (kernels/cpu_layers.py does).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace {

using Opt = std::optional<at::Tensor>;

template <class Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

constexpr int64_t kPerLayer = 12;  // the weights of a layer, in this order (kernels/cpu_layers.py packs them)
enum : int64_t { kNorm1, kQkvQ, kQkvS, kQkvB, kOQ, kOS, kOB, kNorm2, kGateUpQ, kGateUpS, kDownQ, kDownS };

// x [T, hidden] (the embeddings) through every layer and the final norm; the caches written at `slots`. With
// out_rows (the rows the LM head reads: each prefill's last), the last layer computes only those rows past its
// KV-cache write, and only they are returned.
at::Tensor decode_layers(const at::Tensor& x_in, const c10::List<Opt>& weights, const at::TensorList caches,
                         const at::Tensor& final_norm, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& seq_of_token,
                         const at::Tensor& key_len, int64_t block_size, double scale, int64_t heads,
                         int64_t kv_heads, double eps, const Opt& out_rows) {
  static const auto norm = op<at::Tensor(const at::Tensor&, const Opt&, const at::Tensor&, double)>(
      "mvllm_fused::add_rms_norm");
  static const auto rope = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, int64_t, int64_t)>("mvllm_fused::rope_store");
  static const auto attention = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&, int64_t, double)>(
      "mvllm_fused::paged_attention");
  static const auto silu_mul = op<at::Tensor(const at::Tensor&)>("mvllm_fused::silu_mul");
  static const auto linear = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Opt&)>(
      "mvllm_int8::int8_linear");
  const int64_t layers = static_cast<int64_t>(caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer, "weights: expected ", kPerLayer,
              " per layer for ", layers, " layers, got ", weights.size());
  const std::vector<Opt> w(weights.begin(), weights.end());
  auto get = [&](int64_t layer, int64_t k) -> const at::Tensor& {
    const Opt& t = w[layer * kPerLayer + k];
    TORCH_CHECK(t.has_value(), "layer ", layer, ": weight ", k, " is missing");
    return *t;
  };
  at::Tensor x = x_in;
  Opt residual;  // none before the first layer: the first norm's residual is x itself
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor h = norm.call(x, residual, get(l, kNorm1), eps);
    if (!residual) residual = x;
    const at::Tensor qkv = linear.call(h, get(l, kQkvQ), get(l, kQkvS), w[l * kPerLayer + kQkvB]);
    at::Tensor q = rope.call(qkv, cos, sin, caches[l], slots, heads, kv_heads);
    at::Tensor seq = seq_of_token, len = key_len;
    if (l == layers - 1 && out_rows) {  // past the last KV write only the returned rows count
      const at::Tensor& rows = *out_rows;
      q = q.index_select(0, rows);
      residual = residual->index_select(0, rows);
      seq = seq.index_select(0, rows);
      len = len.index_select(0, rows);
    }
    const at::Tensor out = attention.call(q, caches[l], block_table, seq, len, block_size, scale);
    const at::Tensor o = linear.call(out, get(l, kOQ), get(l, kOS), w[l * kPerLayer + kOB]);
    const at::Tensor h2 = norm.call(o, residual, get(l, kNorm2), eps);
    const at::Tensor gate_up = linear.call(h2, get(l, kGateUpQ), get(l, kGateUpS), std::nullopt);
    x = linear.call(silu_mul.call(gate_up), get(l, kDownQ), get(l, kDownS), std::nullopt);
  }
  return norm.call(x, residual, final_norm, eps);
}

}  // namespace

TORCH_LIBRARY(mvllm_layers, m) {
  m.def("decode_layers(Tensor(b!) x, Tensor?[] weights, Tensor(a!)[] caches, Tensor final_norm, Tensor cos, Tensor sin,"
        " Tensor slots, Tensor block_table, Tensor seq_of_token, Tensor key_len, int block_size, float scale,"
        " int heads, int kv_heads, float eps, Tensor? out_rows=None) -> Tensor",
        &decode_layers);
}
