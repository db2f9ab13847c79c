// The fused CPU ops (mvllm_fused): the kernels are in fused_kernels.h, which the C++ layer loop (layers.cpp) also
// calls directly.

#include "fused_kernels.h"

namespace F = mvllm::fused;

TORCH_LIBRARY(mvllm_fused, m) {
  m.def("add_rms_norm(Tensor x, Tensor(a!)? residual, Tensor weight, float eps) -> Tensor", &F::add_rms_norm);
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) cache, Tensor slots, int heads, int kv_heads)"
        " -> Tensor", &F::rope_store);
  m.def("paged_attention(Tensor q, Tensor cache, Tensor block_table, Tensor seq_of_token, Tensor key_len,"
        " int block_size, float scale) -> Tensor", &F::paged_attention);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &F::silu_mul);
  m.def("attention_knob(str name, int value) -> int", &F::attention_knob);
  m.def("argmax(Tensor x) -> Tensor", &F::argmax);
}
