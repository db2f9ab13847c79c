// The int8 linear's ops (mvllm_int8): the kernels are in int8_kernels.h, which the C++ layer loop (layers.cpp)
// also calls directly.

#include "int8_kernels.h"

namespace I = mvllm::int8;

TORCH_LIBRARY(mvllm_int8, m) {
  m.def("int8_linear(Tensor x, Tensor q, Tensor scales, Tensor? bias=None) -> Tensor", &I::int8_linear);
  m.def("path(int group) -> str", &I::path_name);
  m.def("has_lanes() -> bool", [] { return I::kHasLanes; });
  m.def("has_lanes8() -> bool", [] { return I::kHasLanes8; });
  m.def("amx(int group) -> bool", &I::amx_on);
  m.def("layout(int group) -> str", &I::layout);
}
