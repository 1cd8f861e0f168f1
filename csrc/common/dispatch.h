// Runtime DType -> compile-time tag, torch-free so CUDA kernel files can use it (docs/design.md §4).
// Each backend maps the tag to its own element type (c10::BFloat16 on CPU, __nv_bfloat16 on CUDA).
#pragma once
#include <type_traits>

#include "params.h"

namespace lora_ops {

template <DType D>
using DTypeTag = std::integral_constant<DType, D>;

template <class F>
decltype(auto) dispatch_dtype(DType d, F&& f) {
  switch (d) {
    case DType::F16: return f(DTypeTag<DType::F16>{});
    case DType::BF16: return f(DTypeTag<DType::BF16>{});
    default: return f(DTypeTag<DType::F32>{});
  }
}

}  // namespace lora_ops
