// The CPU decoder's layer loop for int8w (model/cpu_forward.py's loop, the same ops in the same order): each
// layer's nine calls go to mvllm's fused and int8 ops through the dispatcher from C++, so a decode step pays no
// Python between them (on the 2-vCPU machine, 6-7 ms of a 57-63 ms step was Python between the ops).
// The ops are looked up by name: mvllm_fused and mvllm_int8 must be loaded first (kernels/cpu_layers.py does).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
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

// A decoder's int8w weights, kPerLayer a layer in the order above, and its final norm: held once on the C++ side
// (kernels/cpu_layers.py makes one per model), so a step passes one object, not a Python list of ~300 tensors
// (converting that list cost about 40 us a call on the development machine, warm).
struct Weights : torch::CustomClassHolder {
  std::vector<Opt> w;
  at::Tensor final_norm;
  Opt head;  // the LM head's int8 weights, which the last layer's down projection prefetches in its tail
  Weights(const c10::List<Opt>& weights, at::Tensor norm, Opt lm_head)
      : w(weights.begin(), weights.end()), final_norm(norm), head(std::move(lm_head)) {
    TORCH_CHECK(!w.empty() && w.size() % kPerLayer == 0, "weights: expected ", kPerLayer, " a layer, got ", w.size());
  }
  int64_t layers() const { return static_cast<int64_t>(w.size()) / kPerLayer; }
  const at::Tensor& get(int64_t layer, int64_t k) const {
    const Opt& t = w[layer * kPerLayer + k];
    TORCH_CHECK(t.has_value(), "layer ", layer, ": weight ", k, " is missing");
    return *t;
  }
  const Opt& maybe(int64_t layer, int64_t k) const { return w[layer * kPerLayer + k]; }
};

// x [T, hidden] (the embeddings) through every layer and the final norm; the caches written at `slots`. With
// out_rows (the rows the LM head reads: each prefill's last), the last layer computes only those rows past its
// KV-cache write, and only they are returned.
at::Tensor decode_layers(const at::Tensor& x_in, const c10::intrusive_ptr<Weights>& weights, const at::TensorList caches,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                         const at::Tensor& block_table, const at::Tensor& seq_of_token, const at::Tensor& key_len,
                         int64_t block_size, double scale, int64_t heads, int64_t kv_heads, double eps,
                         const Opt& out_rows) {
  static const auto norm = op<at::Tensor(const at::Tensor&, const Opt&, const at::Tensor&, double)>(
      "mvllm_fused::add_rms_norm");
  static const auto rope = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, int64_t, int64_t)>("mvllm_fused::rope_store");
  static const auto attention = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&, int64_t, double)>(
      "mvllm_fused::paged_attention");
  static const auto silu_mul = op<at::Tensor(const at::Tensor&)>("mvllm_fused::silu_mul");
  static const auto linear = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Opt&,
                                           const Opt&)>("mvllm_int8::int8_linear");
  const Weights& W = *weights;
  const int64_t layers = static_cast<int64_t>(caches.size());
  TORCH_CHECK(W.layers() == layers, "weights: ", W.layers(), " layers for ", layers, " caches");
  auto get = [&](int64_t layer, int64_t k) -> const at::Tensor& { return W.get(layer, k); };
  at::Tensor x = x_in;
  Opt residual;  // none before the first layer: the first norm's residual is x itself
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor h = norm.call(x, residual, get(l, kNorm1), eps);
    if (!residual) residual = x;
    const at::Tensor qkv = linear.call(h, get(l, kQkvQ), get(l, kQkvS), W.maybe(l, kQkvB), get(l, kOQ));
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
    const at::Tensor o = linear.call(out, get(l, kOQ), get(l, kOS), W.maybe(l, kOB), get(l, kGateUpQ));
    const at::Tensor h2 = norm.call(o, residual, get(l, kNorm2), eps);
    const at::Tensor gate_up = linear.call(h2, get(l, kGateUpQ), get(l, kGateUpS), std::nullopt, get(l, kDownQ));
    x = linear.call(silu_mul.call(gate_up), get(l, kDownQ), get(l, kDownS), std::nullopt,
                    l + 1 < layers ? Opt(get(l + 1, kQkvQ)) : W.head);
  }
  return norm.call(x, residual, W.final_norm, eps);
}

}  // namespace

TORCH_LIBRARY(mvllm_layers, m) {
  m.class_<Weights>("Weights").def(torch::init<c10::List<Opt>, at::Tensor, Opt>());
  m.def("decode_layers(Tensor(b!) x, __torch__.torch.classes.mvllm_layers.Weights weights, Tensor(a!)[] caches,"
        " Tensor cos, Tensor sin, Tensor slots, Tensor block_table, Tensor seq_of_token, Tensor key_len,"
        " int block_size, float scale, int heads, int kv_heads, float eps, Tensor? out_rows=None) -> Tensor",
        &decode_layers);
}
