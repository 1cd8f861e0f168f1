// Host-side tiling of the AscendC kernels: from the checked op params (csrc/common) and the target's core count to
// the tile sizes, within the local-buffer capacities of NPU arch 2201 (Atlas A2/A3, "910B"). No torch here.
#pragma once
#include <cstdint>
#include <string>

#include "../common/params.h"
#include "tiling.h"

namespace lora_ops::ascend {

// The device a plan is for: its AI cores (AICs, each with two AIVs on arch 2201). The buffer capacities are those
// of the arch (tiling.h).
struct Target {
  uint32_t ai_cores;
};

// A plan is either launchable or carries the reason it is not (an input the kernels cannot take).
template <class Tiling>
struct Plan {
  Tiling tiling{};
  uint64_t workspace_bytes = 0;  // fp32 workspace: the AIC -> AIV output slots
  uint64_t split_bytes = 0;      // split workspace (fp32 left operands of the cube, sgmv's fp32 h), 0 without one
  bool launch = false;  // false: nothing to compute (empty input), or `error` is set
  std::string error;
};

Plan<SgmvTiling> plan_sgmv(const SgmvParams& p, const Target& target);
Plan<LoraExpandTiling> plan_lora_expand(const ExpandParams& p, const Target& target);
Plan<GroupedGemmTiling> plan_grouped_gemm(const GroupedGemmParams& p, const Target& target);
Plan<BuildSegmentsTiling> plan_build_segments(const BuildSegmentsParams& p, const Target& target);

}  // namespace lora_ops::ascend
