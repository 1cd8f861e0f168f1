// Test-only ops of the CPU-model build (lora_ops._ascend_model): the schemas of csrc/bindings.cpp under the
// lora_ops_ascend_model namespace. registration.cpp registers the Ascend launchers for them on the CPU key, so
// tests run the Ascend host path and kernels on the model with CPU tensors.
#include <torch/library.h>

TORCH_LIBRARY(lora_ops_ascend_model, m) {
  m.def(
      "sgmv(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor seg_indptr, Tensor seg_lora, "
      "Tensor? token_indices=None, Tensor? lora_ranks=None, Tensor? lora_scales=None, "
      "int[]? slice_offsets=None, float scale=1.0) -> ()");
  m.def(
      "grouped_gemm(Tensor(a!) y, Tensor x, Tensor w, Tensor seg_indptr, Tensor seg_weight, "
      "Tensor? token_indices=None, Tensor? n_sizes=None, Tensor? k_sizes=None, float alpha=1.0, "
      "bool accumulate=True) -> ()");
  m.def("build_segments(Tensor token_lora, int num_slots) -> (Tensor token_indices, Tensor seg_indptr, "
        "Tensor seg_lora)");
}
