// The op table (lora_ops/op_table.py): per op, the regimes whose measured faster backend is Triton. Host-only, in
// every build (so that its setter and lookup are tested without a GPU); the CUDA kernels
// (csrc/cuda/registration.cpp) consult it on every call and redispatch a Triton regime to lora_ops::_triton_<op>.
// The setter and lookup are defined as ops in csrc/bindings.cpp.
#pragma once
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace lora_ops::op_table {

enum class Op { Sgmv, LoraExpand, GroupedGemm };
constexpr int kOps = 3;
constexpr int kMaxAxes = 4;  // sgmv and lora_expand have 4, grouped_gemm 3

// The installed table's choice for a call of `op` with these axis values (positions, rank, slices, true_ranks;
// grouped_gemm: positions, n, k, and a value past its axes that is not read): one atomic load and a few integer
// compares, no Python and no device read.
bool says_triton(Op op, const std::array<int64_t, kMaxAxes>& values);

// The true_ranks axis value of a call: 1 when it passes no lora_ranks (every adapter at the pool's rank: the serving
// layer's calls while its pool holds one rank), 2 when it passes them (any rank up to the pool's).
inline int64_t true_ranks_axis(bool ranks_given) { return ranks_given ? 2 : 1; }

// op: which op; axes: its axis names, comma-separated (checked against what the kernels compute); bounds_per_axis
// and bounds: each axis' inclusive upper bounds, concatenated; triton: one 0/1 per regime, row-major. An empty
// `triton` clears the op's table. Everything is checked, and the Triton twin of a table that sends a regime to it,
// before the table replaces the op's previous one.
void set_table(const std::string& op, const std::string& axes, at::IntArrayRef bounds_per_axis,
               at::IntArrayRef bounds, at::IntArrayRef triton);

// "triton" or "cuda": says_triton for an op named in Python.
std::string choice(const std::string& op, at::IntArrayRef values);

// How many distinct tables are kept alive (every table ever installed is kept, so that a call reading one while
// Python swaps it never reads freed memory; an identical table is reused, so this stays bounded).
size_t kept_tables();

// The Triton twin of each op: its name and its kernel's signature (the op's schema, csrc/common/schemas.h).
using SgmvSignature = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                           at::OptionalIntArrayRef, double);
using LoraExpandSignature = void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const std::optional<at::Tensor>&, const at::Tensor&, const std::optional<at::Tensor>&,
                                 const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                 at::OptionalIntArrayRef, double);
using GroupedGemmSignature = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const std::optional<at::Tensor>&,
                                  const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double, bool);

template <Op op>
struct Twin;
template <>
struct Twin<Op::Sgmv> {
  using Signature = SgmvSignature;
  static constexpr const char* name = "lora_ops::_triton_sgmv";
};
template <>
struct Twin<Op::LoraExpand> {
  using Signature = LoraExpandSignature;
  static constexpr const char* name = "lora_ops::_triton_lora_expand";
};
template <>
struct Twin<Op::GroupedGemm> {
  using Signature = GroupedGemmSignature;
  static constexpr const char* name = "lora_ops::_triton_grouped_gemm";
};

// lora_ops::_triton_<op>'s typed handle, one per op. The setter makes it (the signature check) before a table
// sends any regime of `op` to Triton, so a routed call only reads it.
template <Op op>
const c10::TypedOperatorHandle<typename Twin<op>::Signature>& triton_twin() {
  static const auto handle =
      c10::Dispatcher::singleton().findSchemaOrThrow(Twin<op>::name, "").template typed<typename Twin<op>::Signature>();
  return handle;
}

}  // namespace lora_ops::op_table
