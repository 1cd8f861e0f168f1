// The op schemas' arguments and returns, written once: csrc/bindings.cpp defines the ops (and the Triton-by-name
// twins) with them, and the Ascend CPU-model test library (csrc/ascend/model_ops.cpp) its test namespace's.
#pragma once

namespace lora_ops::schema {

constexpr const char* kSgmv =
    "(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor seg_indptr, Tensor seg_lora, "
    "Tensor? token_indices=None, Tensor? lora_ranks=None, Tensor? lora_scales=None, "
    "int[]? slice_offsets=None, float scale=1.0) -> ()";
constexpr const char* kLoraExpand =
    "(Tensor(a!) y, Tensor h, Tensor lora_b, Tensor? seg_indptr, Tensor seg_lora, "
    "Tensor? token_indices=None, Tensor? lora_ranks=None, Tensor? lora_scales=None, "
    "int[]? slice_offsets=None, float scale=1.0) -> ()";
constexpr const char* kGroupedGemm =
    "(Tensor(a!) y, Tensor x, Tensor w, Tensor seg_indptr, Tensor seg_weight, "
    "Tensor? token_indices=None, Tensor? n_sizes=None, Tensor? k_sizes=None, float alpha=1.0, "
    "bool accumulate=True) -> ()";
constexpr const char* kFoldLinear =
    "(Tensor x, Tensor weight, Tensor? bias=None, Tensor? seg_indptr=None, int slot_rows=0) -> Tensor";
constexpr const char* kLoraLinear =
    "(Tensor x, Tensor weight, Tensor lora_a, Tensor lora_b, Tensor token_slot, Tensor? lora_scales=None, "
    "int[]? slice_offsets=None, Tensor? bias=None) -> Tensor";
constexpr const char* kBuildSegments =
    "(Tensor token_lora, int num_slots) -> (Tensor token_indices, Tensor seg_indptr, Tensor seg_lora)";

}  // namespace lora_ops::schema
