// Declares the global-memory buffers of the next launch to the CPU model (which bounds-checks every kernel access
// against them); nothing on the device.
#pragma once
#include <ATen/core/Tensor.h>

#ifdef LORA_OPS_ASCEND_CPU_MODEL
#include "cpu_model/model_core.h"
#endif

namespace lora_ops::ascend {

// A matrix with disjoint rows is declared row by row (so its neighbours in a wider tensor stay out of bounds);
// anything else by the byte span from its first to its last element.
inline void declare_gm(const char* name, const at::Tensor& t, bool writable) {
#ifdef LORA_OPS_ASCEND_CPU_MODEL
  if (!t.defined() || t.numel() == 0) return;
  const int64_t elem = t.element_size();
  AscendC::cpu_model::GmRegion r{static_cast<const uint8_t*>(t.data_ptr()), 1, 0, 0, uint32_t(elem), writable, name};
  if (t.dim() == 2 && t.size(0) > 1 && t.stride(0) >= t.size(1)) {
    r.rows = t.size(0);
    r.row_stride = t.stride(0) * elem;
    r.row_bytes = t.size(1) * elem;
  } else {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    r.row_bytes = (last + 1) * elem;
  }
  AscendC::cpu_model::DeclareGm(r);
#else
  (void)name, (void)t, (void)writable;
#endif
}

}  // namespace lora_ops::ascend
