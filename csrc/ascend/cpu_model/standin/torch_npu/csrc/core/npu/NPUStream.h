// Stand-in for torch_npu's NPUStream.h in the CPU-model build: the model has no streams.
#pragma once

namespace c10_npu {

struct NPUStream {
  void* stream() const { return nullptr; }
};

inline NPUStream getCurrentNPUStream(int = -1) { return {}; }

}  // namespace c10_npu
