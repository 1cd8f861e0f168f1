// The op table's storage, setter and lookup (csrc/common/op_table.h).
#include "op_table.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "checks.h"

namespace lora_ops::op_table {
namespace {

constexpr const char* kOpNames[kOps] = {"sgmv", "lora_expand", "grouped_gemm"};
constexpr const char* kOpAxes[kOps] = {"positions,rank,slices,true_ranks", "positions,rank,slices,true_ranks",
                                       "positions,n,k"};
constexpr int kOpAxisCount[kOps] = {4, 4, 3};

struct Table {
  // Per axis of the op: the inclusive upper bounds of its classes but the last, which is open-ended.
  std::vector<std::vector<int64_t>> bounds;
  std::vector<uint8_t> triton;  // per regime, row-major over the axes: 1 = Triton

  bool operator==(const Table& other) const { return bounds == other.bounds && triton == other.triton; }
};

std::atomic<const Table*> g_tables[kOps] = {};
// Every distinct table ever installed lives until exit (a handful, a few hundred bytes each).
std::mutex g_kept_mutex;
std::vector<std::unique_ptr<Table>> g_kept;

Op op_named(const std::string& op) {
  for (int i = 0; i < kOps; ++i) {
    if (op == kOpNames[i]) return static_cast<Op>(i);
  }
  TORCH_CHECK_VALUE(false, "lora_ops op table: unknown op '", op, "' (expected sgmv, lora_expand or grouped_gemm)");
}

// Before a table sends any regime of `op` to Triton: the twin has a CUDA kernel, and its typed handle (the signature
// check) is made now rather than on the first call in a Triton regime.
template <Op op>
void check_twin() {
  TORCH_CHECK(c10::Dispatcher::singleton().findSchemaOrThrow(Twin<op>::name, "").hasKernelForDispatchKey(
                  c10::DispatchKey::CUDA),
              "lora_ops op table: Triton regimes for ", Twin<op>::name, ", which has no CUDA kernel (Triton absent)");
  triton_twin<op>();
}

void check_triton_twin(Op op) {
  switch (op) {
    case Op::Sgmv: return check_twin<Op::Sgmv>();
    case Op::LoraExpand: return check_twin<Op::LoraExpand>();
    case Op::GroupedGemm: return check_twin<Op::GroupedGemm>();
  }
}

std::unique_ptr<Table> parse(const std::string& op, Op which, const std::string& axes,
                             at::IntArrayRef bounds_per_axis, at::IntArrayRef bounds, at::IntArrayRef triton) {
  const int index = static_cast<int>(which);
  TORCH_CHECK_VALUE(axes == kOpAxes[index], "lora_ops op table: ", op, " axes '", axes, "', expected '",
                    kOpAxes[index], "'");
  const int axes_count = kOpAxisCount[index];
  TORCH_CHECK_VALUE(bounds_per_axis.size() == static_cast<size_t>(axes_count), "lora_ops op table: ", op, ": ",
                    num(bounds_per_axis.size()), " bound counts for ", num(axes_count), " axes");
  auto table = std::make_unique<Table>();
  table->bounds.resize(axes_count);
  size_t next = 0, regimes = 1;
  for (int a = 0; a < axes_count; ++a) {
    const auto count = static_cast<size_t>(std::max<int64_t>(bounds_per_axis[a], 0));
    TORCH_CHECK_VALUE(bounds_per_axis[a] >= 0 && next + count <= bounds.size(), "lora_ops op table: ", op,
                      ": bound counts ", num_list(bounds_per_axis), " do not match ", num(bounds.size()), " bounds");
    table->bounds[a].assign(bounds.begin() + next, bounds.begin() + next + count);
    const auto& b = table->bounds[a];
    TORCH_CHECK_VALUE(std::adjacent_find(b.begin(), b.end(), std::greater_equal<int64_t>()) == b.end(),
                      "lora_ops op table: ", op, ": bounds of axis ", num(a), " must increase");
    next += count;
    regimes *= b.size() + 1;
  }
  TORCH_CHECK_VALUE(next == bounds.size() && triton.size() == regimes, "lora_ops op table: ", op, ": ",
                    num(triton.size()), " regimes given for ", num(regimes), " (", num(bounds.size()), " bounds)");
  bool any_triton = false;
  for (const int64_t t : triton) {
    TORCH_CHECK_VALUE(t == 0 || t == 1, "lora_ops op table: ", op, ": regime values must be 0 or 1");
    table->triton.push_back(static_cast<uint8_t>(t));
    any_triton |= t == 1;
  }
  if (any_triton) check_triton_twin(which);
  return table;
}

}  // namespace

bool says_triton(Op op, const std::array<int64_t, kMaxAxes>& values) {
  const Table* table = g_tables[static_cast<int>(op)].load(std::memory_order_acquire);
  if (table == nullptr) return false;
  size_t regime = 0;
  for (size_t a = 0; a < table->bounds.size(); ++a) {
    const auto& b = table->bounds[a];
    regime = regime * (b.size() + 1) + (std::lower_bound(b.begin(), b.end(), values[a]) - b.begin());
  }
  return table->triton[regime] != 0;
}

void set_table(const std::string& op, const std::string& axes, at::IntArrayRef bounds_per_axis,
               at::IntArrayRef bounds, at::IntArrayRef triton) {
  const Op which = op_named(op);
  std::unique_ptr<Table> table = triton.empty() ? nullptr : parse(op, which, axes, bounds_per_axis, bounds, triton);
  const std::lock_guard<std::mutex> lock(g_kept_mutex);
  const Table* kept = nullptr;
  if (table) {
    const auto same = std::find_if(g_kept.begin(), g_kept.end(), [&](const auto& k) { return *k == *table; });
    if (same != g_kept.end()) {
      kept = same->get();
    } else {
      kept = table.get();
      g_kept.push_back(std::move(table));
    }
  }
  g_tables[static_cast<int>(which)].store(kept, std::memory_order_release);
}

std::string choice(const std::string& op, at::IntArrayRef values) {
  const Op which = op_named(op);
  const int axes_count = kOpAxisCount[static_cast<int>(which)];
  TORCH_CHECK_VALUE(values.size() == static_cast<size_t>(axes_count), "lora_ops op table: ", num(axes_count),
                    " axis values expected for ", op, ", got ", num(values.size()));
  std::array<int64_t, kMaxAxes> all{};
  std::copy(values.begin(), values.end(), all.begin());
  return says_triton(which, all) ? "triton" : "cuda";
}

size_t kept_tables() {
  const std::lock_guard<std::mutex> lock(g_kept_mutex);
  return g_kept.size();
}

}  // namespace lora_ops::op_table
